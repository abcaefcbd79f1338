"""ANDREA: a GPT-2-class pre-norm transformer in Flax linen.

x = token_embed(ids) + position_embed(positions)
per block:  x = x + Attention(LN_1(x));  x = x + MLP(LN_2(x))
logits = LN_f(x) · token_embed.T          (tied output)

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

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, deterministic: bool) -> jax.Array:
        _, length, d_model = x_BxLxD.shape
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

        if self.implementation == "dot_product" and (deterministic or self.dropout == 0.0):
            # Reaches cuDNN flash attention on GPU; plain XLA elsewhere.
            out_BxLxHxK = jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, is_causal=True)
        else:
            logits_BxHxLxL = jnp.einsum("bqhk,bshk->bhqs", q_BxLxHxK, k_BxLxHxK,
                                        preferred_element_type=jnp.float32) / math.sqrt(head_dim)
            causal_LxL = jnp.tril(jnp.ones((length, length), dtype=bool))
            logits_BxHxLxL = jnp.where(causal_LxL, logits_BxHxLxL, jnp.finfo(jnp.float32).min)
            probs_BxHxLxL = jax.nn.softmax(logits_BxHxLxL, axis=-1)
            probs_BxHxLxL = nn.Dropout(self.dropout)(probs_BxHxLxL, deterministic=deterministic)
            out_BxLxHxK = jnp.einsum("bhqs,bshk->bqhk", probs_BxHxLxL.astype(self.dtype), v_BxLxHxK,
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
    def __call__(self, x_BxLxD: jax.Array, deterministic: bool) -> jax.Array:
        m = self.config
        dtype = DTYPES[m.dtype]
        # GPT-2: residual projections shrink with depth so the stream's variance
        # does not grow with the number of blocks; each block starts near identity.
        residual_std = INIT_STD / math.sqrt(2 * m.n_layer)
        attn = Attention(m.n_head, dtype, m.dropout, residual_std, m.attention, name="attn")
        mlp = MLP(m.mlp_dim, dtype, m.dropout, residual_std, name="mlp")
        x_BxLxD = x_BxLxD + attn(LayerNorm(m.layer_norm_epsilon, dtype, name="ln_1")(x_BxLxD), deterministic)
        x_BxLxD = x_BxLxD + mlp(LayerNorm(m.layer_norm_epsilon, dtype, name="ln_2")(x_BxLxD), deterministic)
        return x_BxLxD


class ScannedBlock(nn.Module):
    """Block with the (carry, out) signature that nn.scan wants."""
    config: ml_collections.ConfigDict

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, deterministic: bool):
        block_cls = nn.remat(Block, static_argnums=(2,)) if self.config.remat else Block
        return block_cls(self.config, name="block")(x_BxLxD, deterministic), None


class Transformer(nn.Module):
    """The whole model: ids [B, L] -> float32 logits [B, L, padded vocab]."""
    config: ml_collections.ConfigDict  # the `model` section of a config

    @nn.compact
    def __call__(self, ids_BxL: jax.Array, deterministic: bool = True) -> jax.Array:
        m = self.config
        dtype = DTYPES[m.dtype]
        _, length = ids_BxL.shape
        vocab_rows = padded_vocab_size(m)
        token_embed = self.param("token_embed", _normal(INIT_STD, ("vocab", "embed")),
                                 (vocab_rows, m.d_model), jnp.float32)
        position_embed = self.param("position_embed", _normal(INIT_STD, ("position", "embed")),
                                    (m.max_len, m.d_model), jnp.float32)

        x_BxLxD = jnp.take(token_embed, ids_BxL, axis=0) + position_embed[:length]
        x_BxLxD = nn.Dropout(m.dropout)(x_BxLxD, deterministic=deterministic).astype(dtype)
        x_BxLxD = nn.with_logical_constraint(x_BxLxD, ("act_batch", "act_len", "act_embed"))

        if m.scan_layers:
            blocks = nn.scan(ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                             in_axes=(nn.broadcast,), length=m.n_layer,
                             metadata_params={nn.PARTITION_NAME: "layers"})
            x_BxLxD, _ = blocks(m, name="blocks")(x_BxLxD, deterministic)
        else:
            block_cls = nn.remat(Block, static_argnums=(2,)) if m.remat else Block
            for i in range(m.n_layer):
                x_BxLxD = block_cls(m, name=f"block_{i}")(x_BxLxD, deterministic)

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
