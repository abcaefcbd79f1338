"""Which attention implementation a run uses, and the Pallas flash-attention kernel for TPUs.

`model.attention`:
  xla          the einsum path in model.py: float32 scores [B, H, L, L] in memory, softmax, product.
  dot_product  jax.nn.dot_product_attention: cuDNN's flash attention on NVIDIA GPUs, XLA's einsum elsewhere.
  flash        JAX's Pallas TPU flash-attention kernel: the scores live in on-chip memory one block at
               a time and never reach HBM; blocks above the causal diagonal are skipped. TPUs only.
  auto         flash on a TPU (where the head width suits the kernel), dot_product elsewhere.
Decoding with the KV cache, and dropout while training, take the einsum path in every case.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from andrea_jax import sharding
from andrea_jax.config import ConfigError, flash_takes_head_dim

LANES = 128  # the kernel's blocks of keys are multiples of the vector registers' lanes
# Query and key block of the kernel. With heads of 64 a block's products are small, so large
# blocks amortise the fixed cost of each grid step; at context 1024 a block of 512 computes 3 of
# the 4 blocks (blocks of 128 would compute 36 of 64, at 16 times the steps); see bench/RESULTS.md.
BLOCK = 512


def head_dim(model_config: ml_collections.ConfigDict) -> int:
    return model_config.d_model // model_config.n_head


def resolve_name(name: str, width: int, device=None) -> str:
    """`model.attention` with "auto" replaced by the choice for `device` (default: the first)."""
    if name != "auto":
        return name
    platform = (device or jax.devices()[0]).platform
    return "flash" if platform == "tpu" and flash_takes_head_dim(width) else "dot_product"


def for_device(model_config: ml_collections.ConfigDict, device) -> str:
    """The implementation a run on `device` uses; ConfigError when the one named cannot run there."""
    name = resolve_name(model_config.attention, head_dim(model_config), device)
    if name == "flash" and device.platform != "tpu":
        raise ConfigError(f"model.attention='flash' is a TPU kernel and this run's devices are "
                          f"{device.platform}; use 'auto' (flash on TPUs) or 'dot_product'")
    return name


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _flash_one_shard(q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array,
                     block: int) -> jax.Array:
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash  # imported only where used

    _, length, _, width = q_BxLxHxK.shape
    # The kernel's blocks are multiples of 128 that divide the length. Padding at the end is exact
    # for causal attention: no real query sees a later key, and the padded rows are dropped.
    block = min(block, _round_up(length, LANES))
    padded = _round_up(length, block)

    def to_kernel(x_BxLxHxK):
        return jnp.pad(x_BxLxHxK, ((0, 0), (0, padded - length), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    blocks = tpu_flash.BlockSizes(
        block_q=block, block_k_major=block, block_k=block, block_b=1,
        block_q_major_dkv=block, block_k_major_dkv=block, block_q_dkv=block, block_k_dkv=block,
        block_q_dq=block, block_k_major_dq=block, block_k_dq=block)
    out_BxHxPxK = tpu_flash.flash_attention(to_kernel(q_BxLxHxK), to_kernel(k_BxLxHxK), to_kernel(v_BxLxHxK),
                                            causal=True, sm_scale=1 / math.sqrt(width), block_sizes=blocks)
    return out_BxHxPxK.transpose(0, 2, 1, 3)[:, :length]


def flash_attention(q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array,
                    block: int = BLOCK) -> jax.Array:
    """Causal softmax(q·kᵀ / √K)·v through the Pallas TPU kernel, in the inputs' dtype.

    Under a mesh each device runs the kernel on its own rows and heads (batch over the axes
    `act_batch` maps to, heads over those of `act_heads`): XLA cannot partition a kernel call
    and would otherwise gather every input whole onto every device. The sequence stays whole,
    as causal attention needs.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return _flash_one_shard(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, block)
    spec = sharding.fit_spec(nn.logical_to_mesh_axes(("act_batch", None, "act_heads", None)),
                             q_BxLxHxK.shape, mesh)
    one_shard = lambda q, k, v: _flash_one_shard(q, k, v, block)
    return jax.shard_map(one_shard, in_specs=(spec, spec, spec), out_specs=spec,
                         check_vma=False)(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)
