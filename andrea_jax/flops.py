"""FLOPs per token and model FLOPs utilisation (MFU) against the device's peak."""

from __future__ import annotations

import jax
import ml_collections

from andrea_jax.config import padded_vocab_size
from andrea_jax.model import mlp_hidden_dim
from andrea_jax.precision import resolve_dtype_name

# Dense bf16 peak per JAX device (a TPU v2/v3 device is one core: half a chip).
# Substrings of `device.device_kind`, most specific first.
PEAK_BF16_FLOPS = [
    ("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("GH200", 989e12),
    ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12),
    ("A10G", 70e12), ("A10", 125e12), ("V100", 125e12), ("T4", 65e12), ("RTX 4090", 165e12),
    ("TPU v6", 918e12), ("TPU v5p", 459e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12),
    ("TPU v5", 459e12), ("TPU v4", 275e12), ("TPU v3", 61.5e12), ("TPU v2", 22.5e12),
]
# Dense float32 (not TF32) peak of the GPUs where float32 is what "auto" may run, or a user asks for.
PEAK_FLOAT32_FLOPS = [
    ("H200", 67e12), ("H100", 67e12), ("A100", 19.5e12), ("L40S", 91.6e12), ("L4", 30.3e12), ("V100", 15.7e12),
    ("T4", 8.1e12),
]


def non_embedding_params(model_config: ml_collections.ConfigDict) -> int:
    """N of the 6N rule: all parameters but the position table (a lookup does no FLOPs); the tied token
    table counts once, as the output matmul's weight."""
    m = model_config
    d, f = m.d_model, mlp_hidden_dim(m)
    mlp_in = 2 if m.activation == "swiglu" else 1  # SwiGLU has a gate beside the up projection
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + mlp_in * (d * f + f) + (f * d + d)
    return m.n_layer * block + 2 * d + padded_vocab_size(m) * d


def attention_flops_per_token(model_config: ml_collections.ConfigDict, seq_len: int) -> float:
    """The 12·L·H·Q·T of `flops_per_token`: attention's own products (q·kᵀ and p·v, forward and backward)."""
    m = model_config
    return 12 * m.n_layer * m.d_model * seq_len  # H·Q is d_model


def flops_per_token(model_config: ml_collections.ConfigDict, seq_len: int) -> float:
    """Training FLOPs per token, nanoGPT/PaLM convention: 6N + 12·L·H·Q·T (attention not halved)."""
    return 6 * non_embedding_params(model_config) + attention_flops_per_token(model_config, seq_len)


def newton_schulz_flops(model_config: ml_collections.ConfigDict, ns_steps: int) -> float:
    """FLOPs of one Muon update's orthogonalisations (`optimizer.MUON_MATRICES`) where one device holds whole
    matrices (a data-parallel mesh): each iteration on an m × n matrix (m ≤ n) forms X·Xᵀ (2m²n), its square
    (2m³) and the product back into X (2m²n); q, k, v and the output projection are D × D, the MLP's D × F."""
    m = model_config
    d, f = m.d_model, mlp_hidden_dim(m)

    def iteration(rows: int, cols: int) -> int:
        short, wide = min(rows, cols), max(rows, cols)
        return 4 * short * short * wide + 2 * short ** 3

    mlp_matrices = 3 if m.activation == "swiglu" else 2
    return m.n_layer * ns_steps * (4 * iteration(d, d) + mlp_matrices * iteration(d, f))


def device_peak_flops(device: jax.Device, dtype: str = "bfloat16") -> float | None:
    """The table's peak for this device computing in `dtype`, or None (CPUs, unknown accelerators).

    The bfloat16 figure stands for float16 too (a T4's is its float16 rate); float32 has
    its own, far lower, rates.
    """
    table = PEAK_FLOAT32_FLOPS if dtype == "float32" else PEAK_BF16_FLOPS
    return next((peak for name, peak in table if name.lower() in device.device_kind.lower()), None)


def peak_flops(config: ml_collections.ConfigDict) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where the figure comes from), or (None, why there is none).

    A CPU has no table entry: its peak depends on its vector units, clocks and what else runs
    on it, and a matmul rate measured at start-up on a busy machine read as a peak gives MFUs
    above 100%. There is no MFU then, unless config.peak_flops gives the figure.
    """
    if config.peak_flops > 0:
        return float(config.peak_flops), "config.peak_flops"
    device = jax.devices()[0]
    dtype = resolve_dtype_name(config.model.dtype)
    peak = device_peak_flops(device, dtype)
    if peak is not None:
        return peak, f"{device.device_kind} {dtype} peak"
    return None, (f"no known {dtype} peak for {device.device_kind!r}; "
                  f"--config.peak_flops=FLOP/s of one device gives one")
