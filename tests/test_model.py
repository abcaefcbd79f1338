"""The model against the spec and against an independent float64 NumPy forward."""

import collections
import contextlib
import dataclasses
import io
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import ad_checkpoint

from andrea_jax import model, ops, sharding
from andrea_jax.ops import einsum_attention, layer_norm, matmul, qkv_projections, tied_loss
from andrea_jax.gpt2 import interop
from andrea_jax.tools import parameter_table
from andrea_jax.config import base_config


def small_model(**overrides):
    m = base_config().model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim, m.vocab_size, m.max_len = 2, 64, 4, 256, 101, 16
    m.update(overrides)
    return m


def lower_as(monkeypatch, platform, **choices):
    """Programs traced from here on take `platform`'s ops (`ops.LOWERINGS`), with `choices` replaced."""
    monkeypatch.setattr(sharding, "program_platform", lambda: platform)
    monkeypatch.setitem(ops.LOWERINGS, platform, dataclasses.replace(ops.LOWERINGS[platform], **choices))


def init(m, seed=0, scale=1.0):
    """Params with weights scaled up, so that GELU/LayerNorm mistakes show in the logits."""
    params = nn.meta.unbox(model.init_params(m, jax.random.key(seed)))
    rng = np.random.default_rng(seed)
    # LayerNorm gains and biases away from 1 and 0, so a missing term is visible.
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p * scale + (0.1 * rng.standard_normal(p.shape).astype(np.float32)
                                     if "bias" in jax.tree_util.keystr(path) or "scale" in jax.tree_util.keystr(path)
                                     else 0.0), params)


def params_like_init(m, seed=0):
    """Params drawn as the model's init draws them (weights normal with std 0.02, the residual projections' 0.02 /
    sqrt(2 n_layer), norms' gains 1, biases 0), by NumPy: for tests where the init's own values are not the point
    (the init outside jit compiles a random draw for each new parameter shape, about a second each on XLA:CPU)."""
    shapes = nn.meta.unbox(jax.eval_shape(lambda key: model.init_params(m, key), jax.random.key(0)))
    rng = np.random.default_rng(seed)
    residual_std = model.INIT_STD / math.sqrt(2 * m.n_layer)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "bias" in name or "scale" in name:
            return np.full(leaf.shape, float("scale" in name))
        std = residual_std if "out_kernel" in name or "proj_kernel" in name else model.INIT_STD
        return std * rng.standard_normal(leaf.shape)

    return jax.tree_util.tree_map_with_path(lambda path, leaf: jnp.asarray(draw(path, leaf), jnp.float32), shapes)


