"""What train.py and eval.py share: the multi-process flags, quiet libraries, one-line errors."""

from __future__ import annotations

import sys
from typing import Callable

from absl import flags, logging

COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                  "host:port of process 0, for a multi-process run launched by hand")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes in a multi-process run")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0 .. num_processes-1")
DISTRIBUTED_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout", 120, "Seconds to wait for the coordinator at start, and for a silent process "
    "before the run stops")


def run(main: Callable[[], None]) -> None:
    """Joins the cluster if there is one, runs `main`, and turns user errors into one line and exit code 2."""
    from andrea_jax import checkpoint, distributed, host_memory, train_loop
    from andrea_jax.config import ConfigError
    from andrea_jax.data import DataError

    host_memory.keep_freed_memory()

    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # library INFO chatter hides the progress bar
    try:
        distributed.initialize(COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value, DISTRIBUTED_TIMEOUT.value)
        main()
    except (ConfigError, DataError, checkpoint.CheckpointError, train_loop.TrainingStopped) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
