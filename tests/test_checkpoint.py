"""Checkpoints: separate items, keep-N, async saves, any-topology restores, unreadable and foreign steps."""

import os
import shutil
import subprocess
import sys
import textwrap
from functools import partial

import flax.linen as nn
import jax
import numpy as np
import pytest

from andrea_jax import checkpoint, optimizer, sharding, train_step
from andrea_jax.config import base_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_SHA = "a" * 64


def write_corpus(directory, num_files=12, seed=0):
    """A small text corpus of word salad: enough for a char tokenizer and a few validation batches."""
    rng = np.random.default_rng(seed)
    words = ["the", "of", "and", "to", "in", "is", "that", "it", "for", "as", "with", "was", "on", "by",
             "def", "return", "value"]
    os.makedirs(directory, exist_ok=True)
    for i in range(num_files):
        lines = [" ".join(rng.choice(words, size=10)) for _ in range(60)]
        with open(os.path.join(directory, f"doc{i:02d}.txt"), "w") as f:
            f.write("\n".join(lines))
    return str(directory)


def tiny_config(tmp_path, **overrides):
    """A model of a few thousand parameters on a char tokenizer: seconds to compile and train."""
    c = base_config()
    c.model.update(dict(n_layer=2, d_model=64, n_head=4, mlp_dim=256, max_len=64, vocab_size=0))
    c.update(dict(seq_len=32, batch_size=8, steps=12, log_every=3, eval_every=6, eval_batches=2,
                  checkpoint_every=5, keep_checkpoints=3, peak_flops=1e12))  # no matmul benchmark at start
    c.optimizer.update(dict(learning_rate=3e-3, warmup_steps=3))
    corpus = tmp_path / "corpus"
    c.data.update(dict(source="text:" + (str(corpus) if corpus.exists() else write_corpus(corpus)),
                       tokenizer="char", cache_dir=str(tmp_path / "cache"), val_fraction=0.2))
    c.update_from_flattened_dict(overrides)
    return c


_HOST_STATES = {}


def state_on(config, devices, mesh_axes=(-1, 1, 1)):
    """(state, abstract state without "step") for `config`, placed with the run's shardings on `devices`."""
    config = config.copy_and_resolve_references()
    config.mesh.update(dict(zip(("data", "fsdp", "tensor"), mesh_axes)))
    mesh = sharding.make_mesh(config, devices)
    rules = sharding.rules(config)
    init = partial(train_step.init_state, config=config, tx=optimizer.make(config))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(init, jax.random.key(config.seed))
        shardings = sharding.logical_shardings(boxed, mesh, rules)
    key = config.model.to_json()
    if key not in _HOST_STATES:  # initialised once, then placed on each mesh: compiling is the slow part here
        _HOST_STATES[key] = jax.device_get(jax.jit(lambda rng: sharding.unbox(init(rng)))(jax.random.key(0)))
    state = jax.device_put(_HOST_STATES[key], shardings)
    abstract = checkpoint.abstract_like(sharding.unbox(boxed), shardings)
    return state, {k: v for k, v in abstract.items() if k != "step"}


@pytest.fixture(scope="module")
def model_config():
    c = base_config()
    c.model.update(dict(n_layer=2, d_model=64, n_head=4, mlp_dim=256, max_len=64, vocab_size=128))
    c.update(dict(seq_len=32, batch_size=8))
    return c


def meta_for(config):
    return {"tokenizer_sha256": TOKENIZER_SHA, "config": config.to_dict(), "data_step": 0}


def assert_bit_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_restore_items_and_keep_newest(tmp_path, model_config):
    state, abstract = state_on(model_config, jax.devices()[:1])
    ckpt = checkpoint.Checkpointer(str(tmp_path), keep=2)
    for step in (2, 4, 6):
        ckpt.save(step, state, {**meta_for(model_config), "data_step": step})
    ckpt.close()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4", "6"]
    assert {"meta", "opt_state", "params"} <= set(os.listdir(tmp_path / "checkpoints" / "6"))

    ckpt = checkpoint.Checkpointer(str(tmp_path), keep=2)
    restored, meta = ckpt.restore(abstract, tokenizer_sha256=TOKENIZER_SHA)
    assert meta["step"] == 6 and meta["data_step"] == 6 and meta["project"] == "andrea-jax"
    assert meta["config"]["model"]["d_model"] == 64 and meta["tokenizer_sha256"] == TOKENIZER_SHA
    assert_bit_equal(restored["params"], state["params"])
    assert_bit_equal(restored["opt_state"], state["opt_state"])
    # Eval restores params alone: no optimizer state is read or returned.
    params_only, meta = ckpt.restore({"params": abstract["params"]}, step=4, params_only=True)
    assert set(params_only) == {"params"} and meta["step"] == 4
    assert_bit_equal(params_only["params"], state["params"])
    ckpt.close()


