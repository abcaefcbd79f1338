"""GPT-2 layout in and out: an exact round trip, and the same logits as transformers."""

import numpy as np
import pytest

from andrea_jax import UserError
from andrea_jax.gpt2 import interop
from tests.test_model import forward, init, small_model


@pytest.mark.parametrize("scan_layers", [False, True])
def test_round_trip_is_exact(scan_layers):
    m = small_model(scan_layers=scan_layers)
    params = init(m)
    sd = interop.to_gpt2(params, m)
    assert sd["transformer.h.1.attn.c_attn.weight"].shape == (64, 192)
    assert sd["transformer.wte.weight"] is sd["lm_head.weight"] or \
        np.array_equal(sd["transformer.wte.weight"], sd["lm_head.weight"])
    back = interop.from_gpt2(sd, m)
    flat_a = {k: np.asarray(v) for k, v in _flatten(params).items()}
    flat_b = _flatten(back)
    assert flat_a.keys() == flat_b.keys()
    for key in flat_a:
        np.testing.assert_array_equal(flat_a[key], flat_b[key], err_msg=key)


def test_qkv_layout_matches_gpt2_column_order():
    """Column j of c_attn is q for j < D, then k, then v; heads are contiguous."""
    m = small_model()
    params = init(m)
    qkv = np.asarray(params["block_0"]["attn"]["qkv_kernel"])  # (D, 3, H, K)
    c_attn = interop.to_gpt2(params, m)["transformer.h.0.attn.c_attn.weight"]
    d, head_dim = 64, 16
    np.testing.assert_array_equal(c_attn[:, d + 2 * head_dim + 5], qkv[:, 1, 2, 5])  # k, head 2, dim 5


def test_wrong_shape_names_the_fix():
    m = small_model()
    sd = interop.to_gpt2(init(m), m)
    with pytest.raises(UserError, match="set --config.model.d_model=64"):
        interop.from_gpt2(sd, small_model(d_model=128, n_head=4))


def test_logits_equal_transformers_gpt2():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=101, n_positions=16, n_embd=64, n_layer=2, n_head=4,
                                  activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, layer_norm_epsilon=1e-5, initializer_range=0.02)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        # Large weights and non-trivial norms, so a wrong GELU or epsilon would show.
        for name, p in hf.named_parameters():
            if "ln" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("weight") else 0.3 * torch.randn_like(p))
            else:
                p.mul_(8.0)
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    m = small_model()
    params = interop.from_gpt2(sd, m)
    ids = np.random.default_rng(0).integers(0, 101, (2, 16))
    with torch.no_grad():
        expected = hf(torch.from_numpy(ids)).logits.numpy()
    ours = np.asarray(forward(m, params, ids))
    assert np.abs(expected).max() > 1.0
    np.testing.assert_allclose(ours, expected, atol=1e-5 * np.abs(expected).max(), rtol=0)
    # and back: our params exported load into transformers with the same logits
    hf2 = transformers.GPT2LMHeadModel(cfg).eval()
    missing = hf2.load_state_dict({k: torch.from_numpy(v) for k, v in interop.to_gpt2(params, m).items()},
                                  strict=False)
    assert not missing.missing_keys
    with torch.no_grad():
        np.testing.assert_allclose(hf2(torch.from_numpy(ids)).logits.numpy(), expected, atol=1e-5, rtol=0)


def _flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + k + "/"))
        else:
            out[prefix + k] = np.asarray(v)
    return out


@pytest.mark.parametrize("variant", [dict(activation="swiglu"), dict(norm_position="post"), dict(residual=False),
                                     dict(activation="relu")])
def test_non_gpt2_variants_are_refused(variant):
    m = small_model()
    sd = interop.to_gpt2(init(m), m)
    other = small_model(**variant)
    with pytest.raises(UserError, match="set them back to their defaults"):
        interop.from_gpt2(sd, other)


def test_mlp_ratio_that_misses_the_weights_names_the_fix():
    m = small_model()
    sd = interop.to_gpt2(init(m), m)
    with pytest.raises(UserError, match="set --config.model.mlp_ratio=0 --config.model.mlp_dim=256"):
        interop.from_gpt2(sd, small_model(mlp_ratio=2.0))
    assert interop.from_gpt2(sd, small_model(mlp_ratio=4.0))["block_0"]["mlp"]["fc_kernel"].shape == (64, 256)
