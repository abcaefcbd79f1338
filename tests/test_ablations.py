"""The ablation switches: what each changes (shapes, counts, the forward equation), and that the default is untouched."""

import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from andrea_jax import model
from andrea_jax.gpt2 import interop
from andrea_jax.tools import parameter_table, sampling
from andrea_jax import run_dir
from andrea_jax.config import ConfigError, base_config, validate
from tests.test_model import forward, init, np_forward, np_gelu_tanh, np_layer_norm, small_model

ANDREA_PARAMS = 92_331_264
TOLERANCE = 2.5e-5  # float32 against float64, relative to the largest logit (errors seen: up to 1.3e-5)
# Pre-norm without residuals, at the forward test's input: block 0 head 0 splits token (0, 10)'s attention
# 0.54/0.46 between scores 156.14 and 155.97, and with no stream to dilute it that split goes straight to the
# logits, so float32 rounding of the scores shows. Float32 errors measured there (params moved by <= 1 ulp,
# 100 draws each): jax 0.10 and 0.12 up to 1.7e-4 and 2.1e-4, numpy float32 of the reference up to 2.3e-4;
# 73-83% of the draws exceed TOLERANCE. Still 3,000x below what dropping the residual changes (1.24).
NO_RESIDUAL_TOLERANCE = 4e-4


# ---- a float64 reference for every variant, on this model's own parameter layout ----

