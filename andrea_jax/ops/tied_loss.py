"""The tied head's cross-entropy a chunk of positions at a time, with a written-out backward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from andrea_jax.ops.log_sum_exp import log_sum_exp


def without_padding(logits_BxLxV: jax.Array, vocab_size: int) -> jax.Array:
    """Padding rows exist only for matmul shapes: they can never be predicted."""
    if logits_BxLxV.shape[-1] == vocab_size:
        return logits_BxLxV
    real_V = jnp.arange(logits_BxLxV.shape[-1]) < vocab_size
    return jnp.where(real_V, logits_BxLxV, jnp.finfo(jnp.float32).min)


def _chunk_logits(x_BxCxD: jax.Array, token_embed: jax.Array, vocab_size: int, dtype) -> jax.Array:
    """`model.tied_logits` of a chunk of positions, forward only (inside `chunked_tied_cross_entropy`)."""
    logits_BxCxV = jnp.einsum("bcd,vd->bcv", x_BxCxD.astype(dtype), token_embed.astype(dtype),
                              preferred_element_type=jnp.float32)
    return without_padding(logits_BxCxV, vocab_size)


def _position_chunks(length: int, chunk_len: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk_len, length)) for start in range(0, length, chunk_len)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def chunked_tied_cross_entropy(x_BxLxD: jax.Array, token_embed: jax.Array, targets_BxL: jax.Array,
                               vocab_size: int, dtype, chunk_len: int) -> jax.Array:
    """optax's integer-label cross-entropy of `model.tied_logits`, [B, L] float32, `chunk_len` positions at a
    time: the float32 [B, L, V] logits are never whole, and the backward recomputes each chunk's
    logits from the stream and forms their cotangent in one pass (XLA's TPU compiler keeps the forward's
    chunks instead). Autodiff of the whole head wrote and re-read the logits, their cotangent and a
    one-hot scatter of the targets (bench/RESULTS.md)."""
    return _cross_entropy_fwd(x_BxLxD, token_embed, targets_BxL, vocab_size, dtype, chunk_len)[0]


def _cross_entropy_fwd(x_BxLxD, token_embed, targets_BxL, vocab_size, dtype, chunk_len):
    losses, log_normalizers = [], []
    for start, stop in _position_chunks(x_BxLxD.shape[1], chunk_len):
        logits_BxCxV = _chunk_logits(x_BxLxD[:, start:stop], token_embed, vocab_size, dtype)
        is_target_BxCxV = targets_BxL[:, start:stop, None] == jnp.arange(token_embed.shape[0])
        # The target's logit rides in the same pass, as a sum with one nonzero term (exact).
        log_normalizer_BxC, target_BxC = log_sum_exp(logits_BxCxV, jnp.where(is_target_BxCxV, logits_BxCxV, 0.0))
        losses.append(log_normalizer_BxC - target_BxC)
        log_normalizers.append(log_normalizer_BxC)
    log_normalizer_BxL = jnp.concatenate(log_normalizers, axis=1)
    return jnp.concatenate(losses, axis=1), (x_BxLxD, token_embed, targets_BxL, log_normalizer_BxL)


def _cross_entropy_bwd(vocab_size, dtype, chunk_len, residuals, d_losses_BxL):
    """d logits = (softmax - one-hot(target)) × d loss, rounded to `dtype` as `ops.matmul`'s
    backward rounds a cotangent; the stream's gradient comes back in its dtype, the embedding's in float32."""
    x_BxLxD, token_embed, targets_BxL, log_normalizer_BxL = residuals
    embed_VxD = token_embed.astype(dtype)
    d_x_chunks, d_embed_VxD = [], jnp.zeros(token_embed.shape, jnp.float32)
    for start, stop in _position_chunks(x_BxLxD.shape[1], chunk_len):
        x_BxCxD = x_BxLxD[:, start:stop]
        logits_BxCxV = _chunk_logits(x_BxCxD, token_embed, vocab_size, dtype)
        probs_BxCxV = jnp.exp(logits_BxCxV - log_normalizer_BxL[:, start:stop, None])
        one_hot_BxCxV = targets_BxL[:, start:stop, None] == jnp.arange(token_embed.shape[0])
        d_logits_BxCxV = ((probs_BxCxV - one_hot_BxCxV) * d_losses_BxL[:, start:stop, None]).astype(dtype)
        d_x_chunks.append(jnp.einsum("bcv,vd->bcd", d_logits_BxCxV, embed_VxD, preferred_element_type=x_BxLxD.dtype))
        d_embed_VxD += jnp.einsum("bcv,bcd->vd", d_logits_BxCxV, x_BxCxD.astype(dtype),
                                  preferred_element_type=jnp.float32)
    return jnp.concatenate(d_x_chunks, axis=1), d_embed_VxD.astype(token_embed.dtype), None


chunked_tied_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)
