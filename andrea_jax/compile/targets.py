"""Compile-only devices for named accelerators: XLA's TPU and GPU compilers run on any host.

A TPU slice is named as Cloud TPU names it (`v5e-1`, `v6e-8`, `v4-32`, `v5p-16`:
chips for v5e/v6e, TensorCores for v4/v5p); multi-host slices have four chips a
host, as the real ones do, so the mesh spans hosts as a pod run builds it. A GPU
is named by a target description kept in `gpu_targets/` (`t4`, `a100_40gb`...).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re
from andrea_jax import flops
from andrea_jax.config import ConfigError
from andrea_jax.runtime import cli

GIB = 2 ** 30
GPU_TARGETS_DIR = pathlib.Path(__file__).parent / "gpu_targets"


@dataclasses.dataclass(frozen=True)
class KernelRates:
    """What a chip achieves on each kind of kernel, for the one-kernel-at-a-time estimate (`kernel_time.py`)."""
    products: dict[str, float]  # FLOP/s of a large product, by its inputs: "16-bit" (bf16, f16) or "float32"
    attention: float | None  # FLOP/s of the fused attention kernel (cuDNN's, Pallas')
    memory_bytes_per_second: float  # what the memory-bound fusions achieve
    launch_seconds: float  # the device idle between two kernels
    cores: int  # streaming multiprocessors (a TPU: TensorCores), over which a product's tiles run in waves
    source: str
    calibrated: bool  # against a measured step on this chip


# Measured on one H200 (bench/RESULTS.md, 2026-12-04: `bench/gpu.sh` and `bench/trace_step.py`): an 8192³
# bfloat16 product's 790 TFLOP/s; cuDNN attention's 8.6 ms a step for 2.16 TFLOP; the Newton–Schulz products'
# TF32 rate that gives their 12.1 ms; the largest memory-bound fusions' 2.4-2.6 TB/s (54% of the 4.8 TB/s
# the data sheet gives); the device idle 2.4 ms a step between 1,059 kernels.
H200_MEASURED = dict(products={"16-bit": 790e12, "float32": 263e12}, attention=251e12,
                     memory_bytes_per_second=2.6e12, launch_seconds=2.3e-6)
# Each GPU's published dense peaks (16-bit tensor cores; float32 as TF32 where the chip has it, a T4's CUDA
# cores where not): the other GPUs are given the H200's measured share of each, not yet a measurement.
GPU_PEAKS = {"h200": (989e12, 494.7e12), "h100": (989e12, 494.7e12), "a100_40gb": (312e12, 156e12),
             "a100_80gb": (312e12, 156e12), "l4": (121e12, 60e12), "t4": (65e12, 8.1e12)}


def gpu_rates(name: str, bandwidth: float, cores: int) -> KernelRates | None:
    """The H200's measured rates, or another GPU's published peaks at the H200's measured shares of them."""
    measured = H200_MEASURED
    if name == "h200":
        return KernelRates(**measured, cores=cores, source="measured on an H200 (bench/RESULTS.md)",
                           calibrated=True)
    if name not in GPU_PEAKS:
        return None
    (half, single), (h200_16bit, h200_float32) = GPU_PEAKS[name], GPU_PEAKS["h200"]
    return KernelRates(
        products={"16-bit": half * measured["products"]["16-bit"] / h200_16bit,
                  "float32": single * measured["products"]["float32"] / h200_float32},
        attention=half * measured["attention"] / h200_16bit,
        memory_bytes_per_second=bandwidth * measured["memory_bytes_per_second"] / 4.8e12,
        launch_seconds=measured["launch_seconds"], cores=cores,
        source="published peaks and bandwidth at the H200's measured share of them", calibrated=False)

# libtpu's name for the generation, the HBM a chip lets a program use, Cloud TPU's published HBM
# bandwidth a chip, and the side of its matrix units (MXUs: 128 × 128 systolic arrays, v6e's 256 × 256).
# v4 and v5p chips are "megacore" (one device of two TensorCores, which their slice names count) in a
# 3-D torus; v5e and v6e chips have one core each, in a 2-D torus.
TPU_GENERATIONS = {
    "v5e": ("v5e", int(15.75 * GIB), 819e9, 128),
    "v6e": ("v6e", int(31.25 * GIB), 1640e9, 256),
    "v4": ("v4", 32 * GIB, 1228e9, 128),
    "v5p": ("v5", 95 * GIB, 2765e9, 128),
}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    devices: list  # compile-only devices of every host
    memory_limit: int  # bytes a program may use on one device
    memory_source: str
    num_hosts: int
    memory_bytes_per_second: float | None = None  # for the roofline
    matrix_unit_width: int | None = None  # a TPU MXU's side; None where products fill the units (GPUs)
    kernel_rates: KernelRates | None = None  # for the estimate; None where the chip has none

    def fill_of(self, width: int) -> float:
        """The share of a matrix unit a product fills when one of its sides is `width` (an attention head):
        that side takes whole units, the last one partly filled."""
        if not self.matrix_unit_width:
            return 1.0
        return width / (self.matrix_unit_width * math.ceil(width / self.matrix_unit_width))


