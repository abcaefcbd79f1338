"""ANDREA: a GPT-2-class pre-norm transformer in Flax linen.

x = token_embed(ids) + position_embed(positions)
per block:  x = x + Attention(LN_1(x));  x = x + MLP(LN_2(x))
logits = LN_f(x) · token_embed.T          (tied output)

Shape suffixes: B batch, L length (queries), S key/value length, D model width, H heads, K head
width, F MLP width, V vocabulary (padded), M micro-batches, N depths of the stream (n_layer + 1);
Lp1 = L + 1, Lm1 = L - 1 (in `k_BxSxHxK` the lowercase k is the keys).

Parameters are float32 and carry logical axis names (the config maps them onto the mesh); matmuls
run in the compute dtype (`precision.py`) and accumulate in float32; softmax and logits are float32.
With decode=True each attention layer keeps its keys and values in a "cache" [B, max_len, H, K],
beside one index of the tokens cached, which offsets the new tokens' positions.

Ablations (config switches; the defaults are the model above; initialisation is the same in each):
  norm_position="post":  x = LN_1(x + Attention(x));  x = LN_2(x + MLP(x)). LN_f stays, so that the
      parameter tree matches pre-norm's and the logit lens reads every variant through one head.
  residual=False:        a sub-layer's output replaces the stream instead of adding to it.
  activation:            gelu_tanh | gelu_exact | relu | swiglu ((silu(x·W_gate) ⊙ x·W_fc)·W_proj,
      at the width `mlp_hidden_dim` gives it, to hold about the two-matrix MLP's parameter count).
  mlp_ratio:             0 = the MLP width is mlp_dim; otherwise mlp_ratio × d_model.

A forward pass reports on itself only when the caller makes the collection mutable: "diagnostics"
gets per-block scalars (each sub-layer's output norm over the stream's, the stream's norm after the
block), "intermediates" the stream after the embedding and every block (for the logit lens);
with scan_layers both come stacked over depth like the params.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax.linen.initializers import normal, ones, zeros

from andrea_jax import attention, sharding
from andrea_jax.config import padded_vocab_size
from andrea_jax.precision import compute_dtype, matmul

INIT_STD = 0.02  # GPT-2's normal init for weights and embeddings
# On CPUs and GPUs the einsum attention runs in blocks of this many queries (Attention). A GPU
# program recomputes its probabilities in the backward, whose per-block key gradients are summed:
# larger blocks there sum fewer of them for a little more of the square (bench/RESULTS.md).
QUERY_BLOCKS = {"cpu": 128, "gpu": 256}
LOSS_CHUNK_TOKENS = 8192  # on GPUs and TPUs the tied head's loss runs over about this many tokens at a time
ACTIVATIONS = {  # and swiglu, whose gate is a second projection (MLP)
    "gelu_tanh": lambda h: jax.nn.gelu(h, approximate=True),
    "gelu_exact": lambda h: jax.nn.gelu(h, approximate=False),
    "relu": jax.nn.relu,
}
SWIGLU_MULTIPLE = 64
# The collections a forward pass fills only when the caller makes them mutable.
DIAGNOSTICS = "diagnostics"
INTERMEDIATES = "intermediates"


def mlp_hidden_dim(model_config: ml_collections.ConfigDict) -> int:
    """The MLP's hidden width: mlp_dim, or mlp_ratio × d_model; for swiglu 2/3 of that, to a multiple of 64.

    A two-matrix MLP of width F holds 2·d·F weights; SwiGLU has three matrices, so
    width 2F/3 keeps the count (4 × 768 → 2048 exactly; 4 × 128 → 341 → 320).
    """
    m = model_config
    ratio = float(m.mlp_ratio)
    width = int(round(ratio * m.d_model)) if ratio > 0 else int(m.mlp_dim)
    if m.activation == "swiglu":
        width = max(SWIGLU_MULTIPLE, int(round(2 * width / 3 / SWIGLU_MULTIPLE)) * SWIGLU_MULTIPLE)
    return width


def non_gpt2_features(model_config: ml_collections.ConfigDict) -> list[str]:
    """The ablation switches set away from what GPT-2's architecture can hold ([] = a GPT-2 model).

    Either GELU is GPT-2's: transformers' GPT-2 takes the exact one as activation_function="gelu"
    (nanoGPT's), the tanh one as "gelu_new" (OpenAI's).
    """
    m = model_config
    return [feature for away, feature in [
        (m.norm_position != "pre", f"model.norm_position={m.norm_position!r} (GPT-2 is 'pre')"),
        (not m.residual, "model.residual=False (GPT-2 has residual connections)"),
        (m.activation not in ("gelu_tanh", "gelu_exact"),
         f"model.activation={m.activation!r} (GPT-2 is 'gelu_tanh' or 'gelu_exact')")] if away]


def _stream_norm(x_BxLxD: jax.Array) -> jax.Array:
    """Root mean square over tokens of each token's L2 norm, in float32."""
    return jnp.sqrt(jnp.mean(jnp.sum(jnp.square(x_BxLxD.astype(jnp.float32)), axis=-1)))


