"""Mixed precision: the "auto" compute dtype and the matmul whose backward stays in bfloat16 (`ops/matmul.py`)."""

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from andrea_jax import ops, precision, sharding, train_step
from andrea_jax.ops.matmul import matmul
from andrea_jax.config import ConfigError, base_config, validate
from tests.test_model import normals, params_like_init

CPUINFO_WITH_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n"
CPUINFO_WITHOUT = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n"


class FakeDevice:
    def __init__(self, platform, compute_capability=None):
        self.platform = platform
        if compute_capability is not None:
            self.compute_capability = compute_capability


@pytest.mark.parametrize("name, device, cpuinfo, expected", [
    ("auto", FakeDevice("cpu"), CPUINFO_WITH_BF16, "bfloat16"),
    ("auto", FakeDevice("cpu"), CPUINFO_WITHOUT, "float32"),
    ("auto", FakeDevice("cpu"), "", "float32"),
    ("auto", FakeDevice("gpu", "9.0"), CPUINFO_WITHOUT, "bfloat16"),  # H100/H200
    ("auto", FakeDevice("gpu", "8.0"), CPUINFO_WITHOUT, "bfloat16"),  # A100
    ("auto", FakeDevice("gpu", "7.5"), CPUINFO_WITH_BF16, "float16"),  # T4: float16 tensor cores only
    ("auto", FakeDevice("gpu", "7.0"), CPUINFO_WITHOUT, "float16"),  # V100
    ("auto", FakeDevice("gpu", "6.0"), CPUINFO_WITHOUT, "float32"),  # P100: no tensor cores
    ("auto", FakeDevice("tpu"), CPUINFO_WITHOUT, "bfloat16"),
    ("float32", FakeDevice("gpu", "9.0"), CPUINFO_WITH_BF16, "float32"),
    ("bfloat16", FakeDevice("cpu"), CPUINFO_WITHOUT, "bfloat16"),
])
def test_auto_dtype_follows_the_hardware_and_explicit_names_stay(name, device, cpuinfo, expected):
    assert precision.resolve_dtype_name(name, device=device, cpuinfo=cpuinfo) == expected


def test_config_accepts_auto_and_names_the_choices_on_a_typo():
    c = base_config()
    c.model.dtype = "auto"
    validate(c)
    c.model.dtype = "bf16"
    with pytest.raises(ConfigError, match="not one of 'auto', 'float32', 'bfloat16', 'float16'"):
        validate(c)


SPECS = {  # every einsum the model routes through ops.matmul, at small shapes
    "bld,dthk->blthk": ((2, 5, 8), (8, 3, 2, 4)),
    "blhk,hkd->bld": ((2, 5, 2, 4), (2, 4, 8)),
    "bld,df->blf": ((2, 5, 8), (8, 12)),
    "blf,fd->bld": ((2, 5, 12), (12, 8)),
    "bld,vd->blv": ((2, 5, 8), (11, 8)),
}


@pytest.mark.parametrize("spec", SPECS)
def test_low_precision_backward_is_the_bf16_product_of_the_rounded_cotangent(spec):
    shape_a, shape_b = SPECS[spec]
    a, b = normals(0, shape_a, shape_b, dtype=jnp.bfloat16)
    out, vjp = jax.vjp(lambda x, y: matmul(x, y, spec, jnp.bfloat16, jnp.float32), a, b)
    assert out.dtype == jnp.float32
    g, = normals(1, out.shape)
    grad_a, grad_b = vjp(g)
    assert grad_a.dtype == grad_b.dtype == jnp.bfloat16

    # The reference: float64 products of the bf16 operands and the bf16-rounded cotangent.
    operands, out_spec = spec.split("->")
    spec_a, spec_b = operands.split(",")
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
    g16 = f64(g.astype(jnp.bfloat16))
    want_a = np.einsum(f"{out_spec},{spec_b}->{spec_a}", g16, f64(b))
    want_b = np.einsum(f"{spec_a},{out_spec}->{spec_b}", f64(a), g16)
    # Within one bf16 rounding (2^-8 relative) of the exact product.
    np.testing.assert_allclose(f64(grad_a), want_a, rtol=2 ** -8, atol=1e-6 * np.abs(want_a).max())
    np.testing.assert_allclose(f64(grad_b), want_b, rtol=2 ** -8, atol=1e-6 * np.abs(want_b).max())
    # And close to float32 autodiff of the same einsum (what the cotangent rounding costs).
    ref_a, ref_b = jax.vjp(lambda x, y: jnp.einsum(spec, x.astype(jnp.float32), y.astype(jnp.float32)), a, b)[1](g)
    assert np.abs(f64(grad_a) - f64(ref_a)).max() <= 0.02 * np.abs(f64(ref_a)).max()
    assert np.abs(f64(grad_b) - f64(ref_b)).max() <= 0.02 * np.abs(f64(ref_b)).max()


