"""Which attention implementation a run uses (`model.attention`), and the fused kernels for GPUs and TPUs.

  xla     the einsum path (ops/einsum_attention.py): float32 scores [B, H, L, L] in memory (on CPUs and GPUs
          in blocks of queries, so that the blocks above the causal diagonal are skipped; a GPU computing in
          float16 writes the products in float16 and recomputes them in the backward).
  cudnn   cuDNN's fused (flash) attention through `jax.nn.dot_product_attention`, the scores in on-chip
          memory; NVIDIA GPUs of compute capability 8.0 and up (A100, L4, H100, ...).
  splash  JAX's Pallas splash kernel for TPUs: the scores in on-chip memory one block at a time, blocks
          above the causal diagonal skipped, one fused backward, and softmax statistics kept at 8
          sublanes rather than broadcast to 128 lanes (JAX's older flash kernel moved more bytes for
          them than the rest of attention).
  auto    splash on a TPU where the head width suits it, cudnn on a GPU that has it for the run's dtype
          and head width, xla elsewhere (T4s, float32 compute, heads cuDNN cannot take).
Decoding with the KV cache, and dropout while training, take the einsum path in every case.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from andrea_jax import precision, sharding
from andrea_jax.config import ConfigError, splash_takes_head_dim

LANES = 128  # the TPU kernel's blocks are multiples of the vector registers' lanes
# Query and key block of the TPU kernel. With heads of 64 a block's products are small, so large
# blocks amortise the fixed cost of each grid step; at context 1024 a block of 512 computes 3 of
# the 4 blocks (blocks of 128 would compute 36 of 64, at 16 times the steps); see bench/RESULTS.md.
BLOCK = 512
# TPUs whose memory bandwidth is short of their matrix units: a v6e multiplies 918 TFLOP/s over 1.64 TB/s (a
# v5e 197 over 0.82). There the kernel's fused backward takes all keys as one block, so q's gradient is
# written once instead of once a key block and then summed, at the cost of computing the blocks above the
# causal diagonal in the backward (bench/RESULTS.md).
KEYS_WHOLE_IN_BACKWARD = ("TPU v6",)
# ... up to this many keys times the head's lane-padded width. The fused backward keeps its key block in on-chip
# memory (VMEM): the block's keys and values, their float32 gradient accumulators (each a head's lanes wide), and
# the query block's float32 products against every key, all growing with the block. A v6e gives a kernel 32 MiB of
# scoped VMEM; compiled for v6e-1 (libtpu 0.0.42), all keys fit up to 4096 of heads 128 lanes wide and 2048 of 256,
# and failed at 4608 keys (32.07 MiB), 8192 (32.5 MiB) and 4096 × 256 lanes (41.3 MiB). Longer: key blocks.
WHOLE_KEYS_LANES_AT_MOST = 4096 * LANES
MIN_CUDA_CAPABILITY_FOR_CUDNN = 8.0  # cuDNN's flash attention starts with Ampere
CUDNN_DTYPES = ("bfloat16", "float16")  # its fused attention has no float32 kernel
PLATFORM_OF = {"splash": "tpu", "cudnn": "gpu"}  # where each kernel runs


def cudnn_problem(device, width: int, dtype: str) -> str | None:
    """Why cuDNN's fused attention cannot run heads `width` wide in `dtype` on `device`; None when it can."""
    capability = getattr(device, "compute_capability", None)  # CUDA devices only, compile-only ones too
    if capability is None or float(capability) < MIN_CUDA_CAPABILITY_FOR_CUDNN:
        return f"needs compute capability {MIN_CUDA_CAPABILITY_FOR_CUDNN} or newer and this GPU has {capability}"
    if dtype not in CUDNN_DTYPES:
        return f"computes in bfloat16 or float16, not model.dtype={dtype!r}"
    # Hopper's kernels take wider heads, but JAX's wrapper asks the GPU it runs on, not the program's target: a
    # program for an H100 compiled on a host without a Hopper GPU is held to 128.
    local = getattr(jax.devices()[0], "compute_capability", None)
    held = float(capability) >= 9.0 and (local is None or float(local) < 9.0)
    widest = 256 if float(capability) >= 9.0 and not held else 128
    if width % 8 or width > widest:
        where = "when compiled without a Hopper GPU" if held else "on this GPU"
        return f"takes heads of a multiple of 8 up to {widest} wide {where}, not {width}"
    return None


def resolve_name(name: str, width: int, dtype: str, device=None) -> str:
    """`model.attention` with "auto" replaced by the choice for heads `width` wide computed in
    `dtype` (a resolved `model.dtype`) on `device` (default: the first)."""
    if name != "auto":
        return name
    device = device or jax.devices()[0]
    if device.platform == "tpu" and splash_takes_head_dim(width):
        return "splash"
    return "cudnn" if device.platform == "gpu" and cudnn_problem(device, width, dtype) is None else "xla"


def for_device(model_config: ml_collections.ConfigDict, device) -> str:
    """The implementation a run on `device` uses; ConfigError when the one named cannot run there."""
    width, dtype = model_config.d_model // model_config.n_head, precision.resolve_dtype_name(model_config.dtype, device)
    name = resolve_name(model_config.attention, width, dtype, device)
    platform = PLATFORM_OF.get(name)
    if platform is not None and device.platform != platform:
        raise ConfigError(f"model.attention={name!r} runs on {platform.upper()}s and this run's devices are "
                          f"{device.platform}; use 'auto' (the fastest kernel each chip has) or 'xla'")
    problem = cudnn_problem(device, width, dtype) if name == "cudnn" else None
    if problem:
        raise ConfigError(f"model.attention='cudnn' {problem}; use 'auto' or 'xla'")
    return name