def _report_stream(module: nn.Module, prefix: str, x_BxLxD: jax.Array) -> None:
    """The stream's norm into "diagnostics", the stream into "intermediates", each only if asked for."""
    if module.is_mutable_collection(DIAGNOSTICS):
        module.sow(DIAGNOSTICS, f"{prefix}stream_norm", _stream_norm(x_BxLxD))
    if module.is_mutable_collection(INTERMEDIATES):
        module.sow(INTERMEDIATES, f"{prefix}stream", x_BxLxD)


def _param(module: nn.Module, name: str, init, **axis_sizes: int) -> jax.Array:
    """A float32 parameter of shape axis_sizes.values(), its axes logically named by the keys."""
    partitioned = nn.with_logical_partitioning(init, tuple(axis_sizes))
    return module.param(name, partitioned, tuple(axis_sizes.values()), jnp.float32)


def activate(function, *inputs: jax.Array) -> jax.Array:
    """function(*inputs) computed in float32 and returned in the inputs' dtype, recomputed in the
    backward: the backward keeps only the inputs (autodiff would keep their float32 copies)."""
    as_float32 = lambda *xs: function(*(x.astype(jnp.float32) for x in xs)).astype(inputs[0].dtype)
    return jax.checkpoint(as_float32)(*inputs)


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


class LayerNorm(nn.Module):
    """gamma * (x - mean) / sqrt(var + eps) + beta, statistics in float32; on GPUs with the written-out
    backward (`fused_layer_norm`)."""
    epsilon: float
    dtype: Any

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        d_model = x_BxLxD.shape[-1]
        scale = _param(self, "scale", ones, norm=d_model)
        bias = _param(self, "bias", zeros, norm=d_model)
        norm = fused_layer_norm if sharding.program_platform() == "gpu" else layer_norm
        return norm(x_BxLxD, scale, bias, self.epsilon, self.dtype)


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


def softmax_attention(q_BxLxHxK: jax.Array, k_BxSxHxK: jax.Array, v_BxSxHxK: jax.Array, causal_LxS: jax.Array,
                      dtype, dropout=None) -> jax.Array:
    """softmax(q·kᵀ/√K + mask)·v: scores and softmax in float32, products in `dtype`.

    `dropout` (applied to the probabilities) takes autodiff's backward; without it the
    backward is written out (`_attention_fwd`, `_attention_bwd`; GPU programs recompute the
    probabilities there instead of keeping them: `recomputing_attention`).
    """
    if dropout is None:
        written_out = recomputing_attention if sharding.program_platform() == "gpu" else _attention
        return written_out(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, dtype)
    probs_BxHxLxS = dropout(_attention_probs(q_BxLxHxK, k_BxSxHxK, causal_LxS))
    return jnp.einsum("bhqs,bshk->bqhk", probs_BxHxLxS.astype(dtype), v_BxSxHxK,
                      preferred_element_type=jnp.float32).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, dtype):
    return _attention_fwd(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, dtype)[0]


def _attention_fwd(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, dtype):
    probs_BxHxLxS = _attention_probs(q_BxLxHxK, k_BxSxHxK, causal_LxS)
    out_BxLxHxK = jnp.einsum("bhqs,bshk->bqhk", probs_BxHxLxS.astype(dtype), v_BxSxHxK,
                             preferred_element_type=jnp.float32).astype(dtype)
    return out_BxLxHxK, (q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, probs_BxHxLxS)


