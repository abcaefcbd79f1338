"""Causal attention as einsums (the `xla` implementation, attention.py): softmax(q·kᵀ/√K + mask)·v, scores
and softmax in float32, products in the compute dtype, [B, H, L, S] scores in memory.

Without dropout the backward is written out: `softmax_attention` keeps the probabilities for it,
`recomputing_attention` recomputes them from q and k. With dropout (`dropout_attention`) it is autodiff's.
`in_query_blocks` runs any of them a block of queries at a time.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from andrea_jax.ops.log_sum_exp import log_sum_exp


def in_query_blocks(attend, q_BxLxHxK: jax.Array, k_BxSxHxK: jax.Array, v_BxSxHxK: jax.Array, causal_LxS: jax.Array,
                    dtype, query_block: int | None) -> jax.Array:
    """attend(q, k, v, mask, dtype), `query_block` queries at a time (None: all at once) when S = L.

    Query block i attends keys [0, end of block i) only: the blocks above the causal diagonal are
    never computed (a quarter of the square at 2 blocks), and each row still gets one exact softmax
    over all its keys. Measured on a CPU step and in a T4's compiled step (bench/RESULTS.md).
    """
    length = q_BxLxHxK.shape[1]
    if query_block is None or length <= query_block:
        return attend(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, dtype)
    return jnp.concatenate([
        attend(q_BxLxHxK[:, start:stop], k_BxSxHxK[:, :stop], v_BxSxHxK[:, :stop], causal_LxS[start:stop, :stop], dtype)
        for start in range(0, length, query_block)
        for stop in [min(start + query_block, length)]], axis=1)


def _attention_logits(q_BxLxHxK: jax.Array, k_BxSxHxK: jax.Array, causal_LxS: jax.Array,
                      scores_dtype=jnp.float32) -> jax.Array:
    """q·kᵀ/√K + mask in float32, the product written in `scores_dtype`: in float16 (`_scores_dtype`)
    from q/√K, so that the products stay in float16's range."""
    if scores_dtype == jnp.float32:
        logits_BxHxLxS = jnp.einsum("bqhk,bshk->bhqs", q_BxLxHxK, k_BxSxHxK,
                                    preferred_element_type=jnp.float32) / math.sqrt(q_BxLxHxK.shape[-1])
    else:
        scaled_q_BxLxHxK = (q_BxLxHxK / math.sqrt(q_BxLxHxK.shape[-1])).astype(q_BxLxHxK.dtype)
        logits_BxHxLxS = jnp.einsum("bqhk,bshk->bhqs", scaled_q_BxLxHxK, k_BxSxHxK,
                                    preferred_element_type=scores_dtype).astype(jnp.float32)
    return jnp.where(causal_LxS, logits_BxHxLxS, jnp.finfo(jnp.float32).min)


def _scores_dtype(dtype) -> Any:
    """The type the recomputing backward's [B, H, L, S] products are written in: float16 when computing
    in float16 (a T4's, as PyTorch's autocast writes them; half the bytes of a T4 step's largest
    arrays, bench/RESULTS.md), else float32 (rounded to bfloat16's 8 bits, a logit near 10 moves by up to
    0.02, its probability by up to 2%)."""
    return jnp.float16 if jnp.dtype(dtype) == jnp.float16 else jnp.float32


def _attention_probs(q_BxLxHxK: jax.Array, k_BxSxHxK: jax.Array, causal_LxS: jax.Array) -> jax.Array:
    """softmax(q·kᵀ/√K + mask) in float32."""
    return jax.nn.softmax(_attention_logits(q_BxLxHxK, k_BxSxHxK, causal_LxS), axis=-1)


def dropout_attention(q_BxLxHxK: jax.Array, k_BxSxHxK: jax.Array, v_BxSxHxK: jax.Array, causal_LxS: jax.Array,
                      dtype, dropout) -> jax.Array:
    """softmax(q·kᵀ/√K + mask)·v with `dropout` applied to the probabilities, autodiff's backward."""
    probs_BxHxLxS = dropout(_attention_probs(q_BxLxHxK, k_BxSxHxK, causal_LxS))
    return jnp.einsum("bhqs,bshk->bqhk", probs_BxHxLxS.astype(dtype), v_BxSxHxK,
                      preferred_element_type=jnp.float32).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def softmax_attention(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, dtype):
    """softmax(q·kᵀ/√K + mask)·v, the float32 probabilities kept for the written-out backward."""
    return _attention_fwd(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, dtype)[0]


def _attention_fwd(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, dtype):
    probs_BxHxLxS = _attention_probs(q_BxLxHxK, k_BxSxHxK, causal_LxS)
    out_BxLxHxK = jnp.einsum("bhqs,bshk->bqhk", probs_BxHxLxS.astype(dtype), v_BxSxHxK,
                             preferred_element_type=jnp.float32).astype(dtype)
    return out_BxLxHxK, (q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, probs_BxHxLxS)


def _attention_bwd(dtype, residuals, d_out_BxLxHxK):
    """Autodiff's backward would multiply float32 cotangents by the bf16 operands, which XLA runs
    as float32 products (on a CPU at a fraction of the bf16 rate); here the cotangents are rounded
    to `dtype` first, as `ops.matmul` does for the weights; softmax's own backward stays in
    float32. For float32 this is autodiff's backward (measured in bench/RESULTS.md).
    """
    q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, probs_BxHxLxS = residuals
    return _attention_grads(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, probs_BxHxLxS, d_out_BxLxHxK, dtype)


