"""Weights & Biases: every record the run logs, mirrored to one W&B run that holds what metrics.jsonl holds.

Optional (`pip install wandb`) and off unless `wandb.project` is set. `wandb.json` in the workdir keeps the W&B
run's id, project and entity, the run identity it mirrors (`run_dir.claim_identity`), the last step sent to
it ("sent") and the last step up to which its values are metrics.jsonl's ("agreed"; `forget_after` lowers it
on every start, W&B on or off). A start with W&B on (docs/lifecycle.md, "Mirror"):
- goes on with the W&B run, first sending the steps metrics.jsonl holds and it lacks;
- rewinds it (`resume_from="ID?_step=N"`) where it holds steps past "agreed" (a kill, a resume from an earlier
  checkpoint, also one trained with W&B off), so that the steps trained again replace them;
- starts a new W&B run sent the whole of metrics.jsonl where W&B refuses the rewind (a preview feature many
  accounts lack, and one it refuses for a run not yet finished), or the workdir is a copy with an identity of
  its own, or the project or entity changed. One line says which.
`WANDB_MODE=offline`, or no W&B login, writes the run under the workdir's `wandb/` for `wandb sync` to upload
later (the rewind with it), and says where.

W&B never stops training: a failure to start (no network, a refused key, a time-out) or to log (a quota) is
one warning line, and the local logs go on; the next start tries again.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from typing import Any, Iterable

import ml_collections

from andrea_jax import first_line, run_dir
from andrea_jax.runtime import atomic

STATE_FILE = "wandb.json"


def _warn(what: str) -> None:
    print(f"warning: W&B {what}; training goes on with its local logs (metrics.jsonl, tensorboard/)",
          file=sys.stderr, flush=True)


def _say(line: str) -> None:
    print(f"W&B: {line}", file=sys.stderr, flush=True)


def _read_state(workdir: str) -> dict:
    path = os.path.join(workdir, STATE_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        state = json.load(f)
    if "sent" not in state:  # written before "agreed": its steps were all the run's
        state["sent"] = state["agreed"] = state.pop("logged_through", -1)
    return state


def forget_after(workdir: str, step: int) -> None:
    """The run starts from `step`, and metrics.jsonl drops its records past it: so do W&B's (at its next start)."""
    try:
        state = _read_state(workdir)
    except (OSError, ValueError):
        return
    if state and state["agreed"] > step:
        atomic.write(os.path.join(workdir, STATE_FILE), json.dumps({**state, "agreed": step}))


def _new_run(state: dict, why: str) -> tuple[dict, dict]:
    new_id = secrets.token_hex(6)
    if state.get("id"):
        _say(f"{why}: the records go to a new W&B run, {new_id}, sent the whole of metrics.jsonl")
    return {"id": new_id}, {"id": new_id, "sent": -1, "agreed": -1}


def _start(state: dict, mirrored: dict) -> tuple[dict, dict]:
    """(wandb.init's arguments that pick the W&B run, its state once started)."""
    owner = {key: state.get(key, value) for key, value in mirrored.items()}
    if not state.get("id") or owner != mirrored:
        changed = "the workdir's run" if owner["run"] != mirrored["run"] else "the project or entity"
        return _new_run(state, f"run {state.get('id')} mirrors another run ({changed} changed)")
    if state["sent"] > state["agreed"]:
        # Steps past "agreed" were sent by a run that stopped without saving them (a kill), or were trained again
        # since (a resume from an earlier checkpoint): the steps trained again replace them.
        _say(f"run {state['id']} is rewound to step {state['agreed']}: its steps {state['agreed'] + 1} to "
             f"{state['sent']} are replaced by metrics.jsonl's and the ones trained now")
        return ({"resume_from": f"{state['id']}?_step={state['agreed']}"},
                {"id": state["id"], "sent": state["agreed"], "agreed": state["agreed"]})
    return {"id": state["id"], "resume": "allow"}, {"id": state["id"], "sent": state["sent"], "agreed": state["sent"]}


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
        mirrored = {"run": run_dir.identity(workdir), "project": config.wandb.project,
                    "entity": config.wandb.entity or None}
        try:
            which, state = _start(_read_state(workdir), mirrored)
            mode = os.environ.get("WANDB_MODE", "online")
            if mode == "online" and not wandb.login(prompt=False, verify=False):  # init would ask for a key, and wait
                mode = "offline"
                _say("no login (wandb login, or WANDB_API_KEY): the run is written offline")
            start = lambda which: wandb.init(
                project=config.wandb.project, entity=config.wandb.entity or None, **which,
                dir=workdir, mode=mode, config=config.to_dict(), name=os.path.basename(os.path.abspath(workdir)),
                settings=wandb.Settings(init_timeout=float(config.wandb.timeout_seconds), silent=True,
                                        console="off"))
            try:
                self._run = start(which)
            except Exception as error:
                if "resume_from" not in which:
                    raise
                which, state = _new_run(state, f"W&B refused to rewind run {state['id']} ({first_line(error)})")
                self._run = start(which)
            self._state = {**state, **mirrored}
            # Written once the run has started: a start that failed changes nothing the next start decides on.
            atomic.write(self._path, json.dumps(self._state))
        except Exception as error:  # wandb raises its own errors, and others from its service
            _warn(f"could not start ({first_line(error)})")
            return
        if mode != "online":
            _say(f"run {state['id']} is written to {os.path.dirname(self._run.dir)}; `wandb sync` that directory to "
                 f"upload it")
        missing = [record for record in logged if self._state["sent"] < record["step"] <= start_step]
        if missing:
            _say(f"sending steps {missing[0]['step']} to {missing[-1]['step']} from metrics.jsonl, which run "
                 f"{self._state['id']} lacks")
        for record in missing:
            self.log(record["step"], {key: value for key, value in record.items() if key != "step"})

    def log(self, step: int, record: dict[str, Any]) -> None:
        if self._run is None:
            return
        try:
            self._run.log({key: value for key, value in record.items() if isinstance(value, (int, float))},
                          step=step)
            if step > self._state["sent"]:
                self._state["sent"] = self._state["agreed"] = step
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
            _warn(f"could not finish the run ({first_line(error)})")
