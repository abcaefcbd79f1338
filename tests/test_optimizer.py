"""Warmup and decay, and which parameters decay."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from andrea_jax import model, optimizer
from andrea_jax.config import base_config


def schedule_config(decay):
    c = base_config()
    c.steps = 1000
    c.optimizer.update(dict(learning_rate=1e-3, warmup_steps=100, decay=decay, min_learning_rate_ratio=0.1))
    return c


def test_cosine_schedule_warms_up_then_decays_to_the_floor():
    lr = optimizer.learning_rate_schedule(schedule_config("cosine"))
    assert float(lr(0)) == 0.0
    assert float(lr(50)) == pytest.approx(5e-4)
    assert float(lr(100)) == pytest.approx(1e-3)
    assert float(lr(550)) == pytest.approx(1e-4 + 0.5 * 9e-4, rel=1e-4)  # half way down the cosine
    assert float(lr(1000)) == pytest.approx(1e-4)


def test_linear_and_constant_schedules():
    linear = optimizer.learning_rate_schedule(schedule_config("linear"))
    assert float(linear(550)) == pytest.approx(5.5e-4)
    assert float(linear(1000)) == pytest.approx(1e-4)
    constant = optimizer.learning_rate_schedule(schedule_config("constant"))
    assert float(constant(900)) == pytest.approx(1e-3)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_only_matrices_decay(scan_layers):
    m = base_config().model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim, m.scan_layers = 2, 64, 4, 256, scan_layers
    params = nn.meta.unbox(jax.eval_shape(lambda r: model.init_params(m, r), jax.random.key(0)))
    mask = optimizer.weight_decay_mask(params, decay_embedding=True)
    flat = {jax.tree_util.keystr(p, simple=True, separator="/"): v
            for p, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
    decayed = sorted(k.rsplit("/", 1)[-1] for k, v in flat.items() if v)
    assert set(decayed) == {"token_embed", "qkv_kernel", "out_kernel", "fc_kernel", "proj_kernel"}
    assert not any(v for k, v in flat.items() if k.endswith(("bias", "scale", "position_embed")))
    no_embed = optimizer.weight_decay_mask(params, decay_embedding=False)
    assert no_embed["token_embed"] is False


def test_weight_decay_shrinks_matrices_but_not_biases():
    c = base_config()
    c.optimizer.update(dict(learning_rate=0.1, warmup_steps=0, decay="constant", weight_decay=0.5))
    params = {"fc_kernel": np.ones((2, 2), np.float32), "fc_bias": np.ones((2,), np.float32)}
    tx = optimizer.make(c)
    zero_grads = jax.tree.map(np.zeros_like, params)
    updates, _ = tx.update(zero_grads, tx.init(params), params, learning_rate=0.1)
    assert np.allclose(updates["fc_kernel"], -0.1 * 0.5)
    assert np.all(updates["fc_bias"] == 0)


def test_the_passed_rate_gives_optax_adamw_s_updates_and_state_layout():
    """Step by step (none skipped) the same numbers as optax.adamw with the schedule, and the same
    state tree, so checkpoints written with optax.adamw restore."""
    c = schedule_config("cosine")
    c.optimizer.update(dict(warmup_steps=2, grad_clip_norm=1e9))
    schedule = optimizer.learning_rate_schedule(c)
    reference = optax.chain(optax.clip_by_global_norm(1e9), optax.adamw(
        schedule, b1=c.optimizer.b1, b2=c.optimizer.b2, eps=c.optimizer.eps, weight_decay=c.optimizer.weight_decay,
        mask=lambda p: optimizer.weight_decay_mask(p, True)))
    tx = optimizer.make(c)
    params = {"fc_kernel": np.full((3, 2), 0.5, np.float32), "fc_bias": np.zeros((2,), np.float32)}
    ours, theirs = tx.init(params), reference.init(params)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for step in range(4):
        grads = jax.tree.map(lambda p: np.full_like(p, 0.1 * (step + 1)), params)
        updates, ours = tx.update(grads, ours, params, learning_rate=schedule(step))
        expected, theirs = reference.update(grads, theirs, params)
        for a, b in zip(jax.tree.leaves((updates, ours)), jax.tree.leaves((expected, theirs))):
            np.testing.assert_array_equal(a, b)
