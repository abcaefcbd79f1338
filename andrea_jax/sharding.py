"""The device mesh and the mapping from logical axis names to it.

The mesh has axes (data, fsdp, tensor); the config's rule table says which
logical axis (embed, vocab, heads, mlp, act_batch, ...) lands on which mesh axis.
A dimension that a mesh axis does not divide is replicated instead (vocab 8449
cannot be split in two), so every rule table works for every model size.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import ml_collections
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from andrea_jax.config import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch is split over both: fsdp is data parallel too


def mesh_shape(mesh_config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, int, int]:
    """Axis sizes with -1 filled in; a clear error when they cannot fit the devices."""
    sizes = [int(mesh_config[a]) for a in MESH_AXES]
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % fixed:
            raise ConfigError(
                f"mesh {dict(zip(MESH_AXES, sizes))} cannot fill {num_devices} devices: "
                f"the fixed axes multiply to {fixed}, which does not divide {num_devices}")
        sizes[sizes.index(-1)] = num_devices // fixed
    if math.prod(sizes) != num_devices:
        raise ConfigError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices but "
            f"{num_devices} are present; set one of --config.mesh.data/fsdp/tensor to -1")
    return tuple(sizes)


def program_platform() -> str:
    """The platform the program being traced is for: that of the mesh it runs under, else the default.

    Not `jax.default_backend()`: a host compiling for a TPU or GPU it does not have is a CPU
    backend, and a CPU-only choice keyed on it would leak into the accelerator's program.
    """
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def program_device_kind() -> str:
    """The kind of device ("TPU v6 lite", ...) the program being traced is for, found as `program_platform` finds
    its platform."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.device_kind if device is not None else jax.devices()[0].device_kind


def make_mesh(config: ml_collections.ConfigDict, devices: Sequence[Any] | None = None) -> Mesh:
    """The (data, fsdp, tensor) mesh over all devices of all processes."""
    devices = list(devices) if devices is not None else jax.devices()
    shape = mesh_shape(config.mesh, len(devices))
    # The one check of the batch split: the step cuts the batch into micro-batches (0 stands for 1
    # until `fit` picks a count that splits) and spreads each one's rows over the data-parallel devices.
    parts = max(1, config.microbatches) * shape[0] * shape[1]
    if config.batch_size % parts:
        raise ConfigError(
            f"batch_size={config.batch_size} does not split over microbatches × mesh.data × mesh.fsdp = "
            f"{max(1, config.microbatches)} × {shape[0]} × {shape[1]}; make it a multiple of {parts} or change those")
    # Auto axes: Flax's logical partitioning works with them, not with Explicit ones.
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=devices)


def rules(config: ml_collections.ConfigDict) -> tuple:
    return tuple((name, tuple(axes) if isinstance(axes, list) else axes)
                 for name, axes in config.logical_axis_rules)


def fit_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """Drop mesh axes from dimensions they do not divide (those are replicated)."""
    fitted = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        kept = []
        for name in names:
            if dim % (math.prod(mesh.shape[n] for n in kept) * mesh.shape[name]) == 0:
                kept.append(name)
        fitted.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return P(*fitted)


def unbox(boxed_tree: Any) -> Any:
    """Strip the axis-name boxes without adding sharding constraints.

    (nn.meta.unbox constrains under active rules, which fails outside jit and
    would bypass `fit_spec` inside it; out_shardings place the values instead.)
    """
    return jax.tree.map(lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x, boxed_tree,
                        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def logical_shardings(boxed_tree: Any, mesh: Mesh, axis_rules: tuple) -> Any:
    """NamedShardings for a tree of nn.Partitioned (or plain) shape structs."""
    # optax.partition leaves an empty MaskedNode where a group holds no state; in a box it still gets a spec
    boxed_tree = jax.tree.map(lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) and
                              isinstance(x.value, optax.MaskedNode) else x, boxed_tree,
                              is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
    mesh_specs = nn.logical_to_mesh(nn.get_partition_spec(boxed_tree), axis_rules)
    return jax.tree.map(lambda spec, leaf: NamedSharding(mesh, fit_spec(spec, leaf.shape, mesh)),
                        mesh_specs, unbox(boxed_tree), is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches [B, L]: rows over the data-parallel axes."""
    return NamedSharding(mesh, P(BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def describe(mesh: Mesh) -> str:
    return " × ".join(f"{name}={size}" for name, size in mesh.shape.items()) + \
        f" over {mesh.devices.size} {mesh.devices.flat[0].platform} device(s)"