def _torus(chips: int, dimensions: int) -> list[int]:
    """Chip grid of a slice: 2-D 1x1, 2x2, 2x4, 4x4...; 3-D 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4..."""
    shape = [1, 1] if dimensions == 2 else [2, 2, 1]
    while math.prod(shape) < chips:
        smallest = min(shape)
        shape[max(i for i, size in enumerate(shape) if size == smallest)] *= 2
    return shape


def tpu(name: str) -> Target:
    """Compile-only devices of a Cloud TPU slice such as `v5e-1` or `v4-32`."""
    from jax.experimental import topologies

    match = re.fullmatch(r"(v5e|v6e|v4|v5p)-(\d+)", name)
    if not match:
        raise ConfigError(f"--topology {name} is not a known accelerator; use a TPU slice such as v5e-1, v6e-8, "
                          f"v4-32 or v5p-16, or a GPU among {', '.join(gpu_names())}")
    generation, count = match.group(1), int(match.group(2))
    prefix, hbm_bytes, hbm_bytes_per_second, matrix_unit_width = TPU_GENERATIONS[generation]
    megacore = generation in ("v4", "v5p")
    chips = count // 2 if megacore else count
    if (megacore and count % 2) or chips < (4 if megacore else 1) or chips & (chips - 1):
        raise ConfigError(f"--topology {name}: slices of {generation} come in powers of two "
                          f"{'from 8 cores' if megacore else 'chips'}, e.g. {generation}-{8 if megacore else 4}")
    # libtpu lets one process at a time hold it (a lock file in /tmp), for the chips' sake; compiling
    # for chips that are not here takes none, so two checks (or a check beside tests) may run at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    cli.quiet_libtpu_without_a_tpu()  # for callers that do not start at cli.run: the tests, a notebook
    shape = _torus(chips, 3 if megacore else 2)
    single_host = chips <= (4 if megacore else 8)
    host_bounds = tuple(shape) + (1,) * (3 - len(shape)) if single_host else (2, 2, 1)
    try:
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name=f"{prefix}:{'x'.join(map(str, shape))}",
            chip_config_name="megacore" if megacore else "default", chips_per_host_bounds=host_bounds)
    except Exception as error:  # no libtpu: the runtime's message differs between versions
        import jax
        raise ConfigError(f"--topology {name} needs XLA's TPU compiler ({str(error).splitlines()[0][:120]}); "
                          f'pip install "jax[tpu]=={jax.__version__}"') from error
    devices = list(topology.devices)
    peak = flops.device_peak_flops(devices[0])
    # Published figures only: no TPU step has been measured. A TPU runs one fusion at a time with no launch
    # from the host between them; float32 products run as bfloat16 passes at JAX's default precision.
    rates = KernelRates(products={"16-bit": peak, "float32": peak}, attention=peak,
                        memory_bytes_per_second=hbm_bytes_per_second, launch_seconds=0.0, cores=1,
                        source="Cloud TPU's published peak and bandwidth", calibrated=False)
    return Target(name, devices, hbm_bytes, f"{generation} HBM a chip", len({d.process_index for d in devices}),
                  hbm_bytes_per_second, matrix_unit_width, rates)


def gpu_names() -> list[str]:
    return sorted(path.stem for path in GPU_TARGETS_DIR.glob("*.txtpb"))


def gpu_for(device_kind: str) -> str | None:
    """The gpu_targets/ name of a GPU as JAX names its kind ("NVIDIA H200" -> "h200"), or None."""
    for name in gpu_names():
        described = re.search(r'device_description_str:\s*"([^"]*)"', (GPU_TARGETS_DIR / f"{name}.txtpb").read_text())
        if described and described.group(1).lower() == device_kind.lower():
            return name
    return None


def gpu_memory_fraction() -> float:
    """The share of a GPU's memory JAX's allocator takes: 0.75 unless XLA_PYTHON_CLIENT_MEM_FRACTION says."""
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))


def gpu(name: str) -> Target:
    """A compile-only NVIDIA GPU from its description in gpu_targets/, with JAX's memory pool as the limit."""
    from jax.experimental import topologies

    text = (GPU_TARGETS_DIR / f"{name}.txtpb").read_text()
    memory = int(re.search(r"device_memory_size:\s*(\d+)", text).group(1))
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x1")
    except Exception as error:  # no CUDA plugin: the runtime says "Unknown backend" or fails to load it
        raise ConfigError(f"--topology {name} needs JAX's CUDA compiler plugin ({str(error).splitlines()[0]}); "
                          f"install it with `pip install -r requirements-gpu-compile.txt`") from error
    fraction = gpu_memory_fraction()
    return Target(name, list(topology.devices), int(memory * fraction),
                  f"{fraction:.0%} of {memory / GIB:.1f} GiB, JAX's GPU memory pool", 1,
                  float(re.search(r"memory_bandwidth:\s*(\d+)", text).group(1)), kernel_rates=gpu_kernel_rates(name))


def gpu_kernel_rates(name: str) -> KernelRates | None:
    text = (GPU_TARGETS_DIR / f"{name}.txtpb").read_text()
    return gpu_rates(name, float(re.search(r"memory_bandwidth:\s*(\d+)", text).group(1)),
                     int(re.search(r"core_count:\s*(\d+)", text).group(1)))


def named(name: str) -> Target:
    return gpu(name) if name in gpu_names() else tpu(name)

