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
from andrea_jax.config import ConfigError

GIB = 2 ** 30
GPU_TARGETS_DIR = pathlib.Path(__file__).parent / "gpu_targets"

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
    return Target(name, devices, hbm_bytes, f"{generation} HBM a chip", len({d.process_index for d in devices}),
                  hbm_bytes_per_second, matrix_unit_width)


def gpu_names() -> list[str]:
    return sorted(path.stem for path in GPU_TARGETS_DIR.glob("*.txtpb"))


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
    bandwidth = float(re.search(r"memory_bandwidth:\s*(\d+)", text).group(1))
    fraction = gpu_memory_fraction()
    return Target(name, list(topology.devices), int(memory * fraction),
                  f"{fraction:.0%} of {memory / GIB:.1f} GiB, JAX's GPU memory pool", 1, bandwidth)


def named(name: str) -> Target:
    return gpu(name) if name in gpu_names() else tpu(name)

