"""The train and eval steps compiled for the mesh, with as many micro-batches as the memory needs.

Whether a step fits is read off XLA's own memory analysis of the compiled
program, never found by running into an out-of-memory error: the compiled step
is the one the loop then runs. `microbatches=0` asks for the fewest
micro-batches that fit the device's memory with headroom; when even one
sequence per device and micro-batch does not fit, blocks are rematerialised.
"""

from __future__ import annotations

import dataclasses
import re
from functools import partial
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from andrea_jax import checkpoint, optimizer, sharding, train_step
from andrea_jax.config import ConfigError

# Plan for at most this share of the device's memory: XLA's analysis leaves out
# the allocator's fragmentation and the runtime's own buffers.
HEADROOM = 0.9
GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes one device holds for a compiled program, from `compiled.memory_analysis()`."""
    arguments: int
    temporaries: int
    outputs: int
    aliased: int  # outputs written into donated arguments

    @property
    def peak(self) -> int:
        return self.arguments + self.temporaries + self.outputs - self.aliased

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> "Memory":
        analysis = compiled.memory_analysis()
        return cls(analysis.argument_size_in_bytes, analysis.temp_size_in_bytes,
                   analysis.output_size_in_bytes, analysis.alias_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class Steps:
    """The compiled steps and the config they were compiled for (microbatches and remat filled in)."""
    config: ml_collections.ConfigDict
    train: jax.stages.Compiled  # (state, batch [B, L+1]) -> (state, metrics); state donated
    eval: jax.stages.Compiled  # (params, batch [B, L+1]) -> mean loss
    train_memory: Memory
    eval_memory: Memory  # the optimizer state beside it included: it stays on the device

    @property
    def peak(self) -> int:
        return max(self.train_memory.peak, self.eval_memory.peak)


class OutOfMemory(Exception):
    """The step cannot fit: XLA refused to compile it (TPUs check at compile time), or it needs more than usable
    (`memory`: what it needs)."""

    def __init__(self, message: str, memory: Memory | None = None) -> None:
        super().__init__(message)
        self.memory = memory


def device_memory_limit() -> int | None:
    """Bytes a program may use on each device: the runtime's own limit, None on a CPU (no limit is planned for).

    With several processes, the smallest of their limits: every process must compile the same step.
    """
    device = jax.local_devices()[0]
    limit = None if device.platform == "cpu" else (device.memory_stats() or {}).get("bytes_limit")
    if jax.process_count() > 1:
        limit = int(np.min(multihost_utils.process_allgather(np.int64(limit or 0)))) or None
    return limit


def microbatch_choices(config: ml_collections.ConfigDict, mesh: Mesh) -> list[int]:
    """Micro-batch counts that pass `sharding.make_mesh`'s check: each part splits over the data-parallel devices."""
    data_parallel = mesh.shape["data"] * mesh.shape["fsdp"]
    return [m for m in range(1, config.batch_size + 1) if config.batch_size % (m * data_parallel) == 0]


def compiler_options(mesh: Mesh) -> dict[str, bool]:
    """XLA options for the steps. On GPUs, no excess precision: XLA's GPU compiler otherwise drops
    the program's roundings to the compute dtype and keeps float32 copies of activations between
    the forward and the backward (bytes measured through the compile check, bench/RESULTS.md)."""
    return {"xla_allow_excess_precision": False} if mesh.devices.flat[0].platform == "gpu" else {}


def refused_memory(message: str) -> Memory | None:
    """The temporaries a compile that ran out of memory says it needs (a TPU's compiler: "the total memory
    required for HLO temporaries (17.54G) exceeds ..."), its arguments unknown; None where it says nothing."""
    found = re.search(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)", message)
    if not found:
        return None
    return Memory(0, int(float(found.group(1)) * 1024 ** " KMGT".index(found.group(2) or " ")), 0, 0)


def on_chip_memory_refusal(message: str) -> str | None:
    """The one-line error for a compile a TPU kernel's on-chip memory (VMEM) refused ("CompileTimeScopedVmemOom":
    a Mosaic kernel's blocks need more than its scoped VMEM); None for any other error. Device memory (HBM) is not
    the cause, so no micro-batch count is the fix."""
    if "CompileTimeScopedVmemOom" not in message and "memory space vmem" not in message:
        return None
    kernel = re.search(r"allocating on stack for %([\w.-]+)", message)
    sizes = re.search(r"Scoped allocation with size (\S+) and limit (\S+?)\.? ", message)
    name = f"the TPU kernel {kernel.group(1)}" if kernel else "a TPU kernel"
    needed = f" ({sizes.group(1)} > {sizes.group(2)})" if sizes else ""
    return (f"{name} needs more on-chip memory (VMEM) than the compiler lets a kernel take{needed}, which is not "
            f"the device memory micro-batches save; lower seq_len, or set --config.model.attention=xla")