def _attention_bwd(dtype, residuals, d_out_BxLxHxK):
    """Autodiff's backward would multiply float32 cotangents by the bf16 operands, which XLA runs
    as float32 products (on a CPU at a fraction of the bf16 rate); here the cotangents are rounded
    to `dtype` first, as `precision.matmul` does for the weights; softmax's own backward stays in
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


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def recomputing_attention(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, dtype):
    """`_attention` keeping only each row's float32 log-sum-exp for the backward, which recomputes
    the probabilities from q and k (flash attention's algorithm, in XLA one query block at a time):
    the float32 [B, H, L, S] probabilities are neither kept nor read back, and softmax's backward
    takes its row sums from out · d_out ([B, L, H]) instead of a pass over [B, H, L, S]. GPU
    programs only (the T4's, where XLA runs attention): on a T4 the kept probabilities were most
    of a step's bytes; a CPU step, bound by its FLOPs, would pay for the second q·kᵀ.
    """
    return _recomputing_fwd(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, dtype)[0]


def _recomputing_fwd(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, dtype):
    logits_BxHxLxS = _attention_logits(q_BxLxHxK, k_BxSxHxK, causal_LxS, _scores_dtype(dtype))
    log_sum_BxHxLx1 = _log_sum_exp(logits_BxHxLxS)[0][..., None]
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def qkv_projections(x_BxLxD: jax.Array, kernel_Dx3xHxK: jax.Array, bias_3xHxK: jax.Array, dtype,
                    biased: tuple[bool, ...] = (True, True, True)) -> tuple:
    """(q, k, v) = x·kernel[:, i] + bias[i] in `dtype`, each its own product as `precision.matmul` takes it;
    the backward stacks their cotangents for one product into the kernel's gradient and one into x's,
    where three products each read x again and summed three partial gradients of x. GPU and TPU programs
    (XLA's TPU compiler takes the stack into the products' operands, its GPU compiler writes it once);
    CPU programs keep three `precision.matmul`s (bench/RESULTS.md). Only the outputs `biased` names get
    their bias (the others' bias gradients are zero)."""
    return _qkv_fwd(x_BxLxD, kernel_Dx3xHxK, bias_3xHxK, dtype, biased)[0]


def _qkv_fwd(x_BxLxD, kernel_Dx3xHxK, bias_3xHxK, dtype, biased):
    x = x_BxLxD.astype(dtype)
    products = [jnp.einsum("bld,dhk->blhk", x, kernel_Dx3xHxK[:, i].astype(dtype), preferred_element_type=dtype)
                for i in range(3)]
    qkv = tuple((p + bias_3xHxK[i]).astype(dtype) if biased[i] else p for i, p in enumerate(products))
    return qkv, (x_BxLxD, kernel_Dx3xHxK)


def _qkv_bwd(dtype, biased, residuals, d_qkv):
    x_BxLxD, kernel_Dx3xHxK = residuals
    g_BxLx3xHxK = jnp.stack([d.astype(dtype) for d in d_qkv], axis=2)
    d_kernel = jnp.einsum("bld,blchk->dchk", x_BxLxD.astype(dtype), g_BxLx3xHxK, preferred_element_type=jnp.float32)
    d_x = jnp.einsum("blchk,dchk->bld", g_BxLx3xHxK, kernel_Dx3xHxK.astype(dtype), preferred_element_type=x_BxLxD.dtype)
    if all(biased):
        return d_x, d_kernel, g_BxLx3xHxK.astype(jnp.float32).sum((0, 1))
    d_bias = [d.astype(jnp.float32).sum((0, 1)) if on else jnp.zeros(d.shape[2:], jnp.float32)
              for d, on in zip(d_qkv, biased)]
    return d_x, d_kernel, jnp.stack(d_bias)


qkv_projections.defvjp(_qkv_fwd, _qkv_bwd)


class Attention(nn.Module):
    """Causal multi-head self-attention; qkv kernel laid out as GPT-2's c_attn."""
    n_head: int
    dtype: Any
    dropout: float
    residual_std: float
    implementation: str  # a `model.attention` value (attention.py)
    max_len: int = 0  # KV-cache length, used only in decode mode

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, deterministic: bool,
                 cache_index: jax.Array | None = None) -> jax.Array:
        """cache_index given = decode mode: x holds the tokens at positions cache_index + [0, L)."""
        batch, length, d_model = x_BxLxD.shape
        head_dim = d_model // self.n_head
        # (D, 3, H, K) is GPT-2's (D, 3·D) c_attn weight reshaped: q|k|v, then heads.
        qkv_kernel = _param(self, "qkv_kernel", normal(INIT_STD), embed=d_model, qkv=3, heads=self.n_head,
                            head_dim=head_dim)
        qkv_bias = _param(self, "qkv_bias", zeros, qkv=3, heads=self.n_head, head_dim=head_dim)
        out_kernel = _param(self, "out_kernel", normal(self.residual_std), heads=self.n_head, head_dim=head_dim,
                            embed=d_model)
        out_bias = _param(self, "out_bias", zeros, embed=d_model)

        implementation = attention.resolve_name(self.implementation, head_dim, jnp.dtype(self.dtype).name)
        dropping = not deterministic and self.dropout != 0.0
        fused = implementation if cache_index is None and not dropping and implementation in attention.FUSED else None
        if fused == "splash":  # the kernel takes no scale: 1/√K goes into q's projection, its kernel and bias
            # (weight-sized work); applied to q after the product, it had XLA write q in float32, copy it and
            # read it back (bench/RESULTS.md)
            q_scale_3x1x1 = jnp.array([1 / math.sqrt(head_dim), 1.0, 1.0])[:, None, None]
            qkv_kernel, qkv_bias = qkv_kernel * q_scale_3x1x1, qkv_bias * q_scale_3x1x1
        if fused:  # k's and v's biases go unadded: softmax is invariant to k's (it adds q·b_k to every logit of
            # a row), and its rows sum to one, so v's passes through attention to the output, where it joins the
            # output's bias. XLA's GPU compiler added them in no product's epilogue, so each was a pass over
            # [B, L, H, K] of its own; on TPUs their gradients' sums read k's and v's cotangents (bench/RESULTS.md).
            biased = (True, False, False)
            out_bias = out_bias + jnp.einsum("hk,hkd->d", qkv_bias[2], out_kernel)
        else:
            biased = (True, True, True)
        if sharding.program_platform() != "cpu":
            qkv = qkv_projections(x_BxLxD, qkv_kernel, qkv_bias, self.dtype, biased)
        else:
            # Three products rather than one [B, L, 3, H, K] product and three slices: each of q, k
            # and v is written once, where attention reads it (the slices were copies, and their
            # cotangents were stacked back; bench/RESULTS.md).
            products = (matmul(x_BxLxD, qkv_kernel[:, i], "bld,dhk->blhk", self.dtype, self.dtype) for i in range(3))
            qkv = [(p + qkv_bias[i]).astype(self.dtype) if biased[i] else p for i, p in enumerate(products)]
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = (
            nn.with_logical_constraint(projection, ("act_batch", "act_len", "act_heads", None)) for projection in qkv)

        if cache_index is None:
            # S = L: the keys are this sequence's own.
            k_BxSxHxK, v_BxSxHxK = k_BxLxHxK, v_BxLxHxK
            causal_LxS = jnp.tril(jnp.ones((length, length), dtype=bool))
        else:
            # S = max_len: write the new keys/values at cache_index, attend over the whole
            # buffer; query i sits at position cache_index + i, so the mask hides both the
            # future and the slots not yet written. Callers keep cache_index + L <= max_len:
            # dynamic_update_slice would clamp the start rather than fail.
            cache_shape = (batch, self.max_len, self.n_head, head_dim)
            cached = [self.variable("cache", name, jnp.zeros, cache_shape, self.dtype) for name in ("key", "value")]
            for buffer, new_BxLxHxK in zip(cached, (k_BxLxHxK, v_BxLxHxK)):
                buffer.value = jax.lax.dynamic_update_slice(buffer.value, new_BxLxHxK, (0, cache_index, 0, 0))
            k_BxSxHxK, v_BxSxHxK = (buffer.value for buffer in cached)
            causal_LxS = jnp.arange(self.max_len)[None, :] <= cache_index + jnp.arange(length)[:, None]

        if fused:
            out_BxLxHxK = attention.FUSED[fused](q_BxLxHxK, k_BxSxHxK, v_BxSxHxK)
        else:
            drop = (lambda probs: nn.Dropout(self.dropout)(probs, deterministic=False)) if dropping else None
            query_block = QUERY_BLOCKS.get(sharding.program_platform(), length)
            if cache_index is None and length > query_block:
                # Query block i attends keys [0, end of block i) only: the blocks above the causal
                # diagonal are never computed (a quarter of the square at 2 blocks), and each row
                # still gets one exact softmax over all its keys. Measured on a CPU step and in a
                # T4's compiled step (bench/RESULTS.md); TPUs run the splash kernel instead.
                out_BxLxHxK = jnp.concatenate([
                    softmax_attention(q_BxLxHxK[:, start:stop], k_BxSxHxK[:, :stop], v_BxSxHxK[:, :stop],
                                      causal_LxS[start:stop, :stop], self.dtype, drop)
                    for start in range(0, length, query_block)
                    for stop in [min(start + query_block, length)]], axis=1)
            else:
                out_BxLxHxK = softmax_attention(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS, self.dtype, drop)

        if fused is None and sharding.program_platform() == "gpu" and head_dim & (head_dim - 1):
            # XLA's GPU compiler fuses the einsum path's output, laid out [B, H, K, L], into the projection's
            # Triton GEMM through a transpose over H and K, and finds no tiles for heads that are not a power of
            # two wide (20, 48, 96, 160, 192 on an A100: "Couldn't find output tile sizes"). Merged into [B, L, D]
            # behind a barrier, which keeps the merge out of the GEMM, its operand has one dimension D to tile.
            out_BxLxD = jax.lax.optimization_barrier(out_BxLxHxK.reshape(batch, length, d_model))
            out_BxLxD = matmul(out_BxLxD, out_kernel.reshape(d_model, d_model), "blc,cd->bld", self.dtype, self.dtype)
        else:
            out_BxLxD = matmul(out_BxLxHxK, out_kernel, "blhk,hkd->bld", self.dtype, self.dtype)
        out_BxLxD = out_BxLxD + out_bias
        out_BxLxD = nn.Dropout(self.dropout)(out_BxLxD, deterministic=deterministic)
        return nn.with_logical_constraint(out_BxLxD.astype(self.dtype), ("act_batch", "act_len", "act_embed"))


class MLP(nn.Module):
    """Dense d→mlp_dim, tanh-GELU (or the ablation's activation), dense mlp_dim→d."""
    mlp_dim: int
    dtype: Any
    dropout: float
    residual_std: float
    activation: str = "gelu_tanh"

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, deterministic: bool) -> jax.Array:
        d_model = x_BxLxD.shape[-1]
        fc_kernel = _param(self, "fc_kernel", normal(INIT_STD), embed=d_model, mlp=self.mlp_dim)
        fc_bias = _param(self, "fc_bias", zeros, mlp=self.mlp_dim)
        proj_kernel = _param(self, "proj_kernel", normal(self.residual_std), mlp=self.mlp_dim, embed=d_model)
        proj_bias = _param(self, "proj_bias", zeros, embed=d_model)

        # Pre-activations are rounded to the compute dtype and the activation, computed in float32,
        # is recomputed in the backward (`activate`): autodiff would keep the float32 pre-activation,
        # the widest activation of the block, for the backward. The bias goes into the product
        # (`matmul`), where a GPU adds it in the product's epilogue instead of a pass of its own.
        up_BxLxF = matmul(x_BxLxD, fc_kernel, "bld,df->blf", self.dtype, self.dtype, bias=fc_bias)
        if self.activation == "swiglu":
            # Created after the four above, so those draw the same initial values as without it.
            gate_kernel = _param(self, "gate_kernel", normal(INIT_STD), embed=d_model, mlp=self.mlp_dim)
            gate_bias = _param(self, "gate_bias", zeros, mlp=self.mlp_dim)
            gate_BxLxF = matmul(x_BxLxD, gate_kernel, "bld,df->blf", self.dtype, self.dtype, bias=gate_bias)
            h_BxLxF = activate(lambda up, gate: jax.nn.silu(gate) * up, up_BxLxF, gate_BxLxF)
        else:
            h_BxLxF = activate(ACTIVATIONS[self.activation], up_BxLxF)
        h_BxLxF = nn.with_logical_constraint(h_BxLxF, ("act_batch", "act_len", "act_mlp"))
        out_BxLxD = matmul(h_BxLxF, proj_kernel, "blf,fd->bld", self.dtype, self.dtype) + proj_bias
        out_BxLxD = nn.Dropout(self.dropout)(out_BxLxD, deterministic=deterministic)
        return nn.with_logical_constraint(out_BxLxD.astype(self.dtype), ("act_batch", "act_len", "act_embed"))


class Block(nn.Module):
    """One pre-norm block: x + Attention(LN_1(x)), then x + MLP(LN_2(x)) (or an ablation's order)."""
    config: ml_collections.ConfigDict

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, deterministic: bool,
                 cache_index: jax.Array | None = None) -> jax.Array:
        m = self.config
        dtype = compute_dtype(m.dtype)
        # GPT-2: residual projections shrink with depth so the stream's variance
        # does not grow with the number of blocks; each block starts near identity.
        residual_std = INIT_STD / math.sqrt(2 * m.n_layer)
        attn = Attention(m.n_head, dtype, m.dropout, residual_std, m.attention, m.max_len, name="attn")
        mlp = MLP(mlp_hidden_dim(m), dtype, m.dropout, residual_std, m.activation, name="mlp")
        ln_1 = LayerNorm(m.layer_norm_epsilon, dtype, name="ln_1")
        ln_2 = LayerNorm(m.layer_norm_epsilon, dtype, name="ln_2")
        x_BxLxD = self._sublayer("attn", x_BxLxD, ln_1, lambda h: attn(h, deterministic, cache_index))
        x_BxLxD = self._sublayer("mlp", x_BxLxD, ln_2, lambda h: mlp(h, deterministic))
        _report_stream(self, "", x_BxLxD)
        return x_BxLxD

    def _sublayer(self, name: str, x_BxLxD: jax.Array, norm: nn.Module, sublayer) -> jax.Array:
        """pre: x + f(LN(x));  post: LN(x + f(x));  without the residual the `x +` goes."""
        pre, residual = self.config.norm_position == "pre", self.config.residual
        delta_BxLxD = sublayer(norm(x_BxLxD) if pre else x_BxLxD)
        if self.is_mutable_collection(DIAGNOSTICS):
            # How much this sub-layer writes, relative to the stream it reads.
            self.sow(DIAGNOSTICS, f"{name}_delta_ratio", _stream_norm(delta_BxLxD) / _stream_norm(x_BxLxD))
        out_BxLxD = x_BxLxD + delta_BxLxD if residual else delta_BxLxD
        return out_BxLxD if pre else norm(out_BxLxD)


