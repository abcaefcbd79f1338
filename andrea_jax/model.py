"""ANDREA: a GPT-2-class pre-norm transformer in Flax linen.

x = token_embed(ids) + position_embed(positions)
per block:  x = x + Attention(LN_1(x));  x = x + MLP(LN_2(x))
logits = LN_f(x) · token_embed.T          (tied output)

With decode=True the model reads and extends a "cache" collection: each
attention layer's keys and values in a fixed [B, max_len, H, K] buffer, and one
index of the tokens already cached, which offsets the new tokens' positions.

Every parameter carries logical axis names; a rule table in the config maps
them onto the device mesh. Parameters are float32; matmuls run in the compute
dtype and accumulate in float32; softmax and logits are float32.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from andrea_jax.config import padded_vocab_size

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
INIT_STD = 0.02  # GPT-2's normal init for weights and embeddings


def _normal(std: float, axes: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.normal(stddev=std), axes)


def _zeros(axes: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def _ones(axes: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.ones_init(), axes)


def matmul(x: jax.Array, kernel: jax.Array, spec: str, dtype: Any) -> jax.Array:
    """einsum in `dtype` with float32 accumulation (bf16 CPUs and GPUs are fast at it)."""
    return jnp.einsum(spec, x.astype(dtype), kernel.astype(dtype),
                      preferred_element_type=jnp.float32)


class LayerNorm(nn.Module):
    """gamma * (x - mean) / sqrt(var + eps) + beta, statistics in float32."""
    epsilon: float
    dtype: Any

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        d_model = x_BxLxD.shape[-1]
        scale = self.param("scale", _ones(("norm",)), (d_model,), jnp.float32)
        bias = self.param("bias", _zeros(("norm",)), (d_model,), jnp.float32)
        x = x_BxLxD.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.epsilon) * scale + bias
        return y.astype(self.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention; qkv kernel laid out as GPT-2's c_attn."""
    n_head: int
    dtype: Any
    dropout: float
    residual_std: float
    implementation: str  # "xla" or "dot_product"
    max_len: int = 0  # KV-cache length, used only in decode mode

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, deterministic: bool,
                 cache_index: jax.Array | None = None) -> jax.Array:
        """cache_index given = decode mode: x holds the tokens at positions cache_index + [0, L)."""
        batch, length, d_model = x_BxLxD.shape
        head_dim = d_model // self.n_head
        # (D, 3, H, K) is GPT-2's (D, 3·D) c_attn weight reshaped: q|k|v, then heads.
        qkv_kernel = self.param("qkv_kernel", _normal(INIT_STD, ("embed", "qkv", "heads", "head_dim")),
                                (d_model, 3, self.n_head, head_dim), jnp.float32)
        qkv_bias = self.param("qkv_bias", _zeros(("qkv", "heads", "head_dim")),
                              (3, self.n_head, head_dim), jnp.float32)
        out_kernel = self.param("out_kernel", _normal(self.residual_std, ("heads", "head_dim", "embed")),
                                (self.n_head, head_dim, d_model), jnp.float32)
        out_bias = self.param("out_bias", _zeros(("embed",)), (d_model,), jnp.float32)

        qkv_BxLx3xHxK = matmul(x_BxLxD, qkv_kernel, "bld,dthk->blthk", self.dtype) + qkv_bias
        qkv_BxLx3xHxK = nn.with_logical_constraint(
            qkv_BxLx3xHxK.astype(self.dtype), ("act_batch", "act_len", None, "act_heads", None))
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = (qkv_BxLx3xHxK[:, :, i] for i in range(3))

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
            cached_key = self.variable("cache", "key", jnp.zeros, cache_shape, self.dtype)
            cached_value = self.variable("cache", "value", jnp.zeros, cache_shape, self.dtype)
            start = (0, cache_index, 0, 0)
            cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, k_BxLxHxK, start)
            cached_value.value = jax.lax.dynamic_update_slice(cached_value.value, v_BxLxHxK, start)
            k_BxSxHxK, v_BxSxHxK = cached_key.value, cached_value.value
            causal_LxS = jnp.arange(self.max_len)[None, :] <= cache_index + jnp.arange(length)[:, None]

        if self.implementation == "dot_product" and cache_index is None and (deterministic or self.dropout == 0.0):
            # Reaches cuDNN flash attention on GPU; plain XLA elsewhere.
            out_BxLxHxK = jax.nn.dot_product_attention(q_BxLxHxK, k_BxSxHxK, v_BxSxHxK, is_causal=True)
        else:
            logits_BxHxLxS = jnp.einsum("bqhk,bshk->bhqs", q_BxLxHxK, k_BxSxHxK,
                                        preferred_element_type=jnp.float32) / math.sqrt(head_dim)
            logits_BxHxLxS = jnp.where(causal_LxS, logits_BxHxLxS, jnp.finfo(jnp.float32).min)
            probs_BxHxLxS = jax.nn.softmax(logits_BxHxLxS, axis=-1)
            probs_BxHxLxS = nn.Dropout(self.dropout)(probs_BxHxLxS, deterministic=deterministic)
            out_BxLxHxK = jnp.einsum("bhqs,bshk->bqhk", probs_BxHxLxS.astype(self.dtype), v_BxSxHxK,
                                     preferred_element_type=jnp.float32).astype(self.dtype)

        out_BxLxD = matmul(out_BxLxHxK, out_kernel, "blhk,hkd->bld", self.dtype) + out_bias
        out_BxLxD = nn.Dropout(self.dropout)(out_BxLxD, deterministic=deterministic)
        return nn.with_logical_constraint(out_BxLxD.astype(self.dtype), ("act_batch", "act_len", "act_embed"))