def test_a_step_past_keep_leaves_in_one_rename_and_its_removal_can_be_cut_short(tmp_path, model_config):
    state, abstract = state_on(model_config, jax.devices()[:1])
    ckpt = checkpoint.Checkpointer(str(tmp_path), keep=1)
    for step in (2, 4):
        ckpt.save(step, state, {**meta_for(model_config), "data_step": step})
    ckpt.wait()
    deleting = tmp_path / "checkpoints" / checkpoint.DELETING_DIR
    assert ckpt.steps() == [4] and os.listdir(deleting) == ["2"]  # whole, out of the kept steps' way
    shutil.rmtree(deleting / "2" / "params")  # as if killed while removing it
    ckpt.save(6, state, {**meta_for(model_config), "data_step": 6})  # removes what is left first
    ckpt.close()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["6"]
    ckpt = checkpoint.Checkpointer(str(tmp_path), read_only=True)
    restored, meta = ckpt.restore(abstract, tokenizer_sha256=TOKENIZER_SHA)
    ckpt.close()
    assert meta["step"] == 6
    assert_bit_equal(restored["opt_state"], state["opt_state"])


@pytest.mark.parametrize("target_devices, target_mesh", [(1, (1, 1, 1)), (8, (1, 4, 2)), (4, (4, 1, 1))])
def test_restore_onto_another_topology_is_bit_exact(tmp_path, model_config, target_devices, target_mesh):
    # Written on 8 devices, sharded over data, fsdp and tensor at once.
    state, _ = state_on(model_config, jax.devices(), (2, 2, 2))
    assert any(len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
               for leaf in jax.tree.leaves(state["params"]))
    ckpt = checkpoint.Checkpointer(str(tmp_path))
    ckpt.save(3, state, meta_for(model_config))
    ckpt.close()

    _, abstract = state_on(model_config, jax.devices()[:target_devices], target_mesh)
    ckpt = checkpoint.Checkpointer(str(tmp_path), read_only=True)
    restored, _ = ckpt.restore(abstract)
    ckpt.close()
    assert_bit_equal(restored, {"params": state["params"], "opt_state": state["opt_state"]})
    for leaf, target in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
        assert leaf.sharding == target.sharding


def test_save_is_asynchronous(tmp_path):
    # 128 MB: the write takes far longer than handing it over.
    big = {"params": {f"w{i}": jax.numpy.full((1024, 1024), i, np.float32) for i in range(16)},
           "opt_state": {"mu": jax.numpy.zeros((4096, 1024), np.float32)}}
    ckpt = checkpoint.Checkpointer(str(tmp_path))
    ckpt.save(1, big, {})
    listed_before_wait = os.path.isdir(tmp_path / "checkpoints" / "1")
    ckpt.wait()
    assert not listed_before_wait  # still writing under a temporary name when save() returned
    assert ckpt.steps() == [1]
    ckpt.close()


def test_unreadable_newest_step_falls_back_and_is_moved_aside(tmp_path, model_config, capsys):
    state, abstract = state_on(model_config, jax.devices()[:1])
    ckpt = checkpoint.Checkpointer(str(tmp_path), keep=5)
    for step in (5, 10, 15):
        ckpt.save(step, state, {**meta_for(model_config), "data_step": step})
    ckpt.close()
    steps_dir = tmp_path / "checkpoints"
    for root, _, names in os.walk(steps_dir / "15" / "params"):  # truncate every data file
        for name in names:
            if os.sep + "d" in root:
                os.truncate(os.path.join(root, name), 1)
    shutil.rmtree(steps_dir / "10" / "opt_state")  # someone deleted part of step 10

    # Read-only (eval): falls back to step 5 and touches nothing.
    reader = checkpoint.Checkpointer(str(tmp_path), read_only=True)
    _, meta = reader.restore(abstract)
    reader.close()
    assert meta["step"] == 5
    out = capsys.readouterr().out
    assert "step 15" in out and "step 10" in out and out.count("falling back to step 5") == 2
    assert sorted(os.listdir(steps_dir)) == ["10", "15", "5"]

    # Training: the same fallback, the broken steps kept aside so the run can save them again.
    ckpt = checkpoint.Checkpointer(str(tmp_path), keep=5)
    restored, meta = ckpt.restore(abstract)
    assert meta["step"] == 5 and ckpt.steps() == [5]
    assert_bit_equal(restored["params"], state["params"])
    assert sorted(os.listdir(tmp_path / checkpoint.UNREADABLE_DIR)) == ["10", "15"]
    assert "moved to" in capsys.readouterr().out
    ckpt.save(10, state, meta_for(model_config))
    ckpt.close()
    assert checkpoint.Checkpointer(str(tmp_path), read_only=True).steps() == [5, 10]