class ScannedBlock(nn.Module):
    """A block (`block_cls`: Block, or Block under nn.remat) with the (carry, out) signature nn.scan wants."""
    config: ml_collections.ConfigDict
    block_cls: type

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, deterministic: bool, cache_index: jax.Array | None = None):
        return self.block_cls(self.config, name="block")(x_BxLxD, deterministic, cache_index), None


class Transformer(nn.Module):
    """The whole model: ids [B, L] -> float32 logits [B, L, padded vocab]."""
    config: ml_collections.ConfigDict  # the `model` section of a config

    @nn.compact
    def __call__(self, ids_BxL: jax.Array, deterministic: bool = True, decode: bool = False,
                 targets_BxL: jax.Array | None = None) -> jax.Array:
        """The logits; with `targets_BxL`, each position's loss against its target instead (`next_token_losses`)."""
        m = self.config
        dtype = compute_dtype(m.dtype)
        _, length = ids_BxL.shape
        token_embed = _param(self, "token_embed", normal(INIT_STD), vocab=padded_vocab_size(m), embed=m.d_model)
        position_embed = _param(self, "position_embed", normal(INIT_STD), position=m.max_len, embed=m.d_model)

        if decode:
            # Needs mutable=["cache"]; the new tokens follow those already cached.
            index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
            cache_index = index.value
            index.value = cache_index + length
            positions_LxD = jax.lax.dynamic_slice_in_dim(position_embed, cache_index, length)
        else:
            cache_index, positions_LxD = None, position_embed[:length]

        positions = positions_LxD  # broadcast over the batch
        if cache_index is None and sharding.program_platform() == "gpu":
            # Gathered for each row, like the tokens: the gradient is then a scatter-add of rows. As a
            # broadcast, its gradient's reduction over the batch had XLA's GPU compiler lay the whole
            # stream out batch-minor, transposed at every product (bench/RESULTS.md).
            positions = jnp.take(position_embed, jnp.broadcast_to(jnp.arange(length), ids_BxL.shape), axis=0)
        x_BxLxD = jnp.take(token_embed, ids_BxL, axis=0) + positions
        x_BxLxD = nn.Dropout(m.dropout)(x_BxLxD, deterministic=deterministic).astype(dtype)
        x_BxLxD = nn.with_logical_constraint(x_BxLxD, ("act_batch", "act_len", "act_embed"))
        _report_stream(self, "embed_", x_BxLxD)

        block_cls = nn.remat(Block, static_argnums=(2,)) if m.remat else Block
        if m.scan_layers:
            blocks = nn.scan(ScannedBlock,
                             variable_axes={"params": 0, "cache": 0, DIAGNOSTICS: 0, INTERMEDIATES: 0},
                             split_rngs={"params": True, "dropout": True},
                             in_axes=(nn.broadcast, nn.broadcast), length=m.n_layer,
                             metadata_params={nn.PARTITION_NAME: "layers"})
            x_BxLxD, _ = blocks(m, block_cls, name="blocks")(x_BxLxD, deterministic, cache_index)
        else:
            for i in range(m.n_layer):
                x_BxLxD = block_cls(m, name=f"block_{i}")(x_BxLxD, deterministic, cache_index)

        x_BxLxD = LayerNorm(m.layer_norm_epsilon, dtype, name="ln_f")(x_BxLxD)
        if targets_BxL is not None:
            return next_token_losses(x_BxLxD, token_embed, targets_BxL, m)
        return logits_of(x_BxLxD, token_embed, m)