def compile_steps(config: ml_collections.ConfigDict, mesh: Mesh, abstract_state: Any,
                  state_shardings: Any, usable: int | None = None) -> Steps:
    """Lowers and compiles both steps as the loop calls them.

    OutOfMemory when XLA refuses, or when a step needs more than `usable` bytes a device (the eval
    step is not compiled when the train step alone does: it needs less, and a compile costs minutes);
    ConfigError when a TPU kernel's on-chip memory refuses it (`on_chip_memory_refusal`).
    Runs under the caller's `jax.set_mesh(mesh)` and logical axis rules.
    """
    tx, schedule = optimizer.make(config), optimizer.learning_rate_schedule(config)
    batch_sharding = sharding.batch_sharding(mesh)
    batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jax.numpy.int32, sharding=batch_sharding)

    def within_usable(memory: Memory, step: str) -> Memory:
        if usable is not None and memory.peak > usable:
            raise OutOfMemory(f"the {step} step needs {memory.peak / GIB:.2f} GiB a device > "
                              f"{usable / GIB:.2f} GiB usable", memory)
        return memory

    try:
        train = jax.jit(train_step.make_train_step(config, tx, schedule),
                        in_shardings=(state_shardings, batch_sharding),
                        out_shardings=(state_shardings, sharding.replicated(mesh)),
                        donate_argnums=0).lower(abstract_state, batch).compile(compiler_options(mesh))
        train_memory = within_usable(Memory.of(train), "train")
        evaluate = jax.jit(train_step.make_eval_step(config), in_shardings=(state_shardings["params"], batch_sharding),
                           out_shardings=sharding.replicated(mesh)).lower(abstract_state["params"], batch).compile(
                               compiler_options(mesh))
    except Exception as error:  # the runtime's error type differs between jax versions
        refusal = on_chip_memory_refusal(str(error))
        if refusal:
            raise ConfigError(refusal) from error
        if "RESOURCE_EXHAUSTED" in str(error):
            raise OutOfMemory(f"XLA refused it ({str(error).splitlines()[0]})", refused_memory(str(error))) from error
        raise
    # The optimizer state stays on the device beside the eval step's params: all of the train step's arguments.
    eval_memory = within_usable(dataclasses.replace(Memory.of(evaluate), arguments=train_memory.arguments), "eval")
    return Steps(config, train, evaluate, train_memory, eval_memory)


def fit(config: ml_collections.ConfigDict, mesh: Mesh, abstract_state: Any, state_shardings: Any,
        limit: int | None, report: Callable[[str], None] = print) -> Steps:
    """The compiled steps: with `config.microbatches`, or for 0 the fewest micro-batches that fit `limit`.

    `limit` is one device's memory in bytes (None: no limit, as on a CPU, where 0 means one
    micro-batch). A step that does not fit raises ConfigError naming the fix.
    """
    usable = None if limit is None else int(HEADROOM * limit)
    automatic = usable is not None and not config.microbatches
    candidates = ([(m, remat) for remat in sorted({config.model.remat, True}) for m in microbatch_choices(config, mesh)]
                  if automatic else [(max(1, config.microbatches), config.model.remat)])
    tried, too_large = [], {}  # remat -> (microbatches, memory) of the last try that needed more than usable
    for microbatches, remat in candidates:
        setting = f"microbatches={microbatches}" + (", remat" if remat else "")
        if remat in too_large:  # a count whose step cannot fit is not compiled (a compile costs minutes)
            counted, memory = too_large[remat]
            # The arguments stay; at best everything else shrinks with the micro-batch.
            at_least = memory.arguments + (memory.peak - memory.arguments) * counted // microbatches
            if at_least > usable:
                tried.append(f"{setting}: at least {at_least / GIB:.2f} GiB, scaled from microbatches={counted}")
                continue
        candidate = ml_collections.ConfigDict(config.to_dict())
        candidate.microbatches, candidate.model.remat = microbatches, remat
        try:
            steps = compile_steps(candidate, mesh, abstract_state, state_shardings, usable)
        except OutOfMemory as error:
            tried.append(f"{setting}: {error}")
            if error.memory is not None:
                too_large[remat] = (microbatches, error.memory)
            continue
        if automatic:
            report(f"fit: {'; '.join(tried + [f'{setting}: {steps.peak / GIB:.2f} GiB a device'])} (fits "
                   f"{limit / GIB:.2f} GiB with {1 - HEADROOM:.0%} headroom): using {setting}")
        return steps
    if not automatic:
        room = "" if limit is None else f", {HEADROOM:.0%} of {limit / GIB:.2f} GiB"
        raise ConfigError(f"the step does not fit the device memory ({tried[-1]}{room}); set a larger "
                          f"--config.microbatches (a run keeps the count it started with, for exact "
                          f"losses), or 0 in a new run to choose one automatically")
    raise ConfigError(
        f"the step does not fit {usable / GIB:.2f} GiB a device even with one sequence per device and "
        f"micro-batch and remat ({tried[-1]}); lower seq_len or the model size, or shard the parameters "
        f"over more devices (mesh.fsdp)")


def abstract_state(config: ml_collections.ConfigDict, mesh: Mesh, axis_rules: tuple,
                   rng: jax.Array) -> tuple[Any, Any]:
    """(ShapeDtypeStructs of the train state with their shardings, the shardings); nothing allocated.

    Runs under the caller's `jax.set_mesh(mesh)` and logical axis rules.
    """
    boxed = jax.eval_shape(partial(train_step.init_state, config=config, tx=optimizer.make(config)), rng)
    shardings = sharding.logical_shardings(boxed, mesh, axis_rules)
    return checkpoint.abstract_like(sharding.unbox(boxed), shardings), shardings
