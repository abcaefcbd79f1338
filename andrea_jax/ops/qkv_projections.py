"""The attention's q, k and v projections from GPT-2's c_attn kernel [D, 3, H, K]."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def three_products(x_BxLxD: jax.Array, kernel_Dx3xHxK: jax.Array, bias_3xHxK: jax.Array, dtype,
                   biased: tuple[bool, ...], matmul) -> list:
    """(q, k, v) = x·kernel[:, i] + bias[i] in `dtype`, each its own `matmul` (CPU programs). Only the
    outputs `biased` names get their bias (the others' bias gradients are zero).

    Three products rather than one [B, L, 3, H, K] product and three slices: each of q, k and v is
    written once, where attention reads it (the slices were copies, and their cotangents were stacked
    back; bench/RESULTS.md).
    """
    products = (matmul(x_BxLxD, kernel_Dx3xHxK[:, i], "bld,dhk->blhk", dtype, dtype) for i in range(3))
    return [(p + bias_3xHxK[i]).astype(dtype) if biased[i] else p for i, p in enumerate(products)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def stacked(x_BxLxD: jax.Array, kernel_Dx3xHxK: jax.Array, bias_3xHxK: jax.Array, dtype,
            biased: tuple[bool, ...] = (True, True, True), merge_odd_heads: bool = False) -> tuple:
    """`three_products` with one backward: their cotangents stacked for one product into the kernel's
    gradient and one into x's, where three products each read x again and summed three partial gradients
    of x. GPU and TPU programs (XLA's TPU compiler takes the stack into the products' operands, its GPU
    compiler writes it once; bench/RESULTS.md).

    `merge_odd_heads` (GPUs): for heads that are not a power of two wide, the stack is merged into
    [B, L, 3·D] behind a barrier before the product into x's gradient. XLA's GPU compiler fused the stack's
    transposes into that product's Triton GEMM and found no tiles for it (heads of 20 at d_model 80 on an
    A100: "Couldn't find output tile sizes"); merged, it is a 2-D product.
    """
    return _qkv_fwd(x_BxLxD, kernel_Dx3xHxK, bias_3xHxK, dtype, biased, merge_odd_heads)[0]


def _qkv_fwd(x_BxLxD, kernel_Dx3xHxK, bias_3xHxK, dtype, biased, merge_odd_heads):
    x = x_BxLxD.astype(dtype)
    products = [jnp.einsum("bld,dhk->blhk", x, kernel_Dx3xHxK[:, i].astype(dtype), preferred_element_type=dtype)
                for i in range(3)]
    qkv = tuple((p + bias_3xHxK[i]).astype(dtype) if biased[i] else p for i, p in enumerate(products))
    return qkv, (x_BxLxD, kernel_Dx3xHxK)


def _qkv_bwd(dtype, biased, merge_odd_heads, residuals, d_qkv):
    x_BxLxD, kernel_Dx3xHxK = residuals
    g_BxLx3xHxK = jnp.stack([d.astype(dtype) for d in d_qkv], axis=2)
    d_kernel = jnp.einsum("bld,blchk->dchk", x_BxLxD.astype(dtype), g_BxLx3xHxK, preferred_element_type=jnp.float32)
    batch, length, _, heads, head_dim = g_BxLx3xHxK.shape
    if merge_odd_heads and head_dim & (head_dim - 1):
        g_BxLxC = jax.lax.optimization_barrier(g_BxLx3xHxK.reshape(batch, length, 3 * heads * head_dim))
        d_x = jnp.einsum("blc,dc->bld", g_BxLxC, kernel_Dx3xHxK.astype(dtype).reshape(-1, 3 * heads * head_dim),
                         preferred_element_type=x_BxLxD.dtype)
    else:
        d_x = jnp.einsum("blchk,dchk->bld", g_BxLx3xHxK, kernel_Dx3xHxK.astype(dtype),
                         preferred_element_type=x_BxLxD.dtype)
    if all(biased):
        return d_x, d_kernel, g_BxLx3xHxK.astype(jnp.float32).sum((0, 1))
    d_bias = [d.astype(jnp.float32).sum((0, 1)) if on else jnp.zeros(d.shape[2:], jnp.float32)
              for d, on in zip(d_qkv, biased)]
    return d_x, d_kernel, jnp.stack(d_bias)


stacked.defvjp(_qkv_fwd, _qkv_bwd)