def np_gelu_exact(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


NP_ACTIVATIONS = {"gelu_tanh": np_gelu_tanh, "gelu_exact": np_gelu_exact, "relu": lambda x: np.maximum(x, 0.0)}


def np_rms_norm(x):
    """RMS over tokens of each token's L2 norm (the diagnostics' |x|)."""
    return float(np.sqrt(np.mean(np.sum(x ** 2, axis=-1))))


def np_forward_variant(params, m, ids):
    """(logits, streams [n_layer + 1], attn delta ratios, mlp delta ratios) in float64, from the equations:
    pre:  x = x + f(LN(x))     post: x = LN(x + f(x))     no residual: the `x +` goes."""
    f = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    length = ids.shape[1]
    x = f["token_embed"][ids] + f["position_embed"][:length]
    mask = np.tril(np.ones((length, length), bool))
    streams, ratios = [x], {"attn": [], "mlp": []}
    for i in range(m.n_layer):
        b = f[f"block_{i}"]
        a = b["attn"]

        def attention(h):
            qkv = np.einsum("bld,dthk->blthk", h, a["qkv_kernel"]) + a["qkv_bias"]
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            att = np.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(q.shape[-1])
            att = np.where(mask, att, -np.inf)
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            return np.einsum("bqhk,hkd->bqd", np.einsum("bhqs,bshk->bqhk", att, v), a["out_kernel"]) + a["out_bias"]

        def mlp(h):
            up = h @ b["mlp"]["fc_kernel"] + b["mlp"]["fc_bias"]
            if m.activation == "swiglu":
                gate = h @ b["mlp"]["gate_kernel"] + b["mlp"]["gate_bias"]
                hidden = gate / (1 + np.exp(-gate)) * up
            else:
                hidden = NP_ACTIVATIONS[m.activation](up)
            return hidden @ b["mlp"]["proj_kernel"] + b["mlp"]["proj_bias"]

        for name, sublayer, ln in (("attn", attention, b["ln_1"]), ("mlp", mlp, b["ln_2"])):
            norm = lambda t: np_layer_norm(t, ln["scale"], ln["bias"])
            delta = sublayer(norm(x) if m.norm_position == "pre" else x)
            ratios[name].append(np_rms_norm(delta) / np_rms_norm(x))
            out = x + delta if m.residual else delta
            x = out if m.norm_position == "pre" else norm(out)
        streams.append(x)
    logits = np_layer_norm(x, f["ln_f"]["scale"], f["ln_f"]["bias"]) @ f["token_embed"].T
    return logits, streams, ratios["attn"], ratios["mlp"]


def raw_init(m, seed=0):
    """The model's own initial params (eager: op-by-op compiles are cached across tests; a jit is not)."""
    return nn.meta.unbox(model.init_params(m, jax.random.key(seed)))


def variant_init(seed=0, scale=8.0, **overrides):
    m = small_model(**overrides)
    return m, init(m, seed=seed, scale=scale)


# ---- the default is the ANDREA model ----

def test_reference_with_default_switches_is_the_spec_reference():
    """The variant reference, all switches at their defaults, is test_model's GPT-2 reference."""
    m, params = variant_init()
    ids = np.random.default_rng(0).integers(0, m.vocab_size, (2, 16))
    ours = np_forward_variant(params, m, ids)[0]
    spec = np_forward(interop.to_gpt2(params, m), ids, m.n_head)
    np.testing.assert_allclose(ours, spec, rtol=1e-10, atol=1e-10)


def test_defaults_are_the_andrea_model():
    m = base_config().model
    assert (m.norm_position, m.residual, m.activation, m.mlp_ratio) == ("pre", True, "gelu_tanh", 0.0)
    assert model.mlp_hidden_dim(m) == 3072 and model.non_gpt2_features(m) == []
    assert base_config().diagnostics is False


@pytest.mark.parametrize("overrides, same_tree", [
    (dict(norm_position="post"), True), (dict(residual=False), True), (dict(activation="relu"), True),
    (dict(activation="gelu_exact"), True), (dict(activation="swiglu"), False), (dict(mlp_ratio=2.0), False)])
def test_each_switch_keeps_the_parameters_it_does_not_change(overrides, same_tree):
    """Same tree (or only the MLP's widths and gate added), same initial values: only the switch differs.
    (That each switch changes the function is shown by the reference tests below.)"""
    base, m = small_model(), small_model(**overrides)
    raw = lambda m: dict(jax.tree_util.tree_leaves_with_path(raw_init(m)))
    base_leaves, leaves = raw(base), raw(m)
    shapes = lambda tree: {path: leaf.shape for path, leaf in tree.items()}
    assert (shapes(leaves) == shapes(base_leaves)) == same_tree
    shared = [path for path in leaves if path in base_leaves and base_leaves[path].shape == leaves[path].shape]
    # At most the MLP's fc kernel and bias and its proj kernel change shape, in each block.
    assert len(shared) >= len(base_leaves) - 3 * m.n_layer
    for path in shared:
        np.testing.assert_array_equal(leaves[path], base_leaves[path])


# ---- shapes and parameter counts ----

def test_parameter_counts_of_the_full_size_variants():
    def total(**overrides):
        m = base_config().model
        m.update(overrides)
        return parameter_table.count(parameter_table.param_shapes(m))

    assert total() == ANDREA_PARAMS
    for same in (dict(norm_position="post"), dict(residual=False), dict(activation="relu"),
                 dict(activation="gelu_exact"), dict(mlp_ratio=4.0)):
        assert total(**same) == ANDREA_PARAMS, same
    # SwiGLU at 2048 = 2/3 × 3072: gate + up + down, 3·768·2048 + 2·2048 + 768 = 4,723,456 per block
    # against 4,722,432 for the 4× GELU MLP: +1,024 a block.
    assert total(activation="swiglu") == ANDREA_PARAMS + 12 * 1024
    one_mlp = 768 * 3072 * 2 + 3072 + 768
    assert total(mlp_ratio=2.0) == ANDREA_PARAMS - 12 * (one_mlp - (768 * 1536 * 2 + 1536 + 768))
    assert total(mlp_ratio=8.0) == ANDREA_PARAMS + 12 * ((768 * 6144 * 2 + 6144 + 768) - one_mlp)


def test_swiglu_has_gate_up_and_down_projections_of_two_thirds_width():
    m = base_config().model
    m.activation = "swiglu"
    mlp = parameter_table.param_shapes(m)["block_0"]["mlp"]
    assert {k: v.shape for k, v in mlp.items()} == {
        "fc_kernel": (768, 2048), "fc_bias": (2048,), "gate_kernel": (768, 2048), "gate_bias": (2048,),
        "proj_kernel": (2048, 768), "proj_bias": (768,)}
    m.scan_layers = True
    assert parameter_table.param_shapes(m)["blocks"]["block"]["mlp"]["gate_kernel"].shape == (12, 768, 2048)


@pytest.mark.parametrize("d_model, mlp_dim, ratio, activation, width", [
    (768, 3072, 0.0, "gelu_tanh", 3072), (768, 3072, 2.0, "relu", 1536), (768, 3072, 8.0, "gelu_tanh", 6144),
    (768, 3072, 0.0, "swiglu", 2048), (128, 512, 0.0, "swiglu", 320),  # 341.3 -> nearest multiple of 64
    (128, 999, 4.0, "gelu_tanh", 512),  # a ratio overrides mlp_dim
    (64, 64, 0.0, "swiglu", 64)])  # never below one multiple
def test_mlp_hidden_dim(d_model, mlp_dim, ratio, activation, width):
    m = base_config().model
    m.update(dict(d_model=d_model, mlp_dim=mlp_dim, mlp_ratio=ratio, activation=activation))
    assert model.mlp_hidden_dim(m) == width


# ---- the forward equations against the float64 reference ----

@pytest.mark.parametrize("overrides", [
    dict(norm_position="post"), dict(residual=False), dict(norm_position="post", residual=False),
    dict(activation="gelu_exact"), dict(activation="relu"), dict(activation="swiglu"),
    dict(mlp_ratio=2.0), dict(norm_position="post", activation="swiglu", mlp_ratio=8.0)])
def test_variant_forward_matches_float64_reference(overrides):
    m, params = variant_init(**overrides)
    ids = np.random.default_rng(2).integers(0, m.vocab_size, (2, 16))
    ours = np.asarray(forward(m, params, ids), np.float64)
    reference = np_forward_variant(params, m, ids)[0]
    assert np.abs(reference).max() > 1.0
    tolerance = NO_RESIDUAL_TOLERANCE if (m.norm_position, m.residual) == ("pre", False) else TOLERANCE
    np.testing.assert_allclose(ours, reference, atol=tolerance * np.abs(reference).max(), rtol=0)


@pytest.mark.parametrize("wrong, right", [
    (dict(norm_position="pre"), dict(norm_position="post")), (dict(residual=True), dict(residual=False)),
    (dict(activation="gelu_tanh"), dict(activation="gelu_exact")), (dict(activation="relu"), dict(activation="gelu_tanh"))])
def test_the_reference_tolerance_tells_the_variants_apart(wrong, right):
    """The check above would fail if a switch were ignored or mixed up with another."""
    m, params = variant_init(**right)
    ids = np.random.default_rng(2).integers(0, m.vocab_size, (2, 16))
    ours = np.asarray(forward(m, params, ids), np.float64)
    mistaken = np_forward_variant(params, ml_collections.ConfigDict({**m.to_dict(), **wrong}), ids)[0]
    assert np.abs(ours - mistaken).max() > 3 * TOLERANCE * np.abs(mistaken).max()


def test_post_norm_with_zeroed_sublayers_still_normalises_the_stream():
    """The mirror of test_model's pre-norm identity test: post-norm blocks are LN, not the identity."""
    m, params = variant_init(scale=1.0, norm_position="post")
    for i in range(m.n_layer):
        for layer, names in (("attn", ("out_kernel", "out_bias")), ("mlp", ("proj_kernel", "proj_bias"))):
            for name in names:
                params[f"block_{i}"][layer][name] = jnp.zeros_like(params[f"block_{i}"][layer][name])
    ids = np.arange(16)[None] % m.vocab_size
    _, streams, _, _ = np_forward_variant(params, m, ids)
    b = jax.tree.map(lambda a: np.asarray(a, np.float64), params["block_0"])
    once = np_layer_norm(streams[0], b["ln_1"]["scale"], b["ln_1"]["bias"])
    np.testing.assert_allclose(streams[1], np_layer_norm(once, b["ln_2"]["scale"], b["ln_2"]["bias"]), atol=1e-12)
    assert np.abs(streams[1] - streams[0]).max() > 0.1
    np.testing.assert_allclose(np.asarray(forward(m, params, ids)), np_forward_variant(params, m, ids)[0], atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(scan_layers=True), dict(scan_layers=True, remat=True), dict(remat=True)])