def _dot_operand_dtypes(stablehlo: str) -> list[tuple[str, str]]:
    """(lhs, rhs) element types of every dot_general in a StableHLO module."""
    pairs = []
    for line in stablehlo.splitlines():
        if "stablehlo.dot_general" in line:
            types = re.search(r":\s*\(tensor<[^>]*x(\w+)>,\s*tensor<[^>]*x(\w+)>\)", line)
            pairs.append(types.groups())
    return pairs


def test_bf16_gradient_runs_every_weight_matmul_in_bf16_forward_and_backward():
    c = base_config()
    m = c.model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim, m.max_len, m.vocab_size = 2, 32, 2, 64, 16, 50
    m.dtype = "bfloat16"
    params = params_like_init(m)
    batch = jnp.zeros((2, 9), jnp.int32)
    grad_fn = jax.grad(lambda p, b: train_step.token_losses(p, m, b)[0].mean())
    text = jax.jit(grad_fn).lower(params, batch).as_text()
    pairs = _dot_operand_dtypes(text)
    all_bf16 = sum(1 for lhs, rhs in pairs if lhs == rhs == "bf16")
    # Per layer: 6 weight matmuls (q, k, v, out, fc, proj), plus the tied output; each
    # runs once forward and twice backward. Attention's own 2 products forward and 4 backward.
    assert len(pairs) == 3 * (6 * m.n_layer + 1) + 6 * m.n_layer, pairs
    assert all_bf16 == len(pairs), pairs


@pytest.mark.parametrize("d_model, n_head, vocab, batch, length", [
    (64, 4, 66, 1, 8), (128, 4, 8449, 12, 64), (96, 3, 8576, 3, 40), (64, 4, 66, 2, 160)])
def test_bf16_gradient_runs_at_odd_shapes_and_matches_float32(d_model, n_head, vocab, batch, length):
    # XLA:CPU has no kernel for some bf16 x bf16 -> f32 dot layouts and fails at run time;
    # the backward's products must land on supported ones at any shape (160: attention in
    # query blocks of 128 and 32 on a CPU).
    c = base_config()
    m = c.model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim, m.max_len, m.vocab_size = 1, d_model, n_head, 4 * d_model, length, vocab
    params = params_like_init(m)
    batch_ids = jnp.asarray(np.random.default_rng(1).integers(0, vocab, (batch, length + 1)), jnp.int32)
    grads = {}
    for dtype in ("bfloat16", "float32"):
        m.dtype = dtype
        grad_fn = jax.jit(jax.grad(lambda p, b, mc=ml_collections.ConfigDict(m.to_dict()):
                                   train_step.token_losses(p, mc, b)[0].mean()))
        grads[dtype] = grad_fn(params, batch_ids)
    for g16, g32 in zip(jax.tree.leaves(grads["bfloat16"]), jax.tree.leaves(grads["float32"])):
        assert np.all(np.isfinite(g16))
        assert np.abs(g16 - g32).max() <= 0.05 * np.abs(g32).max() + 1e-7


