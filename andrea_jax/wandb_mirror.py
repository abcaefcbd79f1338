"""Weights & Biases: every record the run logs, mirrored to one W&B run that lives as long as the workdir's.

Optional (`pip install wandb`) and off unless `wandb.project` is set. The W&B run's id is kept in the workdir
(`wandb.json`), with the last step sent to it and the workdir's own path, so that on every start the W&B run
is made to hold what metrics.jsonl holds up to the checkpoint the run starts from:
- a resume continues the W&B run; steps it lacks (W&B could not be reached when they were trained) are sent
  from metrics.jsonl first;
- a resume from a checkpoint before the last step sent (a kill, or an earlier checkpoint taken again with a
  lower rate) rewinds the W&B run to the checkpoint's step (`resume_from="ID?_step=N"`), so that the steps
  trained again replace the old ones;
- a copy of a workdir (the path in `wandb.json` is another workdir that still holds the same run) starts a W&B
  run of its own, forked from the original's at the last step both hold (`fork_from="ID?_step=N"`).
`WANDB_MODE=offline`, or no W&B login, writes the run under the workdir's `wandb/` for `wandb sync` to upload
later; the rewind or fork is recorded there and done by W&B when the run is uploaded.

W&B never stops training: a failure to start (no network, a refused key, a time-out) or to log (a quota) is
one warning line, and the local logs go on.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from typing import Any, Iterable

import ml_collections

from andrea_jax.runtime import atomic

# {"id": the W&B run's id, "logged_through": the last step sent, "workdir": the real path of the workdir it
# belongs to}
STATE_FILE = "wandb.json"


def _warn(what: str) -> None:
    print(f"warning: W&B {what}; training goes on with its local logs (metrics.jsonl, tensorboard/)",
          file=sys.stderr, flush=True)


def _say(line: str) -> None:
    print(f"W&B: {line}", file=sys.stderr, flush=True)


def _read_state(workdir: str) -> dict:
    state = {"id": None, "logged_through": -1, "workdir": None}
    path = os.path.join(workdir, STATE_FILE)
    if os.path.exists(path):
        with open(path) as f:
            state.update(json.load(f))
    return state


def _holds_run(workdir: str, run_id: str) -> bool:
    """Whether `workdir` still holds the W&B run `run_id` (a workdir moved away holds nothing there)."""
    try:
        return _read_state(workdir)["id"] == run_id
    except (OSError, ValueError):
        return False


def _start(workdir: str, state: dict, start_step: int) -> tuple[dict, dict]:
    """(wandb.init's arguments that pick the run, the state once it has started): the workdir's own run,
    rewound to `start_step` if it holds steps past it, or a new one for a copy of another workdir."""
    here, run_id, sent = os.path.realpath(workdir), state["id"], int(state["logged_through"])
    original = state["workdir"]
    if run_id is not None and original not in (None, here) and _holds_run(original, run_id):
        # Both workdirs would write into one W&B run. The copy's metrics.jsonl holds the original's steps
        # up to the checkpoint it starts from, and the original's W&B run the steps sent before the copy.
        new_id, fork_at = secrets.token_hex(6), min(sent, start_step)
        if fork_at >= 1:
            _say(f"{workdir} is a copy of {original}: its records go to a W&B run of its own, {new_id}, "
                 f"forked from {run_id} at step {fork_at}")
            return ({"id": new_id, "fork_from": f"{run_id}?_step={fork_at}"},
                    {"id": new_id, "logged_through": fork_at, "workdir": here})
        _say(f"{workdir} is a copy of {original}: its records go to a W&B run of its own, {new_id} ({run_id} "
             f"holds no step to fork from)")
        return {"id": new_id}, {"id": new_id, "logged_through": -1, "workdir": here}
    if run_id is not None and sent > start_step:
        # Steps past the checkpoint were sent by a run that stopped without saving them (a kill), or trained
        # with other settings (a resume from an earlier checkpoint): the steps trained again replace them.
        _say(f"run {run_id} is rewound to step {start_step}, the checkpoint this run starts from: its steps "
             f"{start_step + 1} to {sent} are replaced by the ones trained now")
        return ({"resume_from": f"{run_id}?_step={start_step}"},
                {"id": run_id, "logged_through": start_step, "workdir": here})
    run_id = run_id or secrets.token_hex(6)
    return {"id": run_id, "resume": "allow"}, {"id": run_id, "logged_through": sent, "workdir": here}


class Mirror:
    """Sends records to W&B; does nothing once W&B has failed."""

    def __init__(self, workdir: str, config: ml_collections.ConfigDict, start_step: int = 0,
                 logged: Iterable[dict] = ()) -> None:
        """`logged`: the workdir's records up to `start_step` (metrics.jsonl), sent where the W&B run lacks them."""
        self._path, self._run, self._wandb = os.path.join(workdir, STATE_FILE), None, None
        try:
            import wandb
        except ImportError:
            _warn("is not installed (pip install wandb)")
            return
        self._wandb = wandb
        try:
            which, self._state = _start(workdir, _read_state(workdir), start_step)
            mode = os.environ.get("WANDB_MODE", "online")
            if mode == "online" and not wandb.login(prompt=False, verify=False):  # init would ask for a key, and wait
                mode = "offline"
                _say(f"no login (wandb login, or WANDB_API_KEY): the run is written to {workdir}/wandb for "
                     f"`wandb sync` to upload later")
            self._run = wandb.init(
                project=config.wandb.project, entity=config.wandb.entity or None, **which,
                dir=workdir, mode=mode, config=config.to_dict(), name=os.path.basename(os.path.abspath(workdir)),
                settings=wandb.Settings(init_timeout=float(config.wandb.timeout_seconds), silent=True,
                                        console="off"))
            # Written once the run has started: a start that failed changes nothing the next start decides on.
            atomic.write(self._path, json.dumps(self._state))
        except Exception as error:  # wandb raises its own errors, and others from its service
            _warn(f"could not start ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
            return
        missing = [record for record in logged if self._state["logged_through"] < record["step"] <= start_step]
        if missing:
            _say(f"sending steps {missing[0]['step']} to {missing[-1]['step']} from metrics.jsonl, which run "
                 f"{self._state['id']} lacks (trained while W&B was off or could not be reached)")
        for record in missing:
            self.log(record["step"], {key: value for key, value in record.items() if key != "step"})

    def log(self, step: int, record: dict[str, Any]) -> None:
        if self._run is None:
            return
        try:
            self._run.log({key: value for key, value in record.items() if isinstance(value, (int, float))},
                          step=step)
            if step > self._state["logged_through"]:
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