def logits_of(x_BxLxD: jax.Array, token_embed: jax.Array, model_config: ml_collections.ConfigDict) -> jax.Array:
    """The whole [B, L, V] float32 logits after LN_f, laid out as the rules say."""
    logits_BxLxV = tied_logits(x_BxLxD, token_embed, model_config)
    return nn.with_logical_constraint(logits_BxLxV, ("act_batch", "act_len", "act_vocab"))


def next_token_losses(x_BxLxD: jax.Array, token_embed: jax.Array, targets_BxL: jax.Array,
                      model_config: ml_collections.ConfigDict) -> jax.Array:
    """Each position's cross-entropy [B, L] (float32) against its target, from the stream after LN_f.

    GPU and TPU programs take the head in chunks with a written-out backward (`chunked_tied_cross_entropy`);
    CPU programs autodiff optax's loss over the whole logits.
    """
    m = model_config
    if sharding.program_platform() != "cpu":
        chunk_len = max(1, LOSS_CHUNK_TOKENS // x_BxLxD.shape[0])
        return chunked_tied_cross_entropy(x_BxLxD, token_embed, targets_BxL, m.vocab_size, compute_dtype(m.dtype),
                                          chunk_len)
    return optax.softmax_cross_entropy_with_integer_labels(logits_of(x_BxLxD, token_embed, m), targets_BxL)


def tied_logits(x_BxLxD: jax.Array, token_embed: jax.Array, model_config: ml_collections.ConfigDict) -> jax.Array:
    """The output head after LN_f: x · token_embed.T in float32, padding columns masked out."""
    m = model_config
    logits_BxLxV = matmul(x_BxLxD, token_embed, "bld,vd->blv", compute_dtype(m.dtype))
    return _without_padding(logits_BxLxV, m.vocab_size)


def _without_padding(logits_BxLxV: jax.Array, vocab_size: int) -> jax.Array:
    """Padding rows exist only for matmul shapes: they can never be predicted."""
    if logits_BxLxV.shape[-1] == vocab_size:
        return logits_BxLxV
    real_V = jnp.arange(logits_BxLxV.shape[-1]) < vocab_size
    return jnp.where(real_V, logits_BxLxV, jnp.finfo(jnp.float32).min)


def _chunk_logits(x_BxCxD: jax.Array, token_embed: jax.Array, vocab_size: int, dtype) -> jax.Array:
    """`tied_logits` of a chunk of positions, forward only (inside `chunked_tied_cross_entropy`)."""
    logits_BxCxV = jnp.einsum("bcd,vd->bcv", x_BxCxD.astype(dtype), token_embed.astype(dtype),
                              preferred_element_type=jnp.float32)
    return _without_padding(logits_BxCxV, vocab_size)


def _position_chunks(length: int, chunk_len: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk_len, length)) for start in range(0, length, chunk_len)]


