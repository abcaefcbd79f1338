"""Train ANDREA: python train.py --config configs/tiny.py --workdir runs/tiny [--config.steps=100]

Running it again on the same workdir resumes from the newest checkpoint.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/tiny.py", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config name>)")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0, for multi-process runs")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes in a multi-process run")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in a multi-process run")
flags.mark_flags_as_required(["config"])


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # library INFO chatter hides the progress bar
    from andrea_jax import checkpoint, distributed, train_loop
    from andrea_jax.config import ConfigError
    from andrea_jax.data import DataError

    workdir = _WORKDIR.value or os.path.join("runs", os.path.splitext(os.path.basename(flags.FLAGS["config"].config_filename))[0])
    try:
        distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
        train_loop.train(_CONFIG.value, workdir)
    except (ConfigError, DataError, checkpoint.CheckpointError, train_loop.TrainingStopped) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
