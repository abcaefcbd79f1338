"""Mixed precision: which compute dtype a machine runs fastest, and a matmul that stays in it.

Parameters, optimizer state, LayerNorm statistics, softmax and logits are always
float32; `model.dtype` is the dtype the matmul operands are rounded to. "auto"
picks bfloat16 where the hardware multiplies it natively (GPUs, TPUs, CPUs with
AVX-512 BF16 or AMX) and float32 elsewhere, where bfloat16 would be emulated
and slower.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU advertises bfloat16 dot-product instructions (Linux /proc/cpuinfo flags)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:  # not Linux: no way to tell, so no claim
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def resolve_dtype_name(name: str, backend: str | None = None, cpuinfo: str | None = None) -> str:
    """`model.dtype` with "auto" replaced by this machine's fastest compute dtype."""
    if name != "auto":
        return name
    backend = backend or jax.default_backend()
    if backend != "cpu" or cpu_has_bf16(cpuinfo):
        return "bfloat16"
    return "float32"


def compute_dtype(name: str):
    """The jnp dtype of a `model.dtype` value ("auto" resolved)."""
    return DTYPES[resolve_dtype_name(name)]


def _einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum_f32_accumulate(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum of two operands of one dtype, accumulated in float32, with a written-out backward.

    Autodiff of `_einsum_f32` would multiply the float32 cotangent by a bf16
    operand, which XLA runs as a float32 matmul: two thirds of a training step's
    FLOPs would miss the bf16 units. Here the cotangent is rounded to the
    operands' dtype first (as mixed-precision training does on every framework),
    so the backward matmuls take the fast path too. For float32 operands the
    rounding is a no-op; float16 keeps a float32 backward.

    On a CPU the cotangent also passes an optimization barrier: XLA:CPU otherwise
    fuses the elementwise work that produces it (softmax and LayerNorm backward,
    residual sums) into the transposes that feed the two products, and recomputes
    it in each; materialising it once made the float32 step about 1.1x faster
    (see bench/RESULTS.md).
    `spec` is "a,b->out" where every index of a or b appears in one of the other two.
    """
    return _einsum_f32(spec, a, b)


def _einsum_f32_accumulate_fwd(spec, a, b):
    return _einsum_f32(spec, a, b), (a, b)


def _einsum_f32_accumulate_bwd(spec, residuals, cotangent):
    a, b = residuals
    operands, out = spec.split("->")
    spec_a, spec_b = operands.split(",")
    # float16's range is too narrow for unscaled gradients (there is no loss scaling
    # here): its backward products stay in float32.
    backward_dtype = jnp.float32 if a.dtype == jnp.float16 else a.dtype
    g = cotangent.astype(backward_dtype)
    if jax.default_backend() == "cpu":  # measured there only; accelerators fuse differently
        g = jax.lax.optimization_barrier(g)
    a_, b_ = a.astype(backward_dtype), b.astype(backward_dtype)
    grad_a = _einsum_f32(f"{out},{spec_b}->{spec_a}", g, b_).astype(a.dtype)
    grad_b = _einsum_f32(f"{spec_a},{out}->{spec_b}", a_, g).astype(b.dtype)
    return grad_a, grad_b


einsum_f32_accumulate.defvjp(_einsum_f32_accumulate_fwd, _einsum_f32_accumulate_bwd)


def matmul(x: jax.Array, kernel: jax.Array, spec: str, dtype) -> jax.Array:
    """x·kernel (an einsum `spec`) in `dtype` with float32 accumulation, forward and backward.

    For activations times weights. (Not for attention's batched products: XLA:CPU
    has no kernel for some of their bf16 backward layouts; they keep autodiff's.)
    """
    return einsum_f32_accumulate(spec, x.astype(dtype), kernel.astype(dtype))
