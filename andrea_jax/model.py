"""ANDREA: a GPT-2-class pre-norm transformer in Flax linen.

x = token_embed(ids) + position_embed(positions)
per block:  x = x + Attention(LN_1(x));  x = x + MLP(LN_2(x))
logits = LN_f(x) · token_embed.T          (tied output)

Shape suffixes: B batch, L length (queries), S key/value length, D model width, H heads, K head
width, F MLP width, V vocabulary (padded), M micro-batches, N depths of the stream (n_layer + 1);
Lp1 = L + 1, Lm1 = L - 1 (in `k_BxSxHxK` the lowercase k is the keys).

Parameters are float32 and carry logical axis names (the config maps them onto the mesh); matmuls
run in the compute dtype (`precision.py`) and accumulate in float32; softmax and logits are float32.
The ops with written-out backwards, and which of them a platform's programs take, are in `ops/`.
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

from andrea_jax import attention, ops
from andrea_jax.config import padded_vocab_size
from andrea_jax.ops import einsum_attention, tied_loss
from andrea_jax.precision import compute_dtype

INIT_STD = 0.02  # GPT-2's normal init for weights and embeddings
ACTIVATIONS = {  # and swiglu, whose gate is a second projection (MLP)
    "gelu_tanh": lambda h: jax.nn.gelu(h, approximate=True),
    "gelu_exact": lambda h: jax.nn.gelu(h, approximate=False),
    "relu": jax.nn.relu,
}
SWIGLU_MULTIPLE = 64
# The collections a forward pass fills only when the caller makes them mutable.
DIAGNOSTICS = "diagnostics"
INTERMEDIATES = "intermediates"


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
        if cache_index is None and ops.for_program().gathered_positions:
            # Gathered for each row, like the tokens: the gradient is then a scatter-add of rows.
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


class ScannedBlock(nn.Module):
    """A block (`block_cls`: Block, or Block under nn.remat) with the (carry, out) signature nn.scan wants."""
    config: ml_collections.ConfigDict
    block_cls: type

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, deterministic: bool, cache_index: jax.Array | None = None):
        return self.block_cls(self.config, name="block")(x_BxLxD, deterministic, cache_index), None


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
        lower = ops.for_program()
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
        qkv = lower.qkv_projections(x_BxLxD, qkv_kernel, qkv_bias, self.dtype, biased)
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
            attend = lower.attention
            if dropping:  # on the probabilities
                drop = lambda probs: nn.Dropout(self.dropout)(probs, deterministic=False)
                attend = functools.partial(einsum_attention.dropout_attention, dropout=drop)
            query_block = lower.query_block if cache_index is None else None
            out_BxLxHxK = einsum_attention.in_query_blocks(attend, q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, causal_LxS,
                                                           self.dtype, query_block)

        if fused is None and lower.merged_heads_out and head_dim & (head_dim - 1):
            # Merged into [B, L, D] behind a barrier, which keeps the merge out of the product: its operand then
            # has one dimension D to tile (`ops.Lowering.merged_heads_out`).
            out_BxLxD = jax.lax.optimization_barrier(out_BxLxHxK.reshape(batch, length, d_model))
            out_BxLxD = lower.matmul(out_BxLxD, out_kernel.reshape(d_model, d_model), "blc,cd->bld", self.dtype,
                                     self.dtype)
        else:
            out_BxLxD = lower.matmul(out_BxLxHxK, out_kernel, "blhk,hkd->bld", self.dtype, self.dtype)
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
        lower = ops.for_program()
        fc_kernel = _param(self, "fc_kernel", normal(INIT_STD), embed=d_model, mlp=self.mlp_dim)
        fc_bias = _param(self, "fc_bias", zeros, mlp=self.mlp_dim)
        proj_kernel = _param(self, "proj_kernel", normal(self.residual_std), mlp=self.mlp_dim, embed=d_model)
        proj_bias = _param(self, "proj_bias", zeros, embed=d_model)

        # Pre-activations are rounded to the compute dtype and the activation, computed in float32,
        # is recomputed in the backward (`activate`): autodiff would keep the float32 pre-activation,
        # the widest activation of the block, for the backward. The bias goes into the product
        # (`ops.matmul`), where a GPU adds it in the product's epilogue instead of a pass of its own.
        up_BxLxF = lower.matmul(x_BxLxD, fc_kernel, "bld,df->blf", self.dtype, self.dtype, bias=fc_bias)
        if self.activation == "swiglu":
            # Created after the four above, so those draw the same initial values as without it.
            gate_kernel = _param(self, "gate_kernel", normal(INIT_STD), embed=d_model, mlp=self.mlp_dim)
            gate_bias = _param(self, "gate_bias", zeros, mlp=self.mlp_dim)
            gate_BxLxF = lower.matmul(x_BxLxD, gate_kernel, "bld,df->blf", self.dtype, self.dtype, bias=gate_bias)
            h_BxLxF = activate(lambda up, gate: jax.nn.silu(gate) * up, up_BxLxF, gate_BxLxF)
        else:
            h_BxLxF = activate(ACTIVATIONS[self.activation], up_BxLxF)
        h_BxLxF = nn.with_logical_constraint(h_BxLxF, ("act_batch", "act_len", "act_mlp"))
        out_BxLxD = lower.matmul(h_BxLxF, proj_kernel, "blf,fd->bld", self.dtype, self.dtype) + proj_bias
        out_BxLxD = nn.Dropout(self.dropout)(out_BxLxD, deterministic=deterministic)
        return nn.with_logical_constraint(out_BxLxD.astype(self.dtype), ("act_batch", "act_len", "act_embed"))


def activate(function, *inputs: jax.Array) -> jax.Array:
    """function(*inputs) computed in float32 and returned in the inputs' dtype, recomputed in the
    backward: the backward keeps only the inputs (autodiff would keep their float32 copies)."""
    as_float32 = lambda *xs: function(*(x.astype(jnp.float32) for x in xs)).astype(inputs[0].dtype)
    return jax.checkpoint(as_float32)(*inputs)


class LayerNorm(nn.Module):
    """gamma * (x - mean) / sqrt(var + eps) + beta, statistics in float32 (`ops.layer_norm`)."""
    epsilon: float
    dtype: Any

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        d_model = x_BxLxD.shape[-1]
        scale = _param(self, "scale", ones, norm=d_model)
        bias = _param(self, "bias", zeros, norm=d_model)
        return ops.for_program().layer_norm(x_BxLxD, scale, bias, self.epsilon, self.dtype)


def logits_of(x_BxLxD: jax.Array, token_embed: jax.Array, model_config: ml_collections.ConfigDict) -> jax.Array:
    """The whole [B, L, V] float32 logits after LN_f, laid out as the rules say."""
    logits_BxLxV = tied_logits(x_BxLxD, token_embed, model_config)
    return nn.with_logical_constraint(logits_BxLxV, ("act_batch", "act_len", "act_vocab"))


def next_token_losses(x_BxLxD: jax.Array, token_embed: jax.Array, targets_BxL: jax.Array,
                      model_config: ml_collections.ConfigDict) -> jax.Array:
    """Each position's cross-entropy [B, L] (float32) against its target, from the stream after LN_f.

    In chunks of positions with a written-out backward (`ops.tied_loss`) where the platform's ops say,
    else optax's loss over the whole logits, autodiffed.
    """
    m = model_config
    chunk_tokens = ops.for_program().loss_chunk_tokens
    if chunk_tokens is not None:
        chunk_len = max(1, chunk_tokens // x_BxLxD.shape[0])
        return tied_loss.chunked_tied_cross_entropy(x_BxLxD, token_embed, targets_BxL, m.vocab_size,
                                                    compute_dtype(m.dtype), chunk_len)
    return optax.softmax_cross_entropy_with_integer_labels(logits_of(x_BxLxD, token_embed, m), targets_BxL)


def tied_logits(x_BxLxD: jax.Array, token_embed: jax.Array, model_config: ml_collections.ConfigDict) -> jax.Array:
    """The output head after LN_f: x · token_embed.T in float32, padding columns masked out."""
    m = model_config
    logits_BxLxV = ops.for_program().matmul(x_BxLxD, token_embed, "bld,vd->blv", compute_dtype(m.dtype))
    return tied_loss.without_padding(logits_BxLxV, m.vocab_size)


def head(params: dict, model_config: ml_collections.ConfigDict, x_BxLxD: jax.Array) -> jax.Array:
    """LN_f and the tied output applied to any stream (the logit lens reads each depth with it)."""
    m = model_config
    normed_BxLxD = LayerNorm(m.layer_norm_epsilon, compute_dtype(m.dtype)).apply({"params": params["ln_f"]}, x_BxLxD)
    return tied_logits(normed_BxLxD, params["token_embed"], m)


def init_params(model_config: ml_collections.ConfigDict, rng: jax.Array) -> dict:
    """Boxed (logically partitioned) params, for a sequence of length 1."""
    dummy_ids = jnp.zeros((1, 1), jnp.int32)
    return Transformer(model_config).init(rng, dummy_ids)["params"]


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
