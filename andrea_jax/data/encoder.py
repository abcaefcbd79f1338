"""The era encoder: the process beside the training loop that builds a streamed split's eras (`eras.py`).

`Encoder` starts `python -m andrea_jax.data.encoder`
for the run in a workdir from a step on, and the process dies with the training run, even by kill -9.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys

import ml_collections

from andrea_jax.data import eras, pipeline
from andrea_jax.data import tokenizer as tokenizers

_PR_SET_PDEATHSIG = 1


class Encoder:
    """The encoder process of the run in `workdir`, from `first_step` on; its output joins the run's."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, first_step: int,
                 process: int | None = None) -> None:
        self.config, self.workdir, self.process_key = config, workdir, process  # process: its eras' key
        self.first_step, self.process = first_step, self._start(first_step)

    def _start(self, first_step: int) -> subprocess.Popen:
        # A session of its own: a Ctrl-C to the run's terminal is the run's to handle, which stops the encoder.
        return subprocess.Popen([sys.executable, "-m", "andrea_jax.data.encoder", "--workdir", self.workdir,
                                 "--first-step", str(first_step), "--parent", str(os.getpid()),
                                 "--config", self.config.to_json(),
                                 *([] if self.process_key is None else ["--process", str(self.process_key)])],
                                start_new_session=True)

    def restart(self, first_step: int) -> None:
        self.stop()
        self.first_step, self.process = first_step, self._start(first_step)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


def _main() -> None:
    parser = argparse.ArgumentParser(description="Encodes a run's streamed training split era by era.")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--first-step", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True, help="the training run's process id")
    parser.add_argument("--config", required=True, help="the run's config as JSON")
    parser.add_argument("--process", type=int, default=None, help="the process whose own eras these are")
    arguments = parser.parse_args()
    config = ml_collections.ConfigDict(json.loads(arguments.config))
    with contextlib.suppress(OSError, AttributeError):  # Linux: die with the training run, even by kill -9
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    alive = lambda: os.getppid() == arguments.parent  # elsewhere: stop at the next check
    splits = pipeline.open_splits(config)
    tokenizer = tokenizers.load(os.path.join(arguments.workdir, pipeline.TOKENIZER_FILE))
    cache = pipeline.train_cache(config, arguments.workdir, splits, tokenizer, preparing=False,
                                 process=arguments.process)
    eras.encode(cache, splits.train, tokenizer, lambda: cache.layout(int(config.seed), int(config.seq_len)),
                int(config.batch_size), arguments.first_step, int(config.steps) - 1, int(config.data.keep_eras),
                alive, lambda line: print(line, flush=True))


if __name__ == "__main__":
    from andrea_jax import UserError

    try:
        _main()
    except UserError as error:
        print(f"error: the era encoder stopped: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