def for_saved_run(model_config: ml_collections.ConfigDict, device) -> str:
    """The implementation a run recorded elsewhere uses on `device`: its own where it runs here, else
    this machine's choice (the kernel belongs to the training machine, not to the model)."""
    try:
        return for_device(model_config, device)
    except ConfigError:
        auto = ml_collections.ConfigDict({**model_config.to_dict(), "attention": "auto"})
        return for_device(auto, device)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _block_and_padded(length: int, block: int = BLOCK) -> tuple[int, int]:
    """The splash kernel's block at `length` and the length padded to it: blocks are multiples of 128 that
    divide the length."""
    block = min(block, _round_up(length, LANES))
    return block, _round_up(length, block)


def keys_whole_in_backward(device_kind: str, length: int, width: int, block: int = BLOCK) -> bool:
    """Whether splash's backward takes all keys as one block for sequences of `length` in heads `width` wide
    on a `device_kind` chip: on the chips of `KEYS_WHOLE_IN_BACKWARD`, where its VMEM allows
    (`WHOLE_KEYS_LANES_AT_MOST`)."""
    padded = _block_and_padded(length, block)[1]
    return (device_kind.startswith(KEYS_WHOLE_IN_BACKWARD)
            and padded * _round_up(width, LANES) <= WHOLE_KEYS_LANES_AT_MOST)


def products_computed(name: str, length: int, width: int, device_kind: str) -> float:
    """The share of attention's FLOPs in the model's formula (12·L·H·Q·T: the whole L × L square,
    forward and backward) that the TPU implementation `name` computes at `length` with heads `width`
    wide on a `device_kind` chip. The splash kernel's forward skips the blocks above the causal
    diagonal (n(n + 1)/2 of the padded square's n² blocks) in its 2 products; its fused backward
    recomputes q·kᵀ, 5 products for the formula's 4, and skips the same blocks unless it takes the
    keys whole. XLA's attention on a TPU computes the whole square."""
    if name != "splash":
        return 1.0
    forward, backward = kernel_shares(name, length, width, device_kind)
    return (2 * forward + 5 * backward) / 6


def kernel_shares(name: str, length: int, width: int, device_kind: str) -> tuple[float, float]:
    """The shares of the L × L square a fused attention kernel's forward and backward compute: half for
    cuDNN's causal kernel; the splash kernel's blocks on and below the diagonal, of its padded square."""
    if name != "splash":
        return 0.5, 0.5
    block, padded = _block_and_padded(length)
    blocks = padded // block
    forward = (padded / length) ** 2 * (blocks + 1) / (2 * blocks)
    backward = (padded / length) ** 2 if keys_whole_in_backward(device_kind, length, width) else forward
    return forward, backward


def _splash_one_shard(q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array,
                      block: int, keys_whole: bool) -> jax.Array:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    _, length, heads, _ = q_BxLxHxK.shape
    # Padding at the end is exact for causal attention: no real query sees a later key, and the padded
    # rows are dropped.
    block, padded = _block_and_padded(length, block)
    backward_key_block = padded if keys_whole else block
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=backward_key_block, block_kv_dkv_compute=backward_key_block,
                              use_fused_bwd_kernel=True)
    kernel = splash.make_splash_mha(masks.MultiHeadMask([masks.CausalMask((padded, padded))] * heads),
                                    block_sizes=sizes, head_shards=1, q_seq_shards=1)

    def to_kernel(x_BxLxHxK):
        return jnp.pad(x_BxLxHxK, ((0, 0), (0, padded - length), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    out_BxHxPxK = jax.vmap(kernel)(to_kernel(q_BxLxHxK), to_kernel(k_BxLxHxK), to_kernel(v_BxLxHxK))
    return out_BxHxPxK.transpose(0, 2, 1, 3)[:, :length]


def splash_attention(q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array,
                     block: int = BLOCK, keys_whole: bool | None = None) -> jax.Array:
    """Causal softmax(q·kᵀ)·v through the Pallas TPU splash kernel, in the inputs' dtype: the kernel takes no
    scale, so q comes scaled by 1/√K (the model folds it into q's projection). `keys_whole`: whether the
    backward takes all keys as one block; None chooses by the chip and shape (`keys_whole_in_backward`)."""
    if keys_whole is None:
        _, length, _, width = q_BxLxHxK.shape
        keys_whole = keys_whole_in_backward(sharding.program_device_kind(), length, width, block)
    return _per_shard(lambda q, k, v: _splash_one_shard(q, k, v, block, keys_whole), q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)


def cudnn_attention(q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array) -> jax.Array:
    """Causal softmax(q·kᵀ / √K)·v through cuDNN's fused attention, in the inputs' dtype."""
    kernel = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return _per_shard(kernel, q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)


def _per_shard(kernel, q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array) -> jax.Array:
    """`kernel` run by each device on its own rows and heads under a mesh (batch over the axes
    `act_batch` maps to, heads over those of `act_heads`): XLA cannot partition a kernel call
    and would otherwise gather every input whole onto every device. The sequence stays whole,
    as causal attention needs.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)
    spec = sharding.fit_spec(nn.logical_to_mesh_axes(("act_batch", None, "act_heads", None)),
                             q_BxLxHxK.shape, mesh)
    return jax.shard_map(kernel, in_specs=(spec, spec, spec), out_specs=spec,
                         check_vma=False)(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK)


# The einsum path, xla, is ops/einsum_attention.py. Splash takes q already scaled by 1/√K, cuDNN scales it itself.
FUSED = {"splash": splash_attention, "cudnn": cudnn_attention}
