"""LayerNorm's function, with autodiff's backward or a written-out one."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _normalized(x_BxLxD: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float, dtype):
    """(the normalized rows in `dtype`, each row's float32 mean and 1 / sqrt(variance + epsilon))."""
    x = x_BxLxD.astype(jnp.float32)
    mean_BxLx1 = x.mean(-1, keepdims=True)
    rstd_BxLx1 = jax.lax.rsqrt(jnp.square(x - mean_BxLx1).mean(-1, keepdims=True) + epsilon)
    return ((x - mean_BxLx1) * rstd_BxLx1 * scale + bias).astype(dtype), mean_BxLx1, rstd_BxLx1


def layer_norm(x_BxLxD: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float, dtype) -> jax.Array:
    """scale * (x - mean) / sqrt(var + epsilon) + bias in `dtype`, statistics in float32 (autodiff's backward)."""
    return _normalized(x_BxLxD, scale, bias, epsilon, dtype)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fused_layer_norm(x_BxLxD: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float, dtype) -> jax.Array:
    """`layer_norm` with a written-out backward: each row's two reductions in one pass over it, its
    gradient in one more. XLA's GPU fusions of autodiff's backward re-read the float32 rows several
    times; on GPUs the norms were a quarter of a step's bytes (bench/RESULTS.md)."""
    return layer_norm(x_BxLxD, scale, bias, epsilon, dtype)


def _layer_norm_fwd(x_BxLxD, scale, bias, epsilon, dtype):
    y, mean_BxLx1, rstd_BxLx1 = _normalized(x_BxLxD, scale, bias, epsilon, dtype)
    # The statistics are kept as computed ([B, L] each). XLA otherwise recomputed them from x inside the
    # backward's fusions, and the fusion holding that row reduction could not also sum the scale's gradient
    # over the rows: it wrote dy · normed in float32 for a pass of its own (bench/RESULTS.md).
    mean_BxLx1, rstd_BxLx1 = jax.lax.optimization_barrier((mean_BxLx1, rstd_BxLx1))
    return y, (x_BxLxD, mean_BxLx1, rstd_BxLx1, scale)


def _layer_norm_bwd(epsilon, dtype, residuals, dy_BxLxD):
    x_BxLxD, mean_BxLx1, rstd_BxLx1, scale = residuals
    normed = (x_BxLxD.astype(jnp.float32) - mean_BxLx1) * rstd_BxLx1
    dy = dy_BxLxD.astype(jnp.float32)
    d_normed = dy * scale
    rows = tuple(range(dy.ndim - 1))
    # dx = rstd · (d_normed - mean(d_normed) - normed · mean(d_normed · normed)), per row.
    d_mean = d_normed.mean(-1, keepdims=True)
    d_normed_dot = (d_normed * normed).mean(-1, keepdims=True)
    dx = (rstd_BxLx1 * (d_normed - d_mean - normed * d_normed_dot)).astype(x_BxLxD.dtype)
    return dx, (dy * normed).sum(rows), dy.sum(rows)


fused_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)