def test_half_written_and_empty_steps_are_never_picked(tmp_path, model_config):
    state, abstract = state_on(model_config, jax.devices()[:1])
    ckpt = checkpoint.Checkpointer(str(tmp_path))
    ckpt.save(4, state, meta_for(model_config))
    ckpt.close()
    steps_dir = tmp_path / "checkpoints"
    # What a save killed before its rename leaves, and a step directory emptied by hand.
    shutil.copytree(steps_dir / "4" / "params", steps_dir / "8.orbax-checkpoint-tmp" / "params")
    os.makedirs(steps_dir / "12")
    ckpt = checkpoint.Checkpointer(str(tmp_path))
    assert 8 not in ckpt.steps()
    _, meta = ckpt.restore(abstract)
    assert meta["step"] == 4
    ckpt.save(8, state, meta_for(model_config))  # the leftover does not block the step
    ckpt.close()
    assert checkpoint.Checkpointer(str(tmp_path), read_only=True).steps() == [4, 8]


def test_nothing_readable_is_an_error_not_a_fresh_start(tmp_path, model_config):
    _, abstract = state_on(model_config, jax.devices()[:1])
    os.makedirs(tmp_path / "checkpoints" / "7")
    ckpt = checkpoint.Checkpointer(str(tmp_path), read_only=True)
    with pytest.raises(checkpoint.CheckpointError, match="no readable checkpoint .*steps 7.*use a new --workdir"):
        ckpt.restore(abstract)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint for step 3 .*available steps: 7"):
        ckpt.restore(abstract, step=3)
    ckpt.close()
    assert checkpoint.Checkpointer(str(tmp_path / "new"), read_only=False).restore(abstract) is None


@pytest.mark.parametrize("change, message", [
    (dict(project="other"), "was not written by andrea-jax"),
    (dict(format=99), "checkpoint format 99"),
    (dict(tokenizer_sha256="b" * 64), "trained with tokenizer bbbbbbbbbbbb.*tokenizer.json is aaaaaaaaaaaa"),
])
def test_foreign_or_mismatched_checkpoint_is_refused(tmp_path, model_config, change, message):
    state, abstract = state_on(model_config, jax.devices()[:1])
    meta = meta_for(model_config)
    ckpt = checkpoint.Checkpointer(str(tmp_path))
    ckpt.save(2, state, meta)
    ckpt.close()
    if change:  # rewrite the metadata item the way another writer would have
        import json
        path = tmp_path / "checkpoints" / "2" / "meta" / "metadata"
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    before = sorted(os.listdir(tmp_path / "checkpoints"))
    ckpt = checkpoint.Checkpointer(str(tmp_path))
    with pytest.raises(checkpoint.CheckpointError, match=message):
        ckpt.restore(abstract, tokenizer_sha256=TOKENIZER_SHA)
    ckpt.close()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == before  # nothing moved or deleted


def test_a_save_killed_midway_leaves_only_complete_steps(tmp_path):
    script = textwrap.dedent("""
        import os, sys, time
        import jax, jax.numpy as jnp
        sys.path.insert(0, sys.argv[2])
        from andrea_jax import checkpoint
        ckpt = checkpoint.Checkpointer(sys.argv[1])
        small = {"params": {"w": jnp.full((256,), 1.0)}, "opt_state": {"mu": jnp.zeros((256,))}}
        ckpt.save(1, small, {})
        ckpt.wait()
        big = {"params": {f"w{i}": jnp.full((1024, 1024), float(i)) for i in range(24)},
               "opt_state": {"mu": jnp.zeros((1024, 1024))}}
        ckpt.save(2, big, {})
        print("saving", flush=True)
        time.sleep(600)
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    process = subprocess.Popen([sys.executable, "-c", script, str(tmp_path), ROOT], stdout=subprocess.PIPE,
                               text=True, env=env)
    try:
        assert process.stdout.readline().strip() == "saving"
    finally:
        process.kill()
        process.wait(timeout=60)
    ckpt = checkpoint.Checkpointer(str(tmp_path), read_only=True)
    steps = ckpt.steps()
    assert steps in ([1], [1, 2])  # step 2 is listed only if its write had completed
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = {"w": (256,)} if steps[-1] == 1 else {f"w{i}": (1024, 1024) for i in range(24)}
    abstract = {name: jax.ShapeDtypeStruct(shape, np.float32, sharding=device) for name, shape in shapes.items()}
    restored, meta = ckpt.restore({"params": abstract}, params_only=True)
    ckpt.close()
    assert meta["step"] == steps[-1]
    if steps[-1] == 1:
        np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.ones(256))
    else:
        np.testing.assert_array_equal(np.asarray(restored["params"]["w23"]), np.full((1024, 1024), 23.0))
