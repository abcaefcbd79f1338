"""Warmup and decay, and which parameters decay."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
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


def wsd_config(shape, steps=1000):
    c = schedule_config("wsd")
    c.steps = steps
    c.optimizer.update(dict(cooldown_steps=200, cooldown_shape=shape))
    return c


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
def test_wsd_warms_up_holds_the_peak_then_cools_down_to_the_floor(shape):
    lr = optimizer.learning_rate_schedule(wsd_config(shape))
    assert float(lr(50)) == pytest.approx(5e-4)
    assert float(lr(100)) == pytest.approx(1e-3)  # the end of warmup
    assert float(lr(500)) == pytest.approx(1e-3)  # stable
    assert float(lr(800)) == pytest.approx(1e-3)  # the cooldown's first step is still the peak
    # a quarter into the cooldown: linear has come down a quarter of the way, 1-sqrt half of it
    down = {"linear": 0.25, "1-sqrt": 0.5}[shape]
    assert float(lr(850)) == pytest.approx(1e-3 - down * 9e-4, rel=1e-5)
    assert float(lr(999)) == pytest.approx(1e-4 + 9e-4 * (1 - {"linear": 199 / 200, "1-sqrt": np.sqrt(199 / 200)}[shape]),
                                           rel=1e-4)  # the last step trained
    assert float(lr(1000)) == pytest.approx(1e-4)
    assert optimizer.cooldown_start(wsd_config(shape)) == 800
    assert optimizer.cooldown_start(schedule_config("cosine")) is None


def test_a_wsd_run_resumed_with_more_steps_while_at_its_peak_changes_no_rate_already_applied():
    planned, moved = optimizer.learning_rate_schedule(wsd_config("1-sqrt")), \
        optimizer.learning_rate_schedule(wsd_config("1-sqrt", steps=1400))
    resumed_at = 700  # still at the peak in both plans
    np.testing.assert_array_equal([float(planned(k)) for k in range(resumed_at)],
                                  [float(moved(k)) for k in range(resumed_at)])
    assert float(moved(1000)) == pytest.approx(1e-3) and float(moved(1400)) == pytest.approx(1e-4)
    # Ending it early: steps = the checkpoint's step + cooldown_steps cools down from there.
    ended = optimizer.learning_rate_schedule(wsd_config("1-sqrt", steps=resumed_at + 200))
    assert float(ended(resumed_at)) == pytest.approx(1e-3) and float(ended(resumed_at + 200)) == pytest.approx(1e-4)


def small_params(scan_layers=False):
    m = base_config().model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim, m.max_len, m.vocab_size, m.scan_layers = 2, 32, 4, 64, 16, 50, scan_layers
    return nn.meta.unbox(model.init_params(m, jax.random.key(0)))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(scan_layers):
    groups = optimizer.muon_groups(small_params(scan_layers))
    flat = {jax.tree_util.keystr(p, simple=True, separator="/"): v
            for p, v in jax.tree_util.tree_flatten_with_path(groups)[0]}
    assert {k.rsplit("/", 1)[-1] for k, v in flat.items() if v == "muon"} == \
        {"qkv_kernel", "out_kernel", "fc_kernel", "proj_kernel"}
    assert {k.rsplit("/", 1)[-1] for k, v in flat.items() if v == "adam"} == \
        {"token_embed", "position_embed", "qkv_bias", "out_bias", "fc_bias", "proj_bias", "scale", "bias"}


def newton_schulz(matrix, steps=5):
    """Muon's quintic iteration in float64 NumPy (Keller Jordan's coefficients), wide side last."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = matrix.shape[0] > matrix.shape[1]
    x = matrix.T if tall else matrix
    x = x / (np.linalg.norm(x) + 1e-8)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def test_muon_s_update_of_each_matrix_is_newton_schulz_of_its_nesterov_momentum():
    """Two updates with no decay and no clipping against NumPy: q, k and v each orthogonalised as the [D, H·K]
    projection it stands for, the output projection as [H·K, D], the MLP's as they are; scaled to AdamW's RMS."""
    c = base_config()
    c.optimizer.update(dict(name="muon", weight_decay=0.0, grad_clip_norm=1e9, muon_ns_dtype="float32"))
    params = small_params()
    tx = optimizer.make(c)
    state, rng, beta = tx.init(params), np.random.default_rng(0), c.optimizer.muon_momentum
    grads = [jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params) for _ in range(2)]
    update = jax.jit(lambda g, s, p: tx.update(g, s, p, learning_rate=0.5))
    for t, step_grads in enumerate(grads, start=1):
        updates, state = update(step_grads, state, params)
        block, block_grads = updates["block_1"], step_grads["block_1"]
        # optax's Nesterov: beta × (momentum debiased one step ahead) + (1 - beta) × (gradient debiased)
        momenta = {}
        for name in ("qkv_kernel", "out_kernel", "fc_kernel"):
            part = "attn" if name != "fc_kernel" else "mlp"
            g = np.asarray(block_grads[part][name], np.float64)
            m = sum(beta ** (t - i) * (1 - beta) * np.asarray(grads[i - 1]["block_1"][part][name], np.float64)
                    for i in range(1, t + 1))
            momenta[name] = beta * m / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta ** t)
        d, three, h, k = momenta["qkv_kernel"].shape
        expected_qkv = np.stack([newton_schulz(momenta["qkv_kernel"][:, i].reshape(d, h * k)).reshape(d, h, k)
                                 for i in range(three)], axis=1) * 0.2 * np.sqrt(max(d, h * k))
        expected_out = newton_schulz(momenta["out_kernel"].reshape(h * k, d)).reshape(h, k, d) * 0.2 * np.sqrt(d)
        fc = momenta["fc_kernel"]
        expected_fc = newton_schulz(fc) * 0.2 * np.sqrt(max(fc.shape))
        np.testing.assert_allclose(block["attn"]["qkv_kernel"], -0.5 * expected_qkv, atol=1e-5)
        np.testing.assert_allclose(block["attn"]["out_kernel"], -0.5 * expected_out, atol=1e-5)
        np.testing.assert_allclose(block["mlp"]["fc_kernel"], -0.5 * expected_fc, atol=1e-5)
    # The other group is the AdamW of optimizer.name="adamw", step for step (to float32's rounding).
    adam_c = base_config()
    adam_c.optimizer.update(dict(weight_decay=0.0, grad_clip_norm=1e9))
    adam_tx = optimizer.make(adam_c)
    adam_state = adam_tx.init(params)
    for step_grads in grads:
        adam_updates, adam_state = adam_tx.update(step_grads, adam_state, params, learning_rate=0.5)
    np.testing.assert_allclose(updates["token_embed"], adam_updates["token_embed"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(updates["block_1"]["ln_1"]["scale"], adam_updates["block_1"]["ln_1"]["scale"],
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_muon_s_direction_in_float32_is_optax_s_and_in_bfloat16_within_its_rounding(scan_layers):
    """Three updates of the Muon group: float32 iterations give optax.contrib's own direction and state; bfloat16
    iterations the same directions to a few percent, in float32, with the momentum still float32 (whether that
    trains as well: bench/RESULTS.md's study of the two)."""
    params = {k: v for k, v in small_params(scan_layers).items() if k.startswith("block")}
    muon_only = jax.tree_util.tree_map_with_path(
        lambda path, p: p if optimizer.parameter_name(path) in optimizer.MUON_MATRICES else None, params)
    dims = jax.tree_util.tree_map_with_path(lambda path, _: optimizer.MUON_MATRICES[optimizer.parameter_name(path)],
                                            muon_only)
    reference = optax.contrib.scale_by_muon(ns_steps=5, beta=0.95, nesterov=True, weight_dimension_numbers=dims)
    ours = {name: optimizer.scale_by_muon(5, 0.95, jnp.dtype(name)) for name in ("float32", "bfloat16")}
    states = {"optax": reference.init(muon_only), **{name: tx.init(muon_only) for name, tx in ours.items()}}
    rng = np.random.default_rng(1)
    for _ in range(3):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), muon_only)
        expected, states["optax"] = jax.jit(reference.update)(grads, states["optax"])
        for name, tx in ours.items():
            got, states[name] = jax.jit(tx.update)(grads, states[name])
            for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
                assert g.dtype == jnp.float32
                if name == "float32":
                    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
                else:  # five quintic steps amplify bfloat16's 0.4% rounding to a few percent of an entry
                    g, e = np.ravel(g), np.ravel(e)
                    assert g @ e / (np.linalg.norm(g) * np.linalg.norm(e)) >= 0.995
                    assert np.linalg.norm(g) == pytest.approx(np.linalg.norm(e), rel=0.06)
    for name in ours:  # the same state as optax's: a checkpoint of either restores into the other
        assert jax.tree.structure(states[name]) == jax.tree.structure(states["optax"])
        for e, g in zip(jax.tree.leaves(states["optax"]), jax.tree.leaves(states[name])):
            assert g.dtype == e.dtype
            np.testing.assert_allclose(g, e, rtol=1e-6)


def test_muon_s_iterations_are_float32_on_cpus_and_a_resumed_run_keeps_its_own(tmp_path):
    """(bfloat16 on a GPU: tests/test_compile_check.py's H200 Muon step.)"""
    from andrea_jax import resolve, run_dir
    c = base_config()
    c.optimizer.name = "muon"
    device = jax.devices()[0]
    assert resolve.for_devices(c, device).optimizer.muon_ns_dtype == "float32"
    saved = base_config()
    saved.optimizer.muon_ns_dtype = "bfloat16"
    assert resolve.for_devices(c, device, saved=saved).optimizer.muon_ns_dtype == "bfloat16"
    saved.optimizer.muon_ns_dtype = "auto"  # a run stopped before its first step: this device decides
    assert resolve.for_devices(c, device, saved=saved).optimizer.muon_ns_dtype == "float32"
    # A run saved before the key computed in float32, where an accelerator would now choose bfloat16.
    older = base_config().to_dict()
    del older["optimizer"]["muon_ns_dtype"]
    (tmp_path / run_dir.CONFIG_FILE).write_text(json.dumps({"project": run_dir.PROJECT, "config": older}))
    assert run_dir.load_saved_config(str(tmp_path)).optimizer.muon_ns_dtype == "float32"
    with pytest.raises(ValueError, match="muon_ns_dtype='auto' is decided"):
        optimizer.make(c)
