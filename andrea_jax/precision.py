"""Mixed precision: which compute dtype a machine runs fastest (the matmul that stays in it: `ops/matmul.py`).

Parameters, optimizer state, LayerNorm statistics, softmax and logits are always
float32; `model.dtype` is the dtype the matmul operands are rounded to. "auto"
picks bfloat16 where the hardware multiplies it natively (TPUs, NVIDIA GPUs from
compute capability 8.0 (A100, L4, H100, ...), CPUs with AVX-512 BF16 or AMX),
float16 with dynamic loss scaling on NVIDIA GPUs whose tensor cores have float16
only (compute capability 7.x: V100, T4), and float32 elsewhere (most laptops).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
MIN_CUDA_CAPABILITY_FOR_BF16 = 8.0  # Ampere: the first NVIDIA tensor cores with bf16
MIN_CUDA_CAPABILITY_FOR_FP16_TENSOR_CORES = 7.0  # Volta and Turing (V100, T4): float16 only


@functools.cache
def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:  # not Linux: no way to tell, so no claim
        return ""


def resolve_dtype_name(name: str, device=None, cpuinfo: str | None = None) -> str:
    """`model.dtype` with "auto" replaced by what `device` (default: the first) multiplies fastest:
    bfloat16, float16 (with loss scaling) or float32. `cpuinfo` stands in for /proc/cpuinfo."""
    if name != "auto":
        return name
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        cpuinfo = _read_cpuinfo() if cpuinfo is None else cpuinfo
        flags = [line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")]
        return "bfloat16" if any(flag in CPU_BF16_FLAGS for line in flags for flag in line) else "float32"
    capability = getattr(device, "compute_capability", None)  # CUDA devices only, compile-only ones too
    # No capability: TPUs, and GPUs that report none (ROCm's MI200+ have bf16).
    if capability is None or float(capability) >= MIN_CUDA_CAPABILITY_FOR_BF16:
        return "bfloat16"
    return "float16" if float(capability) >= MIN_CUDA_CAPABILITY_FOR_FP16_TENSOR_CORES else "float32"


def compute_dtype(name: str):
    """The jnp dtype of a `model.dtype` value ("auto" resolved)."""
    return DTYPES[resolve_dtype_name(name)]
