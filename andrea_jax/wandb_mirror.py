"""Weights & Biases: every record the run logs, mirrored to one W&B run that lives as long as the workdir's.

Optional (`pip install wandb`) and off unless `wandb.project` is set. The W&B run's id is kept in the
workdir (`wandb.json`), so a resumed run continues it; records at steps W&B already has are not sent again
(a resume logs again what a stop had logged past its checkpoint, with the same values). `WANDB_MODE=offline`,
or no W&B login, writes the run under the workdir's `wandb/` for `wandb sync` to upload later.

W&B never stops training: a failure to start (no network, a refused key, a time-out) or to log (a quota) is
one warning line, and the local logs go on.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from typing import Any

import ml_collections

from andrea_jax.runtime import atomic

STATE_FILE = "wandb.json"  # {"id": the W&B run's id, "logged_through": the last step sent}


def _warn(what: str) -> None:
    print(f"warning: W&B {what}; training goes on with its local logs (metrics.jsonl, tensorboard/)",
          file=sys.stderr, flush=True)


class Mirror:
    """Sends records to W&B; does nothing once W&B has failed."""

    def __init__(self, workdir: str, config: ml_collections.ConfigDict) -> None:
        self._path, self._run, self._wandb = os.path.join(workdir, STATE_FILE), None, None
        try:
            import wandb
        except ImportError:
            _warn("is not installed (pip install wandb)")
            return
        self._wandb = wandb
        try:
            state = {"id": None, "logged_through": -1}
            if os.path.exists(self._path):
                with open(self._path) as f:
                    state.update(json.load(f))
            # Steps a run in this workdir sent before this one started: a resume logs them again, W&B has them.
            self._state, self._sent_before = state, int(state["logged_through"])
            mode = os.environ.get("WANDB_MODE", "online")
            if mode == "online" and not wandb.login(prompt=False, verify=False):  # init would ask for a key, and wait
                mode = "offline"
                print(f"W&B: no login (wandb login, or WANDB_API_KEY): the run is written to {workdir}/wandb for "
                      f"`wandb sync` to upload later", file=sys.stderr, flush=True)
            state["id"] = state["id"] or secrets.token_hex(6)
            atomic.write(self._path, json.dumps(state))
            self._run = wandb.init(
                project=config.wandb.project, entity=config.wandb.entity or None, id=state["id"], resume="allow",
                dir=workdir, mode=mode, config=config.to_dict(), name=os.path.basename(os.path.abspath(workdir)),
                settings=wandb.Settings(init_timeout=float(config.wandb.timeout_seconds), silent=True,
                                        console="off"))
        except Exception as error:  # wandb raises its own errors, and others from its service
            _warn(f"could not start ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")

    def log(self, step: int, record: dict[str, Any]) -> None:
        if self._run is None or step <= self._sent_before:
            return
        try:
            self._run.log({key: value for key, value in record.items() if isinstance(value, (int, float))},
                          step=step)
            self._state["logged_through"] = step
            atomic.write(self._path, json.dumps(self._state))
        except Exception as error:
            _warn(f"stopped logging ({type(error).__name__}: {error})")
            self.close()

    def close(self) -> None:
        run, self._run, wandb, self._wandb = self._run, None, self._wandb, None
        try:
            if run is not None:
                run.finish()
            if wandb is not None:  # its settings are read once a process: a later run in it (a notebook) reads anew
                wandb.teardown()
        except Exception as error:
            _warn(f"could not finish the run ({type(error).__name__}: {error})")