def _attention_grads(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, probs_BxHxLxS, d_out_BxLxHxK, dtype, row_sums_BxHxLx1=None,
                     scores_dtype=jnp.float32):
    """(d q, d k, d v, None for the mask) from the probabilities; softmax's row sums Σ_s p·dp are
    taken from d p unless given; d p is written in `scores_dtype` (a narrower one needs the row sums)."""
    f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    g_BxLxHxK = d_out_BxLxHxK.astype(dtype)
    d_v_BxSxHxK = f32("bhqs,bqhk->bshk", probs_BxHxLxS.astype(dtype), g_BxLxHxK)
    root_k = math.sqrt(q_BxLxHxK.shape[-1])
    if scores_dtype == jnp.float32:
        d_probs_BxHxLxS = f32("bqhk,bshk->bhqs", g_BxLxHxK, v_BxSxHxK)
        if row_sums_BxHxLx1 is None:
            row_sums_BxHxLx1 = jnp.sum(d_probs_BxHxLxS * probs_BxHxLxS, -1, keepdims=True)
        d_logits_BxHxLxS = probs_BxHxLxS * (d_probs_BxHxLxS - row_sums_BxHxLx1) / root_k
    else:  # 1/√K goes into the cotangent before the product (exact for heads of 64): d p then stays
        # in float16's range under a loss scale √K times larger
        d_probs_BxHxLxS = jnp.einsum("bqhk,bshk->bhqs", (g_BxLxHxK / root_k).astype(dtype), v_BxSxHxK,
                                     preferred_element_type=scores_dtype).astype(jnp.float32)
        d_logits_BxHxLxS = probs_BxHxLxS * (d_probs_BxHxLxS - row_sums_BxHxLx1 / root_k)
    d_logits_BxHxLxS = d_logits_BxHxLxS.astype(dtype)
    d_q_BxLxHxK = f32("bhqs,bshk->bqhk", d_logits_BxHxLxS, k_BxSxHxK)
    d_k_BxSxHxK = f32("bhqs,bqhk->bshk", d_logits_BxHxLxS, q_BxLxHxK)
    return (d_q_BxLxHxK.astype(q_BxLxHxK.dtype), d_k_BxSxHxK.astype(k_BxSxHxK.dtype),
            d_v_BxSxHxK.astype(v_BxSxHxK.dtype), None)


softmax_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def recomputing_attention(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, dtype):
    """`softmax_attention` keeping only each row's float32 log-sum-exp for the backward, which recomputes
    the probabilities from q and k (flash attention's algorithm, in XLA one query block at a time):
    the float32 [B, H, L, S] probabilities are neither kept nor read back, and softmax's backward
    takes its row sums from out · d_out ([B, L, H]) instead of a pass over [B, H, L, S]. GPU
    programs only (the T4's, where XLA runs attention): on a T4 the kept probabilities were most
    of a step's bytes; a CPU step, bound by its FLOPs, would pay for the second q·kᵀ.
    """
    return _recomputing_fwd(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, dtype)[0]


def _recomputing_fwd(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, dtype):
    logits_BxHxLxS = _attention_logits(q_BxLxHxK, k_BxSxHxK, causal_LxS, _scores_dtype(dtype))
    log_sum_BxHxLx1 = log_sum_exp(logits_BxHxLxS)[0][..., None]
    probs_BxHxLxS = jnp.exp(logits_BxHxLxS - log_sum_BxHxLx1)
    out_BxLxHxK = jnp.einsum("bhqs,bshk->bqhk", probs_BxHxLxS.astype(dtype), v_BxSxHxK,
                             preferred_element_type=jnp.float32).astype(dtype)
    return out_BxLxHxK, (q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, out_BxLxHxK, log_sum_BxHxLx1)


def _recomputing_bwd(dtype, residuals, d_out_BxLxHxK):
    """`_attention_bwd` with the probabilities recomputed, and Σ_s p·dp = d_out · out per row."""
    # The barrier (with d_out in it, so that nothing runs before the backward reaches this block)
    # keeps XLA from taking the recomputed product for the forward's (common subexpressions),
    # which would keep the forward's float32 scores alive until here.
    residuals, d_out_BxLxHxK = jax.lax.optimization_barrier((residuals, d_out_BxLxHxK))
    q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, out_BxLxHxK, log_sum_BxHxLx1 = residuals
    scores_dtype = _scores_dtype(dtype)
    probs_BxHxLxS = jnp.exp(_attention_logits(q_BxLxHxK, k_BxSxHxK, causal_LxS, scores_dtype) - log_sum_BxHxLx1)
    row_sums_BxLxH = jnp.sum(d_out_BxLxHxK.astype(jnp.float32) * out_BxLxHxK.astype(jnp.float32), -1)
    return _attention_grads(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, probs_BxHxLxS, d_out_BxLxHxK, dtype,
                            row_sums_BxLxH.transpose(0, 2, 1)[..., None], scores_dtype)


recomputing_attention.defvjp(_recomputing_fwd, _recomputing_bwd)