def test_variants_are_the_same_under_scan_and_remat(options):
    m, params = variant_init(norm_position="post", activation="swiglu", residual=False)
    other = small_model(norm_position="post", activation="swiglu", residual=False, **options)
    other_params = params
    if other.scan_layers:
        other_params = {k: v for k, v in params.items() if not k.startswith("block_")}
        other_params["blocks"] = {"block": interop.stack_blocks([params[f"block_{i}"] for i in range(m.n_layer)])}
    ids = np.random.default_rng(3).integers(0, m.vocab_size, (2, 16))
    expected = np.asarray(forward(m, params, ids))
    np.testing.assert_allclose(np.asarray(forward(other, other_params, ids)), expected,
                               atol=TOLERANCE * np.abs(expected).max(), rtol=0)


def test_kv_cache_decoding_works_for_a_variant():
    m, params = variant_init(scale=3.0, norm_position="post", activation="swiglu")
    ids = np.random.default_rng(4).integers(0, m.vocab_size, (1, 8))
    full = np.asarray(forward(m, params, ids))
    frozen = ml_collections.FrozenConfigDict(m)
    logits, cache = sampling.prefill(params, sampling.init_cache(m, 1), jnp.asarray(ids[:, :5]), frozen)
    for t in range(5, 8):
        logits, cache = sampling.prefill(params, cache, jnp.asarray(ids[:, t:t + 1]), frozen)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, t], atol=2e-5 * np.abs(full).max())