def _log_sum_exp(logits_BxCxV: jax.Array, *summed_BxCxV: jax.Array) -> tuple[jax.Array, ...]:
    """Each row's log-sum-exp over the last axis, then each of `summed_BxCxV`'s row sums, in one pass.

    The running (maximum, sum of exponentials below it) pair is one reduction, so the logits are
    read once, not once for the maximum and again for the sum as in optax's loss or
    `jax.nn.logsumexp`; the sums ride in the same reduction.
    """
    def combine(left, right):
        (max_a, sum_a, *more_a), (max_b, sum_b, *more_b) = left, right
        top = jnp.maximum(max_a, max_b)
        return (top, sum_a * jnp.exp(max_a - top) + sum_b * jnp.exp(max_b - top),
                *(a + b for a, b in zip(more_a, more_b)))

    # float32's minimum rather than -inf as the start: two starts combine to exp(0) × 0, not NaN.
    starts = (jnp.float32(jnp.finfo(jnp.float32).min), jnp.float32(0)) + (jnp.float32(0),) * len(summed_BxCxV)
    top_BxC, sum_BxC, *sums_BxC = jax.lax.reduce((logits_BxCxV, jnp.ones_like(logits_BxCxV), *summed_BxCxV),
                                                 starts, combine, (logits_BxCxV.ndim - 1,))
    return (top_BxC + jnp.log(sum_BxC), *sums_BxC)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def chunked_tied_cross_entropy(x_BxLxD: jax.Array, token_embed: jax.Array, targets_BxL: jax.Array,
                               vocab_size: int, dtype, chunk_len: int) -> jax.Array:
    """optax's integer-label cross-entropy of `tied_logits`, [B, L] float32, `chunk_len` positions at a
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
        log_normalizer_BxC, target_BxC = _log_sum_exp(logits_BxCxV, jnp.where(is_target_BxCxV, logits_BxCxV, 0.0))
        losses.append(log_normalizer_BxC - target_BxC)
        log_normalizers.append(log_normalizer_BxC)
    log_normalizer_BxL = jnp.concatenate(log_normalizers, axis=1)
    return jnp.concatenate(losses, axis=1), (x_BxLxD, token_embed, targets_BxL, log_normalizer_BxL)


def _cross_entropy_bwd(vocab_size, dtype, chunk_len, residuals, d_losses_BxL):
    """d logits = (softmax - one-hot(target)) × d loss, rounded to `dtype` as `precision.matmul`'s
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


def head(params: dict, model_config: ml_collections.ConfigDict, x_BxLxD: jax.Array) -> jax.Array:
    """LN_f and the tied output applied to any stream (the logit lens reads each depth with it)."""
    m = model_config
    normed_BxLxD = LayerNorm(m.layer_norm_epsilon, compute_dtype(m.dtype)).apply({"params": params["ln_f"]}, x_BxLxD)
    return tied_logits(normed_BxLxD, params["token_embed"], m)


def init_params(model_config: ml_collections.ConfigDict, rng: jax.Array) -> dict:
    """Boxed (logically partitioned) params, for a sequence of length 1."""
    dummy_ids = jnp.zeros((1, 1), jnp.int32)
    return Transformer(model_config).init(rng, dummy_ids)["params"]