def normals(seed, *shapes, dtype=np.float32):
    """Standard normal arrays drawn by NumPy (a jax.random draw outside jit compiles for each new shape)."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape).astype(dtype)) for shape in shapes]


def forward(m, params, ids, **kw):
    return model.Transformer(m).apply({"params": params}, jnp.asarray(ids), **kw)


# ---- an independent float64 reference, written from the spec's equations ----

def np_layer_norm(x, scale, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return scale * (x - mean) / np.sqrt(var + eps) + bias


def np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def np_forward(sd, ids, n_head, gelu=np_gelu_tanh):
    """GPT-2 equations in float64 on a HF-layout state dict."""
    f = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    length = ids.shape[1]
    x = f["transformer.wte.weight"][ids] + f["transformer.wpe.weight"][:length]
    n_layer = len({k.split(".")[2] for k in f if k.startswith("transformer.h.")})
    d = x.shape[-1]
    hd = d // n_head
    mask = np.tril(np.ones((length, length), bool))
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        h = np_layer_norm(x, f[p + "ln_1.weight"], f[p + "ln_1.bias"])
        qkv = h @ f[p + "attn.c_attn.weight"] + f[p + "attn.c_attn.bias"]
        q, k, v = np.split(qkv, 3, axis=-1)
        split = lambda t: t.reshape(t.shape[0], length, n_head, hd).transpose(0, 2, 1, 3)
        q, k, v = split(q), split(k), split(v)
        att = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
        att = np.where(mask, att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(x.shape)
        x = x + y @ f[p + "attn.c_proj.weight"] + f[p + "attn.c_proj.bias"]
        h = np_layer_norm(x, f[p + "ln_2.weight"], f[p + "ln_2.bias"])
        h = gelu(h @ f[p + "mlp.c_fc.weight"] + f[p + "mlp.c_fc.bias"])
        x = x + h @ f[p + "mlp.c_proj.weight"] + f[p + "mlp.c_proj.bias"]
    x = np_layer_norm(x, f["transformer.ln_f.weight"], f["transformer.ln_f.bias"])
    return x @ f["transformer.wte.weight"].T


# ---- the spec's numbers ----

def test_andrea120m_parameter_count_is_exact():
    m = base_config().model
    assert parameter_table.count(parameter_table.param_shapes(m)) == 92_331_264
    m.scan_layers = True
    assert parameter_table.count(parameter_table.param_shapes(m)) == 92_331_264


def test_andrea120m_shapes_and_summary_rows():
    m = base_config().model
    shapes = parameter_table.param_shapes(m)
    assert shapes["token_embed"].shape == (8449, 768)
    assert shapes["position_embed"].shape == (1024, 768)
    block = shapes["block_0"]
    assert block["attn"]["qkv_kernel"].shape == (768, 3, 12, 64)
    assert block["mlp"]["fc_kernel"].shape == (768, 3072)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(shapes))
    table = {name: n for name, _, n in parameter_table.rows(m)}
    assert table["block_5"] == 7_087_872
    assert table["ln_f"] == 1536
    assert table["total"] == 92_331_264
    logits = jax.eval_shape(lambda p, ids: forward(m, p, ids), shapes, jax.ShapeDtypeStruct((2, 1024), jnp.int32))
    assert logits.shape == (2, 1024, 8449) and logits.dtype == jnp.float32


def test_twenty_five_layer_norms_and_no_output_matrix():
    shapes = parameter_table.param_shapes(base_config().model)
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    paths = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in flat]
    norms = {p.rsplit("/", 1)[0] for p in paths if p.endswith("/scale")}
    assert len(norms) == 25
    # Tied output: the only (vocab, d_model) matrix is the token embedding.
    vocab_matrices = [p for p, (_, leaf) in zip(paths, flat) if leaf.shape == (8449, 768)]
    assert vocab_matrices == ["token_embed"]


def test_init_follows_gpt2():
    m = base_config().model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim = 12, 256, 4, 1024
    p = nn.meta.unbox(model.init_params(m, jax.random.key(0)))
    block = p["block_3"]
    assert np.std(block["mlp"]["fc_kernel"]) == pytest.approx(0.02, rel=0.05)
    assert np.std(block["mlp"]["proj_kernel"]) == pytest.approx(0.02 / math.sqrt(24), rel=0.05)
    assert np.std(block["attn"]["out_kernel"]) == pytest.approx(0.02 / math.sqrt(24), rel=0.05)
    assert np.std(p["token_embed"]) == pytest.approx(0.02, rel=0.05)
    assert np.all(block["attn"]["qkv_bias"] == 0) and np.all(block["ln_1"]["scale"] == 1)


# ---- the forward equation ----

@pytest.mark.parametrize("query_block", [128, 5], ids=["one block", "blocks of 5"])
def test_forward_matches_float64_numpy_reference(query_block, monkeypatch):
    # Blocks of 5 split the 16 queries 5, 5, 5, 1: each block sees only the keys up to its end.
    lower_as(monkeypatch, "cpu", query_block=query_block)
    m = small_model()
    params = init(m, scale=8.0)
    ids = np.random.default_rng(1).integers(0, m.vocab_size, (2, 16))
    ours = np.asarray(forward(m, params, ids), np.float64)
    reference = np_forward(interop.to_gpt2(params, m), ids, m.n_head)
    assert np.abs(reference).max() > 1.0  # the check is not trivially satisfied
    np.testing.assert_allclose(ours, reference, atol=1e-5 * np.abs(reference).max(), rtol=0)


def test_gelu_is_the_tanh_form():
    """The reference tolerance can tell tanh-GELU from exact (erf) GELU."""
    m = small_model()
    params = init(m, scale=8.0)
    ids = np.random.default_rng(2).integers(0, m.vocab_size, (1, 16))
    ours = np.asarray(forward(m, params, ids), np.float64)
    exact_gelu = np.vectorize(lambda x: 0.5 * x * (1 + math.erf(x / math.sqrt(2))))
    with_erf = np_forward(interop.to_gpt2(params, m), ids, m.n_head, gelu=exact_gelu)
    assert np.abs(ours - with_erf).max() > 10 * 1e-5 * np.abs(with_erf).max()


@pytest.mark.parametrize("query_block", [128, 5], ids=["one block", "blocks of 5"])
def test_causality(query_block, monkeypatch):
    lower_as(monkeypatch, "cpu", query_block=query_block)
    m = small_model()
    params = init(m)
    ids = np.random.default_rng(3).integers(0, m.vocab_size, (1, 16))
    base = np.asarray(forward(m, params, ids))
    for t in (0, 7, 14):
        changed = ids.copy()
        changed[0, t + 1] = (changed[0, t + 1] + 1) % m.vocab_size
        out = np.asarray(forward(m, params, changed))
        np.testing.assert_array_equal(out[:, : t + 1], base[:, : t + 1])
        assert np.abs(out[:, t + 1] - base[:, t + 1]).max() > 0


def test_pre_norm_order_zero_sublayers_are_identity():
    """With every sub-layer's output projection zeroed, the blocks are the identity
    (true of pre-norm x + f(LN(x)); post-norm would still normalise the stream)."""
    m = small_model()
    params = init(m)
    for i in range(m.n_layer):
        for layer, names in (("attn", ("out_kernel", "out_bias")), ("mlp", ("proj_kernel", "proj_bias"))):
            for name in names:
                params[f"block_{i}"][layer][name] = jnp.zeros_like(params[f"block_{i}"][layer][name])
    ids = np.arange(16)[None] % m.vocab_size
    sd = interop.to_gpt2(params, m)
    x = sd["transformer.wte.weight"][ids] + sd["transformer.wpe.weight"][:16]
    expected = np_layer_norm(x.astype(np.float64), sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"]) \
        @ sd["transformer.wte.weight"].T.astype(np.float64)
    np.testing.assert_allclose(np.asarray(forward(m, params, ids)), expected, atol=1e-4)


# ---- options ----

def test_padded_vocabulary_is_never_predicted_and_leaves_real_logits_unchanged():
    m = small_model()
    padded = small_model(vocab_pad_multiple=64)
    params = init(m)
    padded_params = interop.from_gpt2(interop.to_gpt2(params, m), padded)
    assert padded_params["token_embed"].shape == (128, 64)
    ids = np.random.default_rng(4).integers(0, m.vocab_size, (2, 16))
    exact = np.asarray(forward(m, params, ids))
    out = np.asarray(forward(padded, padded_params, ids))
    np.testing.assert_allclose(out[..., : m.vocab_size], exact, atol=1e-5)
    assert np.all(out[..., m.vocab_size:] <= -1e30)
    assert np.all(jax.nn.softmax(out)[..., m.vocab_size:] == 0)


@pytest.mark.parametrize("options", [dict(remat=True),
                                     dict(scan_layers=True), dict(scan_layers=True, remat=True)])
def test_implementation_options_give_the_same_logits(options):
    m = small_model()
    params = init(m, scale=4.0)
    other = small_model(**options)
    other_params = interop.from_gpt2(interop.to_gpt2(params, m), other)
    ids = np.random.default_rng(5).integers(0, m.vocab_size, (2, 16))
    np.testing.assert_allclose(np.asarray(forward(other, other_params, ids)),
                               np.asarray(forward(m, params, ids)), atol=2e-5, rtol=1e-5)
    grads = jax.grad(lambda p: forward(other, p, ids).mean())(other_params)
    assert np.isfinite(parameter_table.count(grads)) and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def mean_loss_of_a_small_model(seed):
    """(the model config, params with weights scaled up, the mean loss of a fixed [2, 16] batch as a
    function of params)."""
    m = small_model()
    ids = np.random.default_rng(seed).integers(0, m.vocab_size, (2, 16))
    return m, init(m, scale=4.0), lambda p: forward(m, p, ids).mean()


def test_query_blocks_give_the_unblocked_loss_and_gradients(monkeypatch):
    m, params, loss = mean_loss_of_a_small_model(7)
    expected, expected_grads = jax.value_and_grad(loss)(params)
    lower_as(monkeypatch, "cpu", query_block=6)  # blocks of 6, 6, 4
    blocked, grads = jax.value_and_grad(loss)(params)
    np.testing.assert_allclose(float(blocked), float(expected), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(b).max(), rtol=0),
                 grads, expected_grads)


@pytest.mark.parametrize("platform", ["cpu", "gpu"], ids=["kept probabilities", "recomputed (GPU programs)"])
def test_attention_backward_is_autodiffs_in_float32_and_close_in_bfloat16(platform):
    # Each platform's written-out backward against autodiff of the same forward (the dropout path with
    # an identity dropout), with a causal mask cut as a query block sees it (queries 5..11).
    attend = ops.LOWERINGS[platform].attention
    q, k, v, g = normals(8, (2, 7, 3, 16), (2, 12, 3, 16), (2, 12, 3, 16), (2, 7, 3, 16))
    causal = jnp.tril(jnp.ones((12, 12), bool))[5:12]
    autodiff = lambda dtype: jax.vjp(lambda *qkv: einsum_attention.dropout_attention(
        *(x.astype(dtype) for x in qkv), causal, dtype, lambda p: p), q, k, v)
    ours = lambda dtype: jax.vjp(lambda *qkv: attend(*(x.astype(dtype) for x in qkv), causal, dtype), q, k, v)
    (out, vjp), (ref_out, ref_vjp) = ours(jnp.float32), autodiff(jnp.float32)
    assert (attend is einsum_attention.recomputing_attention) == (platform == "gpu")
    if platform == "cpu":
        np.testing.assert_array_equal(out, ref_out)  # the same softmax
    else:  # exp(logits - log-sum-exp) rather than softmax's division
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    reference = ref_vjp(g)
    for got, want in zip(vjp(g), reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # bf16: products of bf16-rounded cotangents, within bf16 error of the float32 gradients.
    out16, vjp16 = ours(jnp.bfloat16)
    assert out16.dtype == jnp.bfloat16
    for got, want in zip(vjp16(g.astype(jnp.bfloat16)), reference):
        assert got.dtype == jnp.float32
        assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()
    # float16 (a T4's) under a loss scale of 2¹²: finite, and within float16's error once unscaled.
    half, vjp_half = ours(jnp.float16)
    assert half.dtype == jnp.float16
    for got, want in zip(vjp_half((4096 * g).astype(jnp.float16)), reference):
        assert np.all(np.isfinite(got)) and np.abs(got / 4096 - want).max() <= 0.005 * np.abs(want).max()
    if platform == "gpu":  # what the backward keeps: no [B, H, L, S] array, only [B, H, L] statistics
        kept = einsum_attention._recomputing_fwd(q, k, v, causal, jnp.float32)[1]
        assert {x.shape for x in kept} == {(2, 7, 3, 16), (2, 12, 3, 16), (7, 12), (2, 3, 7, 1)}

        def score_products(dtype):  # the types of the [B, H, L, S] products: q·kᵀ twice, d_out·vᵀ once
            program = jax.jit(lambda g: ours(dtype)[1](g)).lower(g.astype(dtype)).as_text()
            return re.findall(r"dot_general.*-> tensor<2x3x7x12x(\w+)>", program)
        assert score_products(jnp.float16) == ["f16"] * 3 and score_products(jnp.bfloat16) == ["f32"] * 3


def test_layer_norm_backward_is_autodiffs_in_float32_and_close_in_bfloat16():
    x, scale, bias, g = normals(9, (2, 5, 48), (48,), (48,), (2, 5, 48))
    x = 3.0 * x + 1.5  # rows away from mean 0 and variance 1
    scale, bias = 1 + 0.3 * scale, 0.2 * bias
    autodiff = lambda dtype: jax.vjp(lambda *a: layer_norm.layer_norm(*a, 1e-5, dtype), x, scale, bias)
    ours = lambda dtype: jax.vjp(lambda *a: layer_norm.fused_layer_norm(*a, 1e-5, dtype), x, scale, bias)
    (out, vjp), (ref_out, ref_vjp) = ours(jnp.float32), autodiff(jnp.float32)
    np.testing.assert_array_equal(out, ref_out)  # one forward
    reference = ref_vjp(g)
    for got, want in zip(vjp(g), reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    out16, vjp16 = ours(jnp.bfloat16)
    assert out16.dtype == jnp.bfloat16
    for got, want in zip(vjp16(g.astype(jnp.bfloat16)), autodiff(jnp.bfloat16)[1](g.astype(jnp.bfloat16))):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # A bf16 input stream gets a bf16 gradient, as autodiff gives it.
    dx16 = jax.vjp(lambda x: layer_norm.fused_layer_norm(x, scale, bias, 1e-5, jnp.bfloat16),
                   x.astype(jnp.bfloat16))[1]
    assert dx16(g.astype(jnp.bfloat16))[0].dtype == jnp.bfloat16


def test_gpu_programs_take_the_written_out_layer_norm_backward_and_others_autodiffs(monkeypatch):
    m, params, loss = mean_loss_of_a_small_model(3)
    called = []
    fused = lambda *a: called.append(1) or layer_norm.fused_layer_norm(*a)
    for platform in ops.LOWERINGS:  # every platform taking the written-out backward
        if ops.LOWERINGS[platform].layer_norm is layer_norm.fused_layer_norm:
            monkeypatch.setitem(ops.LOWERINGS, platform, dataclasses.replace(ops.LOWERINGS[platform], layer_norm=fused))
    expected, expected_grads = jax.value_and_grad(loss)(params)
    assert called == []  # a CPU program is autodiff's
    lower_as(monkeypatch, "gpu", query_block=16)  # the GPU program's blocks, at this length one
    got, grads = jax.value_and_grad(loss)(params)
    assert len(called) == 2 * m.n_layer + 1  # every norm, ln_f too
    np.testing.assert_allclose(float(got), float(expected), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max()),
                 grads, expected_grads)


def test_chunked_cross_entropy_is_optax_over_the_whole_logits_in_float32_and_close_in_bfloat16():
    m = small_model(vocab_pad_multiple=8)  # 101 tokens in 104 rows: the padding is masked
    x, embed = normals(10, (2, 7, 64), (104, 64))
    embed = 0.5 * embed
    rng = np.random.default_rng(11)
    targets = jnp.asarray(rng.integers(0, m.vocab_size, (2, 7)), jnp.int32)
    g = jnp.asarray(rng.uniform(size=(2, 7)), jnp.float32)
    autodiff = lambda dtype: jax.vjp(lambda x, e: optax.softmax_cross_entropy_with_integer_labels(
        model.tied_logits(x.astype(dtype), e, small_model(vocab_pad_multiple=8, dtype=jnp.dtype(dtype).name)),
        targets), x, embed)
    # Chunks of 3, 3 and 1 positions.
    ours = lambda dtype: jax.vjp(lambda x, e: tied_loss.chunked_tied_cross_entropy(
        x.astype(dtype), e, targets, m.vocab_size, dtype, 3), x, embed)
    (losses, vjp), (expected, reference_vjp) = ours(jnp.float32), autodiff(jnp.float32)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    reference = reference_vjp(g)
    for got, want in zip(vjp(g), reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    losses16, vjp16 = ours(jnp.bfloat16)
    assert losses16.dtype == jnp.float32
    np.testing.assert_allclose(losses16, expected, rtol=0.02)
    for got, want in zip(vjp16(g), reference):
        assert np.abs(np.asarray(got, np.float32) - want).max() <= 0.02 * np.abs(want).max()


def sharded_loss_and_grads(m, params, loss, mesh_sizes):
    """jit(value_and_grad(loss)) with params laid out by the rules on a (data, fsdp, tensor) mesh."""
    config = base_config()
    config.model, config.batch_size = m, 4
    config.mesh.update(dict(zip(("data", "fsdp", "tensor"), mesh_sizes)))
    mesh = sharding.make_mesh(config, jax.devices()[:math.prod(mesh_sizes)])
    rules = sharding.rules(config)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(lambda: model.init_params(m, jax.random.key(0)))
        params = jax.device_put(params, sharding.logical_shardings(boxed, mesh, rules))
        return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("mesh_sizes", [(1, 1, 1), (2, 2, 2)], ids=["one device", "data2-fsdp2-tensor2"])
def test_gpu_and_tpu_programs_take_their_written_out_backwards_at_autodiffs_results(mesh_sizes, monkeypatch):
    """GPU programs: the chunked head loss, the stacked q, k, v backward, the recomputing attention and the
    position embedding gathered; TPU programs: the chunked head loss and the stacked q, k, v backward (their
    attention is the splash kernel's, tests/test_attention.py)."""
    m = small_model(vocab_pad_multiple=8)
    params = init(m, scale=4.0)
    ids = np.random.default_rng(11).integers(0, m.vocab_size, (4, 17))
    loss = lambda p: forward(m, p, ids[:, :-1], targets_BxL=jnp.asarray(ids[:, 1:])).mean()
    calls = collections.defaultdict(list)  # an op's name -> its calls' arguments
    logged = lambda f: lambda *a: calls[getattr(f, "func", f).__name__].append(a) or f(*a)
    monkeypatch.setattr(tied_loss, "chunked_tied_cross_entropy", logged(tied_loss.chunked_tied_cross_entropy))
    for platform, row in list(ops.LOWERINGS.items()):
        monkeypatch.setitem(ops.LOWERINGS, platform, dataclasses.replace(
            row, attention=logged(row.attention), qkv_projections=logged(row.qkv_projections)))
    expected, expected_grads = jax.value_and_grad(loss)(params)
    # A CPU program autodiffs optax's loss and three matmuls, and keeps attention's probabilities.
    assert set(calls) == {"softmax_attention", "three_products"}
    for platform in ("gpu", "tpu"):
        calls.clear()
        # Two query blocks a row on a GPU; 4 rows × chunks of 6, 6 and 4 positions.
        lower_as(monkeypatch, platform, query_block=8 if platform == "gpu" else None, loss_chunk_tokens=24)
        got, grads = sharded_loss_and_grads(m, params, loss, mesh_sizes)
        chunks = [a[-1] for a in calls["chunked_tied_cross_entropy"]]
        assert chunks == [6] and len(calls["stacked"]) == 2 * m.n_layer  # the params' init, then the loss
        attention = "recomputing_attention" if platform == "gpu" else "softmax_attention"
        queries = [a[0].shape[1] for a in calls[attention]]
        assert queries == [1] * m.n_layer + ([8, 8] if platform == "gpu" else [16]) * m.n_layer
        assert set(calls) == {"chunked_tied_cross_entropy", "stacked", attention}
        np.testing.assert_allclose(float(got), float(expected), rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max()),
                     grads, expected_grads)


