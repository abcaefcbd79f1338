"""A matmul that stays in the compute dtype, forward and backward (the model's weight products)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _product(spec: str, a: jax.Array, b: jax.Array, out_dtype, host: bool) -> jax.Array:
    """einsum accumulated in float32, its result in `out_dtype`.

    For a CPU (`host`) the result is float32 and then rounded: XLA:CPU's fast bfloat16 products have
    float32 results (bench/RESULTS.md). A GPU or TPU rounds in the product's own epilogue,
    which saves writing and reading back a float32 copy of every activation.
    """
    if out_dtype == jnp.float32 or host:
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out_dtype)
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)


def matmul(x: jax.Array, kernel: jax.Array, spec: str, dtype, out_dtype=jnp.float32,
           bias: jax.Array | None = None, *, host: bool = False, bias_in_product: bool = False) -> jax.Array:
    """x·kernel (an einsum `spec`: activations times weights) rounded to `dtype`, accumulated in float32,
    plus `bias` (float32, over the output's last axes) if given, in `out_dtype`, with a written-out backward.

    Autodiff on bf16 operands would multiply the float32 cotangent by a bf16 operand, which XLA
    runs as a float32 matmul: two thirds of a step's FLOPs would miss the bf16 units. Here the
    cotangent is rounded to `dtype` first (as mixed-precision training does everywhere), and the
    float32 results come back in the operands' own dtypes, so a float32 weight gets its gradient
    unrounded. For float32 the rounding is a no-op; float16 cotangents are only safe because the
    train step scales the loss (`loss_scale.py`). Reverse mode only.

    `host`: a CPU program's products (`_product`), and the cotangent passes an optimization barrier:
    XLA:CPU otherwise fuses the elementwise work that produces it (softmax and LayerNorm backward,
    residual sums) into the transposes feeding both products and recomputes it in each (bench/RESULTS.md).
    Attention's batched products have their own backward (`einsum_attention.py`).

    `bias_in_product` (GPU programs): the bias is added to the float32 product inside it, and its gradient
    summed in its backward: XLA's GPU compiler then adds it in the product's epilogue, where added to the
    product's rounded result it took a pass of its own over the output (bench/RESULTS.md).
    Otherwise it is added to the result.
    """
    operands = spec.split("->")[0].split(",")
    # The backward's specs swap the output with an operand: every index must be named once.
    if "." in spec or any(len(set(s)) != len(s) for s in operands):
        raise ValueError(f"einsum spec {spec!r}: no '...' and no index repeated within an operand")
    if bias is None:
        return _matmul(spec, x, kernel, dtype, out_dtype, host)
    if bias_in_product:
        return _matmul_plus_bias(spec, x, kernel, bias, dtype, out_dtype, host)
    return (_matmul(spec, x, kernel, dtype, out_dtype, host) + bias).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4, 5))
def _matmul(spec: str, a: jax.Array, b: jax.Array, dtype, out_dtype, host: bool) -> jax.Array:
    return _matmul_fwd(spec, a, b, dtype, out_dtype, host)[0]


def _matmul_fwd(spec, a, b, dtype, out_dtype, host):
    return _product(spec, a.astype(dtype), b.astype(dtype), out_dtype, host), (a, b)


def _matmul_bwd(spec, dtype, out_dtype, host, residuals, cotangent):
    a, b = residuals
    operands, out = spec.split("->")
    spec_a, spec_b = operands.split(",")
    g = cotangent.astype(dtype)
    if host:  # measured there only; accelerators fuse differently
        g = jax.lax.optimization_barrier(g)
    a_, b_ = a.astype(dtype), b.astype(dtype)
    grad_a = _product(f"{out},{spec_b}->{spec_a}", g, b_, a.dtype, host)
    grad_b = _product(f"{spec_a},{out}->{spec_b}", a_, g, b.dtype, host)
    return grad_a, grad_b


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5, 6))
def _matmul_plus_bias(spec: str, a: jax.Array, b: jax.Array, bias: jax.Array, dtype, out_dtype,
                      host: bool) -> jax.Array:
    return _matmul_plus_bias_fwd(spec, a, b, bias, dtype, out_dtype, host)[0]


def _matmul_plus_bias_fwd(spec, a, b, bias, dtype, out_dtype, host):
    product = _product(spec, a.astype(dtype), b.astype(dtype), jnp.float32, host)
    return (product + bias).astype(out_dtype), (a, b, bias)


def _matmul_plus_bias_bwd(spec, dtype, out_dtype, host, residuals, cotangent):
    a, b, bias = residuals
    grad_a, grad_b = _matmul_bwd(spec, dtype, out_dtype, host, (a, b), cotangent)
    rows = tuple(range(cotangent.ndim - bias.ndim))
    return grad_a, grad_b, cotangent.astype(jnp.float32).sum(rows).astype(bias.dtype)


_matmul_plus_bias.defvjp(_matmul_plus_bias_fwd, _matmul_plus_bias_bwd)
