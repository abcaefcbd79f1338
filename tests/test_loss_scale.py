"""float16 with dynamic loss scaling: small gradients survive, overflows skip, resumes stay exact."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from andrea_jax import loss_scale, optimizer, sharding, train_loop, train_step
from andrea_jax.config import base_config
from tests.test_train_loop import loop_config, losses

PERIODIC_BATCH = np.tile(np.arange(33) % 7, (16, 1)).astype(np.int32)  # learnt to a loss near zero


def small_config(dtype, **overrides):
    c = base_config()
    m = c.model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim, m.vocab_size, m.max_len = 2, 64, 4, 256, 256, 32
    m.dtype = dtype
    c.seq_len, c.batch_size, c.steps, c.microbatches = 32, 16, 100, 1
    c.optimizer.learning_rate, c.optimizer.warmup_steps = 1e-2, 0
    c.update_from_flattened_dict(overrides)
    return c


def one_step(config, params, batch, scale=None):
    """(new state, metrics) of one step from `params` with fresh moments (and `scale`, for float16)."""
    tx = optimizer.make(config)
    state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)}
    if scale is not None:
        state["loss_scale"] = {**loss_scale.init(), "scale": jnp.float32(scale)}
    return jax.jit(train_step.make_train_step(config, tx, optimizer.learning_rate_schedule(config)))(state, batch)


def test_the_scale_halves_on_overflow_and_doubles_after_a_run_of_good_steps(monkeypatch):
    monkeypatch.setattr(loss_scale, "GROWTH_INTERVAL", 3)
    state = loss_scale.init()
    scales = []
    for finite in [True, True, False, True, True, True, True]:
        state = loss_scale.update(state, jnp.bool_(finite))
        scales.append(float(state["scale"]))
    s = loss_scale.INITIAL_SCALE
    assert scales == [s, s, s / 2, s / 2, s / 2, s, s]
    assert int(state["skipped_steps"]) == 1 and int(state["good_steps"]) == 1


def test_float16_is_scaled_and_float32_bfloat16_are_not():
    for dtype, scaled in [("float16", True), ("float32", False), ("bfloat16", False)]:
        config = small_config(dtype)
        boxed = jax.eval_shape(lambda r: train_step.init_state(r, config, optimizer.make(config)), jax.random.key(0))
        assert ("loss_scale" in boxed) == scaled


@pytest.fixture(scope="module")
def trained_params():
    """A model fitted to a periodic sequence in float32: its gradients are small, as late in training."""
    config = small_config("float32")
    tx = optimizer.make(config)
    state = sharding.unbox(train_step.init_state(jax.random.key(0), config, tx))
    step = jax.jit(train_step.make_train_step(config, tx, optimizer.learning_rate_schedule(config)))
    for _ in range(60):
        state, metrics = step(state, PERIODIC_BATCH)
    assert float(metrics["loss"]) < 0.01
    return state["params"]


def test_small_gradients_underflow_in_float16_unless_the_loss_is_scaled(trained_params):
    _, exact = one_step(small_config("float32"), trained_params, PERIODIC_BATCH)
    _, scaled = one_step(small_config("float16"), trained_params, PERIODIC_BATCH, scale=loss_scale.INITIAL_SCALE)
    _, unscaled = one_step(small_config("float16"), trained_params, PERIODIC_BATCH, scale=1.0)
    relative_error = lambda m: abs(float(m["grad_norm"]) / float(exact["grad_norm"]) - 1)
    assert relative_error(scaled) < 0.005  # measured 0.0004
    assert relative_error(unscaled) > 0.05  # measured 0.15: the cotangents below 6e-8 are lost
    assert int(scaled["skipped_steps"]) == 0


def test_an_overflow_skips_the_step_and_halves_the_scale(trained_params):
    config = small_config("float16")
    new_state, metrics = one_step(config, trained_params, PERIODIC_BATCH, scale=2.0 ** 40)
    assert not np.isfinite(float(metrics["grad_norm"])) and bool(metrics["finite"])  # skipped, not stopped
    assert int(metrics["skipped_steps"]) == 1 and float(new_state["loss_scale"]["scale"]) == 2.0 ** 39
    unchanged = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), new_state["params"], trained_params)
    assert all(jax.tree.leaves(unchanged))
    assert int(new_state["step"]) == 1  # the batch is spent (and the schedule, read from the step, moves on)
    unchanged = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), new_state["opt_state"],
                             optimizer.make(config).init(trained_params))
    assert all(jax.tree.leaves(unchanged))  # the moments and Adam's count wait


def test_after_skipped_steps_an_update_applies_the_rate_it_logs():
    # PyTorch's GradScaler with a scheduler: step k applies schedule(k) even after skipped steps.
    config = small_config("float16", **{"optimizer.warmup_steps": 10, "optimizer.weight_decay": 0.0})
    tx = optimizer.make(config)
    schedule = optimizer.learning_rate_schedule(config)
    step = jax.jit(train_step.make_train_step(config, tx, schedule))
    state = sharding.unbox(train_step.init_state(jax.random.key(0), config, tx))
    first_params = state["params"]
    state["loss_scale"]["scale"] = jnp.float32(2.0 ** 40)  # overflows at 2^40, 2^39 and 2^38
    for _ in range(3):
        state, metrics = step(state, PERIODIC_BATCH)
    assert int(metrics["skipped_steps"]) == 3
    state["loss_scale"]["scale"] = jnp.float32(2.0 ** 10)
    before = state["params"]
    state, metrics = step(state, PERIODIC_BATCH)
    assert int(metrics["skipped_steps"]) == 3
    assert float(metrics["lr"]) == pytest.approx(float(schedule(3)), rel=1e-6) and float(schedule(3)) > 0
    # Adam's first update moves each weight by lr · g / (|g| + eps): by the rate itself where |g| >> eps.
    moved = max(float(jnp.max(jnp.abs(new - old)))
                for new, old in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(before)))
    assert moved == pytest.approx(float(metrics["lr"]), rel=1e-3)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), before, first_params)))


def test_float16_losses_track_float32_over_a_short_run():
    runs = {}
    for dtype in ("float32", "float16"):
        config = small_config(dtype, **{"optimizer.learning_rate": 3e-3})
        tx = optimizer.make(config)
        state = sharding.unbox(train_step.init_state(jax.random.key(0), config, tx))
        step = jax.jit(train_step.make_train_step(config, tx, optimizer.learning_rate_schedule(config)))
        runs[dtype] = []
        text = np.random.default_rng(0).integers(0, 256, 300).astype(np.int32)  # windows of it: learnable
        for index in range(12):
            starts = np.random.default_rng(index).integers(0, len(text) - 33, 16)
            batch = np.stack([text[start:start + 33] for start in starts])
            state, metrics = step(state, batch)
            runs[dtype].append(float(metrics["loss"]))
    assert runs["float32"][-1] < runs["float32"][0] - 0.2  # it learns
    np.testing.assert_allclose(runs["float16"], runs["float32"], atol=0.02)


def test_a_resume_across_scale_changes_is_exact(tmp_path, monkeypatch):
    # A first scale near float16's limit and growth every 2 good steps: the scale grows,
    # overflows (a skipped step, halved) and grows again within the 8 steps, across the resume at 4.
    monkeypatch.setattr(loss_scale, "INITIAL_SCALE", 2.0 ** 22)
    monkeypatch.setattr(loss_scale, "GROWTH_INTERVAL", 2)
    devices = jax.devices()[:1]
    unbroken, resumed = str(tmp_path / "unbroken"), str(tmp_path / "resumed")
    config = loop_config(tmp_path, log_every=1, **{"model.dtype": "float16"})
    train_loop.train(config, unbroken, devices=devices)
    # The same run up to step 4, as if it had stopped there: its copy without the checkpoint of step 8.
    shutil.copytree(unbroken, resumed, ignore=lambda directory, names: ["8"] if directory.endswith("checkpoints")
                    else [])
    train_loop.train(config, resumed, devices=devices)
    scales = [scale for _, scale in losses(unbroken, "loss_scale")]
    assert any(later < earlier for earlier, later in zip(scales, scales[1:]))  # halved
    assert any(later > earlier for earlier, later in zip(scales, scales[1:]))  # grown
    assert losses(unbroken, "skipped_steps")[-1][1] > 0
    for key in ("loss", "loss_scale", "skipped_steps", "val_loss"):
        assert losses(resumed, key) == losses(unbroken, key)


def test_a_checkpoint_saved_in_another_dtype_resumes_in_float16_with_a_fresh_scale(tmp_path):
    devices = jax.devices()[:1]
    workdir = str(tmp_path / "run")
    train_loop.train(loop_config(tmp_path, log_every=1, **{"model.dtype": "bfloat16"}), workdir, devices=devices)
    shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
    train_loop.train(loop_config(tmp_path, log_every=1, **{"model.dtype": "float16"}), workdir, devices=devices)
    assert [step for step, _ in losses(workdir, "loss_scale")] == [5, 6, 7, 8]
    assert losses(workdir, "loss_scale")[0][1] == loss_scale.INITIAL_SCALE
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "8", "loss_scale"))
