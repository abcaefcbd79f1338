"""Train ANDREA: python train.py --config configs/tiny.py --workdir runs/tiny [--config.steps=100]

Running it again on the same workdir resumes from the newest checkpoint.
"""

import os
import signal


_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


def _stopped_while_starting(signum, frame):
    """Until the loop takes the signals (`runtime/stop.py`): nothing is written yet, so a stop ends at once."""
    os.write(2, f"error: stopped by {_NAMES[signum]} while starting: nothing was written; run the "
                f"same command to start again\n".encode())
    os._exit(2)


for _signal in (signal.SIGINT, signal.SIGTERM):  # before the imports, which take seconds
    if signal.getsignal(_signal) != signal.SIG_IGN:  # a background job's ignored SIGINT stays ignored
        signal.signal(_signal, _stopped_while_starting)

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from andrea_jax.runtime import cli  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/tiny.py", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config name>)")
flags.mark_flags_as_required(["config"])


def main(argv):
    del argv
    from andrea_jax import train_loop

    config_name = os.path.splitext(os.path.basename(flags.FLAGS["config"].config_filename))[0]
    cli.run(lambda: train_loop.train(_CONFIG.value, _WORKDIR.value or os.path.join("runs", config_name),
                                            exit_at_once=True))


if __name__ == "__main__":
    cli.run_app(main)