class MLP(nn.Module):
    """Dense d→mlp_dim, tanh-GELU, dense mlp_dim→d."""
    mlp_dim: int
    dtype: Any
    dropout: float
    residual_std: float

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, deterministic: bool) -> jax.Array:
        d_model = x_BxLxD.shape[-1]
        fc_kernel = self.param("fc_kernel", _normal(INIT_STD, ("embed", "mlp")),
                               (d_model, self.mlp_dim), jnp.float32)
        fc_bias = self.param("fc_bias", _zeros(("mlp",)), (self.mlp_dim,), jnp.float32)
        proj_kernel = self.param("proj_kernel", _normal(self.residual_std, ("mlp", "embed")),
                                 (self.mlp_dim, d_model), jnp.float32)
        proj_bias = self.param("proj_bias", _zeros(("embed",)), (d_model,), jnp.float32)

        h_BxLxF = matmul(x_BxLxD, fc_kernel, "bld,df->blf", self.dtype) + fc_bias
        h_BxLxF = jax.nn.gelu(h_BxLxF, approximate=True).astype(self.dtype)
        h_BxLxF = nn.with_logical_constraint(h_BxLxF, ("act_batch", "act_len", "act_mlp"))
        out_BxLxD = matmul(h_BxLxF, proj_kernel, "blf,fd->bld", self.dtype) + proj_bias
        out_BxLxD = nn.Dropout(self.dropout)(out_BxLxD, deterministic=deterministic)
        return nn.with_logical_constraint(out_BxLxD.astype(self.dtype), ("act_batch", "act_len", "act_embed"))


class Block(nn.Module):
    """One pre-norm block: x + Attention(LN_1(x)), then x + MLP(LN_2(x))."""
    config: ml_collections.ConfigDict

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, deterministic: bool,
                 cache_index: jax.Array | None = None) -> jax.Array:
        m = self.config
        dtype = DTYPES[m.dtype]
        # GPT-2: residual projections shrink with depth so the stream's variance
        # does not grow with the number of blocks; each block starts near identity.
        residual_std = INIT_STD / math.sqrt(2 * m.n_layer)
        attn = Attention(m.n_head, dtype, m.dropout, residual_std, m.attention, m.max_len, name="attn")
        mlp = MLP(m.mlp_dim, dtype, m.dropout, residual_std, name="mlp")
        x_BxLxD = x_BxLxD + attn(LayerNorm(m.layer_norm_epsilon, dtype, name="ln_1")(x_BxLxD), deterministic,
                                 cache_index)
        x_BxLxD = x_BxLxD + mlp(LayerNorm(m.layer_norm_epsilon, dtype, name="ln_2")(x_BxLxD), deterministic)
        return x_BxLxD