def test_accelerator_programs_qkv_projections_are_three_matmuls_with_one_product_a_gradient():
    x, kernel, bias, *d_qkv = normals(12, (2, 5, 48), (48, 3, 4, 12), (3, 4, 12), *[(2, 5, 4, 12)] * 3)
    three = lambda dtype: jax.vjp(lambda x, w, b: tuple(
        (matmul.matmul(x, w[:, i], "bld,dhk->blhk", dtype, dtype) + b[i]).astype(dtype) for i in range(3)),
        x, kernel, bias)
    ours = lambda dtype: jax.vjp(lambda x, w, b: qkv_projections.stacked(x, w, b, dtype), x, kernel, bias)
    (out, vjp), (ref_out, ref_vjp) = ours(jnp.float32), three(jnp.float32)
    for got, want in zip(out, ref_out):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    reference = ref_vjp(tuple(d_qkv))
    for got, want in zip(vjp(tuple(d_qkv)), reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    out16, vjp16 = ours(jnp.bfloat16)
    assert all(q.dtype == jnp.bfloat16 for q in out16)
    for got, want in zip(out16, ref_out):
        assert np.abs(np.asarray(got, np.float32) - want).max() <= 0.02 * np.abs(want).max()
    for got, want in zip(vjp16(tuple(d.astype(jnp.bfloat16) for d in d_qkv)), reference):
        assert got.dtype == jnp.float32 and np.abs(got - want).max() <= 0.02 * np.abs(want).max()
    # The backward's two products take the three cotangents stacked: one reads x, the other the kernel.
    program = jax.jit(lambda *d: ours(jnp.bfloat16)[1](d)).lower(*(d.astype(jnp.bfloat16) for d in d_qkv)).as_text()
    assert len(re.findall(r"dot_general.*tensor<2x5x3x4x12xbf16>", program)) == 2
    # GPUs' heads that are not a power of two wide (12 here): the product into x's gradient takes the stack
    # merged into [B, L, 3·D] (`merge_odd_heads`), with the same gradients.
    merged = lambda dtype: jax.vjp(lambda x, w, b: qkv_projections.stacked(x, w, b, dtype, merge_odd_heads=True),
                                   x, kernel, bias)[1]
    for got, want in zip(merged(jnp.float32)(tuple(d_qkv)), reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    program = jax.jit(lambda *d: merged(jnp.bfloat16)(d)).lower(*(d.astype(jnp.bfloat16) for d in d_qkv)).as_text()
    assert re.search(r"dot_general.*\(tensor<2x5x144xbf16>, tensor<48x144xbf16>\)", program)


def test_bfloat16_compute_keeps_float32_params_and_logits():
    m = small_model(dtype="bfloat16")
    params = init(m)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    ids = np.random.default_rng(6).integers(0, m.vocab_size, (2, 16))
    out = forward(m, params, ids)
    assert out.dtype == jnp.float32
    exact = forward(small_model(), params, ids)
    err = float(jnp.abs(out - exact).max())
    assert 0 < err < 0.05 * float(jnp.abs(exact).max())


def test_dropout_only_when_training():
    m = small_model(dropout=0.5)
    params = init(m)
    ids = np.arange(16)[None] % m.vocab_size
    eval_out = np.asarray(forward(m, params, ids))
    np.testing.assert_array_equal(eval_out, np.asarray(forward(small_model(), params, ids)))
    train_a = forward(m, params, ids, deterministic=False, rngs={"dropout": jax.random.key(1)})
    train_b = forward(m, params, ids, deterministic=False, rngs={"dropout": jax.random.key(1)})
    train_c = forward(m, params, ids, deterministic=False, rngs={"dropout": jax.random.key(2)})
    np.testing.assert_array_equal(np.asarray(train_a), np.asarray(train_b))
    assert np.abs(np.asarray(train_a) - eval_out).max() > 1e-3
    assert np.abs(np.asarray(train_a) - np.asarray(train_c)).max() > 1e-3


def test_the_mlp_keeps_its_pre_activation_for_the_backward_in_the_compute_dtype_only():
    """The widest activation of a block, [B, L, F], is saved in bfloat16 and never in float32;
    and the gradient through the recomputed activation is autodiff's of the same float32 function."""
    mlp = model.MLP(mlp_dim=256, dtype=jnp.bfloat16, dropout=0.0, residual_std=0.02)
    x, = normals(0, (2, 8, 64), dtype=jnp.bfloat16)
    variables = mlp.init(jax.random.key(1), x, True)
    loss = lambda x: mlp.apply(variables, x, True).astype(jnp.float32).sum()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ad_checkpoint.print_saved_residuals(loss, x)
    saved = [line.split()[0] for line in printed.getvalue().splitlines()]
    assert "bf16[2,8,256]" in saved and "f32[2,8,256]" not in saved

    up, = normals(2, (4, 256), dtype=jnp.bfloat16)
    gelu = model.ACTIVATIONS["gelu_tanh"]
    grad = jax.grad(lambda u: model.activate(gelu, u).astype(jnp.float32).sum())(up)
    expected = jax.grad(lambda u: gelu(u.astype(jnp.float32)).sum())(up)
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(expected, np.float32), atol=1e-2)
