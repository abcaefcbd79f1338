"""The sharded train step: the same losses on every mesh, micro-batching, non-finite steps."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
import pytest

from andrea_jax import ops, optimizer, sharding, train_step
from andrea_jax.ops import qkv_projections
from andrea_jax.config import base_config

VOCAB = 128  # divisible by every mesh axis here, so vocab sharding is exercised too


def small_config(**overrides):
    c = base_config()
    m = c.model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim, m.vocab_size, m.max_len = 2, 64, 4, 256, VOCAB, 16
    c.seq_len, c.batch_size, c.steps = 16, 8, 10
    c.optimizer.warmup_steps = 2
    c.update_from_flattened_dict(overrides)
    return c


_INITIAL_STATES = {}


def initial_state(config, tx):
    """The state at init on the host, once for each setting but the mesh: every mesh starts from it. (An
    init sharded over a mesh compiles anew for each mesh; the loop's own sharded init is checked against
    one device by test_train_loop.py.)"""
    setting = {key: value for key, value in config.to_dict().items() if key != "mesh"}
    key = repr(sorted(setting.items()))
    if key not in _INITIAL_STATES:
        init = jax.jit(lambda r: sharding.unbox(train_step.init_state(r, config, tx)))
        _INITIAL_STATES[key] = jax.device_get(init(jax.random.key(0)))
    return _INITIAL_STATES[key]


def run_steps(config, mesh_sizes, num_steps=4, batches=None):
    """Losses (and final params) of `num_steps` steps on a (data, fsdp, tensor) mesh."""
    config.mesh.update(dict(zip(("data", "fsdp", "tensor"), mesh_sizes)))
    mesh = sharding.make_mesh(config, jax.devices()[: int(np.prod(mesh_sizes))])
    rules = sharding.rules(config)
    tx = optimizer.make(config)
    host_state = initial_state(config, tx)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        init = partial(train_step.init_state, config=config, tx=tx)
        boxed = jax.eval_shape(init, jax.random.key(0))
        shardings = sharding.logical_shardings(boxed, mesh, rules)
        state = jax.device_put(host_state, shardings)
        batch_sharding = sharding.batch_sharding(mesh)
        step = jax.jit(train_step.make_train_step(config, tx, optimizer.learning_rate_schedule(config)),
                       in_shardings=(shardings, batch_sharding),
                       out_shardings=(shardings, sharding.replicated(mesh)), donate_argnums=0)
        losses = []
        for i in range(num_steps):
            batch = batches[i] if batches else \
                np.random.default_rng(i).integers(0, VOCAB, (config.batch_size, config.seq_len + 1)).astype(np.int32)
            state, metrics = step(state, jax.device_put(batch, batch_sharding))
            losses.append(float(metrics["loss"]))
        return np.array(losses), jax.device_get(state), shardings


@pytest.fixture(scope="module")
def single_device_run():
    return run_steps(small_config(), (1, 1, 1))


@pytest.mark.parametrize("mesh_sizes", [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2)],
                         ids=["data8", "fsdp8", "data2-fsdp2-tensor2", "fsdp4-tensor2"])
def test_losses_match_one_device_on_every_mesh(single_device_run, mesh_sizes):
    base_losses, base_state, _ = single_device_run
    losses, state, shardings = run_steps(small_config(), mesh_sizes)
    assert base_losses[-1] < base_losses[0]  # it is training
    np.testing.assert_allclose(losses, base_losses, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(state["params"]["block_1"]["mlp"]["fc_kernel"],
                               base_state["params"]["block_1"]["mlp"]["fc_kernel"], atol=1e-6)
    # The parameters really are split as the rules say.
    fc = shardings["params"]["block_0"]["mlp"]["fc_kernel"].spec
    if mesh_sizes[1] > 1:
        assert fc[0] == "fsdp"
    if mesh_sizes[2] > 1:
        assert fc[1] == "tensor"
        assert shardings["params"]["token_embed"].spec[0] == "tensor"


def test_optimizer_moments_are_sharded_like_params():
    _, _, shardings = run_steps(small_config(), (1, 4, 2), num_steps=1)
    adam = shardings["opt_state"][1][0]
    assert adam.mu["block_0"]["attn"]["qkv_kernel"].spec == \
        shardings["params"]["block_0"]["attn"]["qkv_kernel"].spec == jax.sharding.PartitionSpec("fsdp", None, "tensor", None)


def test_micro_batches_accumulate_to_the_full_batch_gradient(single_device_run):
    base_losses, base_state, _ = single_device_run
    losses, state, _ = run_steps(small_config(microbatches=4), (2, 1, 1))
    np.testing.assert_allclose(losses, base_losses, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(state["params"]["token_embed"], base_state["params"]["token_embed"], atol=1e-6)


def test_non_finite_step_leaves_the_state_unchanged():
    config = small_config()
    config.optimizer.learning_rate = 1e3  # a few steps of this blow the loss up
    config.optimizer.warmup_steps = 0
    config.optimizer.grad_clip_norm = 1e9
    batch = np.random.default_rng(0).integers(0, VOCAB, (8, 17)).astype(np.int32)
    tx = optimizer.make(config)
    state = sharding.unbox(train_step.init_state(jax.random.key(0), config, tx))
    step = jax.jit(train_step.make_train_step(config, tx, optimizer.learning_rate_schedule(config)))
    for _ in range(30):
        previous = state
        state, metrics = step(state, batch)
        if not bool(metrics["finite"]):
            break
    else:
        pytest.fail("the learning rate of 1e3 never produced a non-finite loss")
    for new, old in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(previous["params"])):
        np.testing.assert_array_equal(new, old)
    assert int(state["step"]) == int(previous["step"]) + 1


def test_loss_at_init_is_log_vocab():
    config = small_config()
    tx = optimizer.make(config)
    state = sharding.unbox(train_step.init_state(jax.random.key(0), config, tx))
    batch = np.random.default_rng(1).integers(0, VOCAB, (8, 17)).astype(np.int32)
    loss = float(train_step.token_losses(state["params"], config.model, jnp.asarray(batch))[0].mean())
    assert loss == pytest.approx(np.log(VOCAB), abs=0.05)


def test_bf16_steps_on_a_sharded_mesh_track_one_device_and_float32_autodiff(monkeypatch):
    # The written-out backward (ops.matmul) in bf16 under fsdp and
    # tensor sharding must move the parameters as one device does, and as plain float32
    # autodiff does: compared by the direction of the whole update after 4 AdamW steps (a
    # sign error in any gradient turns it around; 4 losses on random tokens would not).
    bf16 = {"model.dtype": "bfloat16"}
    _, start, _ = run_steps(small_config(**bf16), (1, 1, 1), num_steps=0)
    flat = lambda state: np.concatenate([np.ravel(p) for p in jax.tree.leaves(state["params"])])
    update = lambda state: flat(state) - flat(start)
    cosine = lambda u, v: float(u @ v / np.linalg.norm(u) / np.linalg.norm(v))
    one_device = update(run_steps(small_config(**bf16), (1, 1, 1))[1])
    sharded = update(run_steps(small_config(**bf16), (2, 2, 2))[1])
    autodiff_matmul = lambda x, kernel, spec, dtype, out_dtype=jnp.float32, bias=0.0: (jnp.einsum(
        spec, x.astype(dtype), kernel.astype(dtype), preferred_element_type=jnp.float32) + bias).astype(out_dtype)
    monkeypatch.setitem(ops.LOWERINGS, "cpu", dataclasses.replace(
        ops.CPU, matmul=autodiff_matmul,
        qkv_projections=partial(qkv_projections.three_products, matmul=autodiff_matmul)))
    float32 = update(run_steps(small_config(), (1, 1, 1))[1])
    assert cosine(sharded, one_device) > 0.999
    assert cosine(one_device, float32) > 0.98
    assert 0.9 < np.linalg.norm(one_device) / np.linalg.norm(float32) < 1.1


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_bfloat16_losses_follow_float32_within_bfloat16_error_with_each_platforms_products(platform, monkeypatch):
    """12 steps that learn (a repeated batch) in bfloat16 stay within bf16's error of float32's losses.

    "tpu" runs the accelerators' numerics on this CPU: products returned in bfloat16, the MLP's
    pre-activation saved in bfloat16 and its GELU recomputed, no CPU-only barrier."""
    monkeypatch.setattr(sharding, "program_platform", lambda: platform)
    batch = np.random.default_rng(0).integers(0, VOCAB, (8, 17)).astype(np.int32)
    repeated = [batch] * 12
    float32, _, _ = run_steps(small_config(**{"optimizer.learning_rate": 3e-3}), (1, 1, 1), 12, repeated)
    bfloat16, _, _ = run_steps(small_config(**{"optimizer.learning_rate": 3e-3, "model.dtype": "bfloat16"}),
                               (1, 1, 1), 12, repeated)
    assert float32[-1] < float32[0] - 0.5  # it learns: a mistake in the backward would show
    # bf16 keeps 8 bits of mantissa: a loss near 4.8 moves by a few hundredths, not tenths.
    assert np.abs(bfloat16 - float32).max() < 0.05