class ScannedBlock(nn.Module):
    """Block with the (carry, out) signature that nn.scan wants."""
    config: ml_collections.ConfigDict

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, deterministic: bool, cache_index: jax.Array | None = None):
        block_cls = nn.remat(Block, static_argnums=(2,)) if self.config.remat else Block
        return block_cls(self.config, name="block")(x_BxLxD, deterministic, cache_index), None


class Transformer(nn.Module):
    """The whole model: ids [B, L] -> float32 logits [B, L, padded vocab]."""
    config: ml_collections.ConfigDict  # the `model` section of a config

    @nn.compact
    def __call__(self, ids_BxL: jax.Array, deterministic: bool = True, decode: bool = False) -> jax.Array:
        m = self.config
        dtype = DTYPES[m.dtype]
        _, length = ids_BxL.shape
        vocab_rows = padded_vocab_size(m)
        token_embed = self.param("token_embed", _normal(INIT_STD, ("vocab", "embed")),
                                 (vocab_rows, m.d_model), jnp.float32)
        position_embed = self.param("position_embed", _normal(INIT_STD, ("position", "embed")),
                                    (m.max_len, m.d_model), jnp.float32)

        if decode:
            # Needs mutable=["cache"]; the new tokens follow those already cached.
            index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
            cache_index = index.value
            index.value = cache_index + length
            positions_LxD = jax.lax.dynamic_slice_in_dim(position_embed, cache_index, length)
        else:
            cache_index, positions_LxD = None, position_embed[:length]

        x_BxLxD = jnp.take(token_embed, ids_BxL, axis=0) + positions_LxD
        x_BxLxD = nn.Dropout(m.dropout)(x_BxLxD, deterministic=deterministic).astype(dtype)
        x_BxLxD = nn.with_logical_constraint(x_BxLxD, ("act_batch", "act_len", "act_embed"))

        if m.scan_layers:
            blocks = nn.scan(ScannedBlock, variable_axes={"params": 0, "cache": 0},
                             split_rngs={"params": True, "dropout": True},
                             in_axes=(nn.broadcast, nn.broadcast), length=m.n_layer,
                             metadata_params={nn.PARTITION_NAME: "layers"})
            x_BxLxD, _ = blocks(m, name="blocks")(x_BxLxD, deterministic, cache_index)
        else:
            block_cls = nn.remat(Block, static_argnums=(2,)) if m.remat else Block
            for i in range(m.n_layer):
                x_BxLxD = block_cls(m, name=f"block_{i}")(x_BxLxD, deterministic, cache_index)

        x_BxLxD = LayerNorm(m.layer_norm_epsilon, dtype, name="ln_f")(x_BxLxD)
        logits_BxLxV = matmul(x_BxLxD, token_embed, "bld,vd->blv", dtype)
        if vocab_rows > m.vocab_size:
            # Padding rows exist only for matmul shapes: they can never be predicted.
            real_V = jnp.arange(vocab_rows) < m.vocab_size
            logits_BxLxV = jnp.where(real_V, logits_BxLxV, jnp.finfo(jnp.float32).min)
        return nn.with_logical_constraint(logits_BxLxV, ("act_batch", "act_len", "act_vocab"))


def build(model_config: ml_collections.ConfigDict) -> Transformer:
    return Transformer(model_config)


def init_params(model_config: ml_collections.ConfigDict, rng: jax.Array) -> dict:
    """Boxed (logically partitioned) params, for a sequence of length 1."""
    dummy_ids = jnp.zeros((1, 1), jnp.int32)
    return build(model_config).init(rng, dummy_ids)["params"]
