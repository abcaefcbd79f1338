"""Joining a multi-process run through JAX's own distributed runtime.

Explicit flags win; otherwise a cluster environment JAX knows how to read
(Cloud TPU pod slices, SLURM, Open MPI, Kubernetes) is detected; otherwise the
run is a single process and nothing is initialised.
"""

from __future__ import annotations

import os
import socket
import time

import jax

from andrea_jax import first_line
from andrea_jax.config import ConfigError


def cluster_detected(environ=os.environ) -> bool:
    """Whether the environment says this process is one of several (SLURM, Open MPI, a TPU pod slice, a coordinator)."""
    sizes = (environ.get("SLURM_NTASKS", ""), environ.get("OMPI_COMM_WORLD_SIZE", ""))
    return (any(size.isdigit() and int(size) > 1 for size in sizes)
            or len(environ.get("TPU_WORKER_HOSTNAMES", "").split(",")) > 1
            or any(environ.get(name) for name in ("MEGASCALE_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS")))


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout_s: int = 120) -> bool:
    """Initialises jax.distributed when asked or when a cluster is detected; True if it did.

    timeout_s bounds both the wait for the coordinator at start-up and how long
    the others go on after one process stops answering (its heartbeat), so a
    dead peer ends the run instead of hanging it.
    """
    if coordinator_address is not None or num_processes is not None or process_id is not None:
        if coordinator_address is None or num_processes is None or process_id is None:
            raise ConfigError("--coordinator_address, --num_processes and --process_id go together; give all three")
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ConfigError(f"--process_id={process_id} must be in [0, {num_processes}) for "
                              f"--num_processes={num_processes}")
        host, _, port = coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--coordinator_address={coordinator_address} is not host:port; e.g. 10.0.0.2:1234")
    elif not cluster_detected():
        return False
    # The training loop takes SIGTERM itself (runtime/stop.py). JAX's preemption service
    # would install its own handler first, which swallows a SIGTERM that comes before the loop
    # (data preparation, restore, compilation): the process ran on until the scheduler's SIGKILL.
    # Without it such a SIGTERM ends the process at once, as it does a single-process run.
    jax.config.update("jax_enable_preemption_service", False)
    keep_call_sites_out_of_programs()
    try:
        if coordinator_address is not None and process_id != 0:
            # The runtime aborts the whole process when the coordinator never answers;
            # waiting for its port first turns that into a clear error.
            _wait_for_coordinator(host, int(port), timeout_s)
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   initialization_timeout=timeout_s, heartbeat_timeout_seconds=timeout_s,
                                   shutdown_timeout_seconds=timeout_s)
    except Exception as error:  # the runtime's own message is many lines of RPC detail
        where = coordinator_address or "the cluster's coordinator"
        raise ConfigError(f"could not join the distributed run at {where} within {timeout_s}s ({first_line(error)}); "
                          f"check that process 0 runs and --coordinator_address/--num_processes/--process_id agree "
                          f"on every process") from error
    return True


def keep_call_sites_out_of_programs() -> None:
    """Leaves the Python call stack out of the programs compiled from here on, so that a collective called from
    different lines in different processes is one program in all of them. The stack is in each operation's
    metadata, which the executable's fingerprint (and so each launch's run id) covers; on jax 0.12.1 two
    processes whose run ids differ wait in the collective for ever (leader_first's leader and followers did).
    The operations' names stay and the compiled code is the same; a single process keeps its lines."""
    jax.config.update("jax_traceback_in_locations_limit", 0)
    # Without full tracebacks JAX writes the innermost user frame whatever the limit.
    jax.config.update("jax_include_full_tracebacks_in_locations", True)
    # A persistent cache's key leaves the metadata out: a program cached by code that still wrote lines would
    # otherwise be loaded in one process beside another's compiled anew.
    jax.config.update("jax_compilation_cache_include_metadata_in_key", True)


def _wait_for_coordinator(host: str, port: int, timeout_s: int) -> None:
    """Returns once the coordinator's port answers; its OSError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, timeout_s)):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)
