"""Mixed precision: which compute dtype a machine runs fastest, and a matmul that stays in it.

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

from andrea_jax import sharding

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


def _product(spec: str, a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    """einsum accumulated in float32, its result in `out_dtype`.

    On a CPU the result is float32 and then rounded: XLA:CPU's fast bfloat16 products have
    float32 results (bench/RESULTS.md). A GPU or TPU rounds in the product's own epilogue,
    which saves writing and reading back a float32 copy of every activation.
    """
    if out_dtype == jnp.float32 or sharding.program_platform() == "cpu":
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out_dtype)
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)


def matmul(x: jax.Array, kernel: jax.Array, spec: str, dtype, out_dtype=jnp.float32,
           bias: jax.Array | None = None) -> jax.Array:
    """x·kernel (an einsum `spec`: activations times weights) rounded to `dtype`, accumulated in float32,
    plus `bias` (float32, over the output's last axes) if given, in `out_dtype`, with a written-out backward.

    Autodiff on bf16 operands would multiply the float32 cotangent by a bf16 operand, which XLA
    runs as a float32 matmul: two thirds of a step's FLOPs would miss the bf16 units. Here the
    cotangent is rounded to `dtype` first (as mixed-precision training does everywhere), and the
    float32 results come back in the operands' own dtypes, so a float32 weight gets its gradient
    unrounded. For float32 the rounding is a no-op; float16 cotangents are only safe because the
    train step scales the loss (`loss_scale.py`). Reverse mode only.

    On a CPU the cotangent also passes an optimization barrier: XLA:CPU otherwise fuses the
    elementwise work that produces it (softmax and LayerNorm backward, residual sums) into the
    transposes feeding both products and recomputes it in each (bench/RESULTS.md).
    Attention's batched products have their own backward (`model.softmax_attention`).

    On a GPU the bias is added to the float32 product inside it, and its gradient summed in its
    backward: XLA's GPU compiler then adds it in the product's epilogue, where added to the
    product's rounded result it took a pass of its own over the output (bench/RESULTS.md).
    Elsewhere it is added to the result.
    """
    operands = spec.split("->")[0].split(",")
    # The backward's specs swap the output with an operand: every index must be named once.
    if "." in spec or any(len(set(s)) != len(s) for s in operands):
        raise ValueError(f"einsum spec {spec!r}: no '...' and no index repeated within an operand")
    if bias is None:
        return _matmul(spec, x, kernel, dtype, out_dtype)
    if sharding.program_platform() == "gpu":
        return _matmul_plus_bias(spec, x, kernel, bias, dtype, out_dtype)
    return (_matmul(spec, x, kernel, dtype, out_dtype) + bias).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _matmul(spec: str, a: jax.Array, b: jax.Array, dtype, out_dtype) -> jax.Array:
    return _matmul_fwd(spec, a, b, dtype, out_dtype)[0]


def _matmul_fwd(spec, a, b, dtype, out_dtype):
    return _product(spec, a.astype(dtype), b.astype(dtype), out_dtype), (a, b)


def _matmul_bwd(spec, dtype, out_dtype, residuals, cotangent):
    a, b = residuals
    operands, out = spec.split("->")
    spec_a, spec_b = operands.split(",")
    g = cotangent.astype(dtype)
    if sharding.program_platform() == "cpu":  # measured there only; accelerators fuse differently
        g = jax.lax.optimization_barrier(g)
    a_, b_ = a.astype(dtype), b.astype(dtype)
    grad_a = _product(f"{out},{spec_b}->{spec_a}", g, b_, a.dtype)
    grad_b = _product(f"{spec_a},{out}->{spec_b}", a_, g, b.dtype)
    return grad_a, grad_b


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5))
def _matmul_plus_bias(spec: str, a: jax.Array, b: jax.Array, bias: jax.Array, dtype, out_dtype) -> jax.Array:
    return _matmul_plus_bias_fwd(spec, a, b, bias, dtype, out_dtype)[0]


def _matmul_plus_bias_fwd(spec, a, b, bias, dtype, out_dtype):
    product = _product(spec, a.astype(dtype), b.astype(dtype), jnp.float32)
    return (product + bias).astype(out_dtype), (a, b, bias)


def _matmul_plus_bias_bwd(spec, dtype, out_dtype, residuals, cotangent):
    a, b, bias = residuals
    grad_a, grad_b = _matmul_bwd(spec, dtype, out_dtype, (a, b), cotangent)
    rows = tuple(range(cotangent.ndim - bias.ndim))
    return grad_a, grad_b, cotangent.astype(jnp.float32).sum(rows).astype(bias.dtype)


_matmul_plus_bias.defvjp(_matmul_plus_bias_fwd, _matmul_plus_bias_bwd)
