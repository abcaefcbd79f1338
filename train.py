"""Train ANDREA: python train.py --config configs/tiny.py --workdir runs/tiny [--config.steps=100]

Running it again on the same workdir resumes from the newest checkpoint.
"""

import os

from absl import flags
from ml_collections import config_flags

from andrea_jax.runtime import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/tiny.py", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config name>)")
flags.mark_flags_as_required(["config"])


def main(argv):
    del argv
    from andrea_jax import train_loop

    config_name = os.path.splitext(os.path.basename(flags.FLAGS["config"].config_filename))[0]
    cli.run(lambda: train_loop.train(_CONFIG.value, _WORKDIR.value or os.path.join("runs", config_name)))


if __name__ == "__main__":
    cli.run_app(main)