# ---- the config ----

@pytest.mark.parametrize("change, message", [
    (dict(norm_position="sandwich"), "model.norm_position='sandwich' is not one of 'pre', 'post'"),
    (dict(activation="gelu"), "model.activation='gelu' is not one of 'gelu_tanh'"),
    (dict(mlp_ratio=-1.0), "model.mlp_ratio=-1.0 must be >= 0 (0 = use model.mlp_dim)"),
    (dict(mlp_ratio=2.7), "2.7 × model.d_model=768 = 2073.6 is not a whole number"),
])
def test_impossible_ablations_name_the_fix(change, message):
    config = base_config()
    config.model.update(change)
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert message in str(error.value)


def test_residual_must_be_a_boolean():
    config = base_config()
    with pytest.raises((ConfigError, TypeError)):
        config.model.residual = "no"
        validate(config)


def test_non_gpt2_features_name_each_switch():
    m = small_model(norm_position="post", residual=False, activation="swiglu")
    found = model.non_gpt2_features(m)
    assert len(found) == 3 and "model.norm_position='post'" in found[0] and "model.residual=False" in found[1]
    assert model.non_gpt2_features(small_model(mlp_ratio=4.0)) == []  # width is a shape interop checks itself


def test_a_config_saved_before_the_switches_existed_still_builds_the_default(tmp_path):
    keys = ("norm_position", "residual", "activation", "mlp_ratio")
    saved = json.loads(base_config().to_json())
    for key in keys:
        del saved["model"][key]
    (tmp_path / "config.json").write_text(json.dumps({"project": "andrea-jax", "config": saved}))
    saved = run_dir.load_saved_config(str(tmp_path))  # read over the defaults: the one place they live
    validate(saved)
    old = saved.model
    assert model.mlp_hidden_dim(old) == 3072 and model.non_gpt2_features(old) == []
    assert parameter_table.count(parameter_table.param_shapes(old)) == ANDREA_PARAMS