@pytest.mark.parametrize("spec", SPECS)
def test_float32_backward_equals_autodiff(spec):
    # The written-out backward serves float32 too (the default model): there it must
    # be autodiff's, to float32 rounding.
    shape_a, shape_b = SPECS[spec]
    a, b = normals(3, shape_a, shape_b)
    out, vjp = jax.vjp(lambda x, y: matmul(x, y, spec, jnp.float32, jnp.float32), a, b)
    g, = normals(4, out.shape)
    ref_out, ref_vjp = jax.vjp(lambda x, y: jnp.einsum(spec, x, y), a, b)
    np.testing.assert_array_equal(out, ref_out)
    for got, want in zip(vjp(g), ref_vjp(g)):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_float16_backward_runs_in_float16_and_needs_the_loss_scaled():
    # A float16 cotangent of 2e-8 is below float16's smallest number: unscaled, the weight's
    # gradient vanishes; scaled by 2**16 (as the train step does for float16) it survives.
    x = jnp.ones((4, 8), jnp.float16)
    w = jnp.ones((8, 3), jnp.float32)
    loss = lambda x, w, scale: scale * 2e-8 * matmul(x, w, "td,dn->tn", jnp.float16).sum()
    grad_x, grad_w = jax.grad(loss, argnums=(0, 1))(x, w, 1.0)
    assert grad_x.dtype == jnp.float16 and grad_w.dtype == jnp.float32
    assert float(jnp.abs(grad_w).max()) == 0.0
    scaled_grad_w = jax.grad(loss, argnums=1)(x, w, 2.0 ** 16) / 2.0 ** 16
    np.testing.assert_allclose(np.asarray(scaled_grad_w), 4 * 2e-8, rtol=1e-3)  # four rows of 2e-8
    # The bf16 path returns a float32 weight's gradient in float32 as well.
    grad_w16 = jax.grad(lambda w: matmul(x, w, "td,dn->tn", jnp.bfloat16).sum())(w)
    assert grad_w16.dtype == jnp.float32


def test_matmul_refuses_specs_its_backward_cannot_transpose():
    with pytest.raises(ValueError, match="no index repeated"):
        matmul(jnp.ones((3, 3)), jnp.ones((3,)), "ii,i->i", jnp.float32)


@pytest.mark.parametrize("platform, result_dtypes", [("cpu", {"f32"}), ("tpu", {"bf16"})])
def test_products_return_the_compute_dtype_on_accelerators_and_float32_then_rounded_on_a_cpu(
        platform, result_dtypes, monkeypatch):
    """XLA:CPU multiplies bf16 fastest with float32 results; a GPU or TPU rounds in the product itself."""
    monkeypatch.setattr(sharding, "program_platform", lambda: platform)
    x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 3), jnp.float32)
    step = lambda x, w: ops.for_program().matmul(x, w, "td,dn->tn", jnp.bfloat16, jnp.bfloat16)
    out = jax.jit(step)(x, w)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), 8.0)
    lowered = jax.jit(step).lower(x, w).as_text()
    products = re.findall(r"stablehlo.dot_general .*-> tensor<4x3x(\w+)>", lowered)
    assert products and set(products) == result_dtypes


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_a_bias_added_in_the_product_on_gpus_is_autodiffs_in_float32_and_close_in_bfloat16(platform, monkeypatch):
    monkeypatch.setattr(sharding, "program_platform", lambda: platform)
    x, w, bias, g = normals(4, (2, 5, 8), (8, 6), (6,), (2, 5, 6))
    ours = lambda dtype: jax.vjp(lambda *a: ops.for_program().matmul(*a[:2], "bld,df->blf", dtype, dtype, bias=a[2]),
                                 x.astype(dtype), w, bias)
    out, vjp = ours(jnp.float32)
    expected, autodiff_vjp = jax.vjp(lambda x, w, b: jnp.einsum("bld,df->blf", x, w) + b, x, w, bias)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    reference = autodiff_vjp(g)
    for got, want in zip(vjp(g), reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    out16, vjp16 = ours(jnp.bfloat16)
    assert out16.dtype == jnp.bfloat16
    assert np.abs(np.asarray(out16, np.float32) - expected).max() <= 0.02 * np.abs(expected).max()
    for got, want in zip(vjp16(g.astype(jnp.bfloat16)), reference):
        assert np.abs(np.asarray(got, np.float32) - want).max() <= 0.02 * np.abs(want).max()
    # Only a GPU program adds the bias inside the product's own backward.
    jaxpr = str(jax.make_jaxpr(lambda x: ops.for_program().matmul(x, w, "bld,df->blf", jnp.float32, bias=bias))(x))
    assert ("_matmul_plus_bias" in jaxpr) == (platform == "gpu")
