"""Where the numbers of a run go: metrics.jsonl and TensorBoard event files.

Only the leader process writes; the others get a writer that does nothing, so the loop needs no
`if process_index == 0` of its own.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import ml_collections

from andrea_jax import event_files, wandb_mirror
from andrea_jax.event_files import SummaryWriter
from andrea_jax.runtime import atomic

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _plain(value: Any) -> Any:
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep the record readable
    return value


def read(workdir: str) -> list[dict]:
    """The whole records: each is written with its newline last, so a last line without one is a record
    cut short (a kill or a full disk mid-write)."""
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().split("\n")[:-1] if line.strip()]


def truncate_after(workdir: str, step: int) -> None:
    """Drop records and TensorBoard events past `step` (logged by a run that stopped before saving them),
    and a record cut short.

    A resumed run logs those steps again; keeping both would double them.
    Rewritten atomically: a kill leaves the old file or the new one.
    """
    event_files.drop_after(os.path.join(workdir, TENSORBOARD_DIR), step)
    path = os.path.join(workdir, METRICS_FILE)
    kept = "".join(json.dumps(r) + "\n" for r in read(workdir) if r.get("step", 0) <= step)
    if os.path.exists(path) and os.path.getsize(path) != len(kept.encode()):  # records dropped, or a torn tail
        atomic.write(path, kept)


class Writer:
    """Appends one JSON object per record and mirrors scalars to TensorBoard."""

    def __init__(self, workdir: str, enabled: bool = True, start_step: int = 0,
                 config: ml_collections.ConfigDict | None = None):
        """With `config.wandb.project` set, every record also goes to W&B (`wandb_mirror.py`), which is first
        given the workdir's records up to `start_step` that it lacks."""
        self.enabled = enabled
        if not enabled:
            return
        # Made after truncate_after: the records it finds are those up to start_step, which W&B must hold.
        self._wandb = wandb_mirror.Mirror(workdir, config, start_step, read(workdir)) \
            if config is not None and config.wandb.project else None
        self._path = os.path.join(workdir, METRICS_FILE)
        self._jsonl = open(self._path, "a")
        # An event file's name has whole seconds only, and an existing file of that name is
        # overwritten: the suffix keeps a run resumed within the same second from erasing the
        # earlier run's events.
        self._tensorboard = SummaryWriter(os.path.join(workdir, TENSORBOARD_DIR),
                                          filename_suffix=f".{os.getpid()}.{start_step}")

    def write(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in values.items()}}
        with atomic.writing(self._path):
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(int(step), {key: value for key, value in record.items() if key != "step"})

    def close(self) -> None:
        if self.enabled:
            with atomic.writing(self._path):  # what a full disk left in the buffer
                self._jsonl.close()
            self._tensorboard.close()
            if self._wandb is not None:
                self._wandb.close()
