"""Training diagnostics (per-block gradient norms, delta ratios, stream norms) and the logit lens."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from andrea_jax import UserError, diagnostics, model, optimizer, sharding, train_step
from andrea_jax.gpt2 import interop
from andrea_jax.tools import logit_lens
from andrea_jax.config import base_config
from andrea_jax.data import tokenizer as tokenizers
from tests.test_ablations import np_forward_variant, np_rms_norm
from tests.test_model import init, small_model

VOCAB = 101
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak."


def small_config(**overrides):
    c = base_config()
    c.model = small_model()
    c.seq_len, c.batch_size, c.steps = 16, 8, 10
    c.optimizer.warmup_steps = 0
    c.update_from_flattened_dict(overrides)
    return c


def scanned(params, n_layer):
    """Unrolled params -> the scan_layers layout."""
    out = {k: v for k, v in params.items() if not k.startswith("block_")}
    out["blocks"] = {"block": interop.stack_blocks([params[f"block_{i}"] for i in range(n_layer)])}
    return out


def stream_stats(m, params, ids):
    _, variables = model.Transformer(m).apply({"params": params}, jnp.asarray(ids), mutable=[model.DIAGNOSTICS])
    return jax.device_get(diagnostics.stream_stats(variables[model.DIAGNOSTICS], m))


def run_step(config, params, batch):
    """One jitted train step from `params`: (metrics, new params)."""
    mesh = sharding.make_mesh(config, jax.devices()[:1])
    tx = optimizer.make(config)
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.rules(config)):
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
        step = jax.jit(train_step.make_train_step(config, tx, optimizer.learning_rate_schedule(config)))
        new_state, metrics = step(state, jnp.asarray(batch))
    return jax.device_get(metrics), jax.device_get(new_state["params"])


@pytest.fixture(scope="module")
def batch():
    return np.random.default_rng(0).integers(0, VOCAB, (8, 17)).astype(np.int32)


@pytest.fixture(scope="module")
def params():
    return init(small_model(), scale=2.0)


# ---- the train step ----

def test_diagnostics_add_their_keys_and_change_nothing_else(params, batch):
    plain, plain_params = run_step(small_config(), params, batch)
    diagnosed, diagnosed_params = run_step(small_config(diagnostics=True), params, batch)
    assert set(plain) == {"loss", "grad_norm", "lr", "finite"}
    expected = {f"diag/{name}/block_{i}" for name in ("grad_norm", "attn_delta_ratio", "mlp_delta_ratio")
                for i in range(2)} | {f"diag/stream_norm/depth_{d}" for d in range(3)}
    assert set(diagnosed) == set(plain) | expected
    for key in plain:
        np.testing.assert_allclose(diagnosed[key], plain[key], rtol=1e-6)
    for new, old in zip(jax.tree.leaves(diagnosed_params), jax.tree.leaves(plain_params)):
        np.testing.assert_allclose(new, old, rtol=1e-6, atol=1e-7)
    # The per-block norms are those of the gradient, block by block.
    grads = jax.jit(jax.grad(lambda p, b: train_step.token_losses(p, small_model(), b)[0].mean()))(params, batch)
    for i in range(2):
        direct = float(optax.tree.norm(grads[f"block_{i}"]))
        assert diagnosed[f"diag/grad_norm/block_{i}"] == pytest.approx(direct, rel=1e-5)
    blocks_squared = sum(diagnosed[f"diag/grad_norm/block_{i}"] ** 2 for i in range(2))
    assert 0 < blocks_squared < float(plain["grad_norm"]) ** 2  # the embeddings and LN_f hold the rest
    assert sorted(key for key in diagnosed if key.startswith("diag/stream_norm/")) == \
        [f"diag/stream_norm/depth_{d}" for d in range(3)]


@pytest.mark.parametrize("overrides", [dict(), dict(norm_position="post", residual=False)])
def test_stream_statistics_match_the_float64_reference(params, batch, overrides):
    m = small_model(**overrides)
    ids = batch[:2, :16]
    stats = stream_stats(m, params, ids)
    _, streams, attn_ratios, mlp_ratios = np_forward_variant(params, m, ids)
    np.testing.assert_allclose(stats["stream_norm"], [np_rms_norm(s) for s in streams], rtol=1e-5)
    np.testing.assert_allclose(stats["attn_delta_ratio"], attn_ratios, rtol=1e-5)
    np.testing.assert_allclose(stats["mlp_delta_ratio"], mlp_ratios, rtol=1e-5)


def test_a_silent_sublayer_has_a_zero_delta_and_leaves_the_stream_alone(params, batch):
    m = small_model()
    silent = jax.tree.map(lambda p: p, params)
    silent["block_1"]["attn"]["out_kernel"] = jnp.zeros_like(params["block_1"]["attn"]["out_kernel"])
    silent["block_1"]["attn"]["out_bias"] = jnp.zeros_like(params["block_1"]["attn"]["out_bias"])
    stats = stream_stats(m, silent, batch[:2, :16])
    assert stats["attn_delta_ratio"][1] == 0.0 and stats["attn_delta_ratio"][0] > 0.01
    assert stats["mlp_delta_ratio"][1] > 0.01


def test_scan_layers_read_the_same_figures_from_the_stacked_axis(params, batch):
    unrolled = small_model()
    stacked_model = small_model(scan_layers=True)
    stacked = scanned(params, 2)
    ids = batch[:2, :16]
    for key, value in stream_stats(unrolled, params, ids).items():
        np.testing.assert_allclose(stream_stats(stacked_model, stacked, ids)[key], value, rtol=1e-5)
    grads = jax.tree.map(lambda p: p * 0.5 + 1.0, params)  # any tree of the params' shapes
    np.testing.assert_allclose(diagnostics.block_grad_norms(scanned(grads, 2), stacked_model),
                               diagnostics.block_grad_norms(grads, unrolled), rtol=1e-6)
    assert float(diagnostics.block_grad_norms(grads, unrolled)[1]) == \
        pytest.approx(float(optax.tree.norm(grads["block_1"])), rel=1e-6)


@pytest.mark.slow
def test_scan_layers_and_micro_batches_give_the_same_diagnostics(params, batch):
    unrolled, _ = run_step(small_config(diagnostics=True), params, batch)
    config = small_config(diagnostics=True, microbatches=2)
    config.model.scan_layers = True
    stacked, _ = run_step(config, scanned(params, 2), batch)
    for key, value in unrolled.items():
        # Gradients accumulate exactly; stream figures are means over the two halves of the batch.
        rel = 1e-5 if "grad_norm" in key or key == "loss" else 0.05
        assert float(stacked[key]) == pytest.approx(float(value), rel=rel), key


# ---- the logit lens ----

@pytest.fixture(scope="module")
def char_tokenizer():
    return tokenizers.build_char([TEXT])


def lens_model(tokenizer, **overrides):
    m = small_model(vocab_size=tokenizer.vocab_size, max_len=32, **overrides)
    return m, init(m, scale=3.0)


def test_the_last_depth_is_the_model_output_and_ranks_agree(char_tokenizer):
    m, params = lens_model(char_tokenizer)
    ids = char_tokenizer.encode(TEXT)[:32]
    lens = logit_lens.logit_lens(params, m, ids)
    assert lens.top_ids.shape == (3, 32, logit_lens.TOP_K) and lens.target_loss.shape == (3, 31)
    logprobs = np.asarray(jax.nn.log_softmax(model.Transformer(m).apply({"params": params}, jnp.asarray([ids]))[0]))
    np.testing.assert_allclose(lens.target_loss[-1], -logprobs[np.arange(31), ids[1:]], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(lens.top_ids[-1, :, 0], logprobs.argmax(-1))
    ranks = (logprobs[:-1] > logprobs[np.arange(31), ids[1:]][:, None]).sum(-1)
    np.testing.assert_array_equal(lens.target_rank[-1], ranks)
    assert np.all((lens.target_rank == 0) == (lens.top_ids[:, :-1, 0] == np.asarray(ids[1:])[None]))
    # Earlier depths are really different reads of the stream.
    assert np.abs(lens.target_loss[0] - lens.target_loss[-1]).max() > 0.1
    stacked = logit_lens.logit_lens(scanned(params, 2), small_model(vocab_size=m.vocab_size, max_len=32,
                                                                    scan_layers=True), ids)
    np.testing.assert_allclose(stacked.target_loss, lens.target_loss, rtol=1e-5, atol=1e-5)


def test_blocks_that_write_nothing_predict_the_same_at_every_depth(char_tokenizer):
    m, params = lens_model(char_tokenizer)
    for i in range(m.n_layer):
        for layer, names in (("attn", ("out_kernel", "out_bias")), ("mlp", ("proj_kernel", "proj_bias"))):
            for name in names:
                params[f"block_{i}"][layer][name] = jnp.zeros_like(params[f"block_{i}"][layer][name])
    lens = logit_lens.logit_lens(params, m, char_tokenizer.encode(TEXT)[:20])
    np.testing.assert_allclose(lens.target_loss[1:], np.broadcast_to(lens.target_loss[0], (2, 19)), rtol=1e-6)
    np.testing.assert_array_equal(lens.block_delta_ratio, 0.0)
    np.testing.assert_array_equal(lens.mlp_delta_ratio, 0.0)


def test_trace_prints_a_row_per_depth_and_writes_the_heatmap(char_tokenizer, tmp_path):
    m, params = lens_model(char_tokenizer)
    out_png = tmp_path / "lens.png"
    table = logit_lens.trace(params, m, char_tokenizer, TEXT, str(out_png))  # 60 characters: the last 32 kept
    rows = [line for line in table.splitlines() if line.split()[0].isdigit()]
    assert [row.split()[1] for row in rows] == ["embed", "block_0", "block_1"]
    assert "over 32 tokens" in table
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000
    with pytest.raises(UserError, match="at least one token"):
        logit_lens.trace(params, m, char_tokenizer, "", None)
