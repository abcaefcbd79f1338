"""Orbax checkpoints of a run: params, optimizer state and metadata as separate items.

Separate items let eval restore params alone. Restores take abstract targets
carrying the *current* shardings, so a checkpoint written on one mesh restores
on any other. Orbax writes each step into a temporary directory and renames it
when complete, so a killed save is never picked up; a step that is unreadable
anyway (truncated by hand, disk trouble) is skipped for the previous one.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

PROJECT = "andrea-jax"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for; the message says what to do."""


def directory_of(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "checkpoints")


def abstract_like(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs with the given shardings: the restore target."""
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        tree, shardings)


class Checkpointer:
    """A CheckpointManager keeping the newest `keep` steps, saving asynchronously."""

    def __init__(self, workdir: str, keep: int = 3, read_only: bool = False):
        self.directory = directory_of(workdir)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                               create=not read_only, read_only=read_only)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Starts an async save of the state at `step`; training goes on while it writes."""
        meta = {"project": PROJECT, "format": FORMAT_VERSION, "step": int(step), **meta}
        self._manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]),
            opt_state=ocp.args.StandardSave(state["opt_state"]),
            meta=ocp.args.JsonSave(meta)), force=True)

    def _restore_step(self, step: int, abstract_state: dict, params_only: bool) -> tuple[dict, dict]:
        items = dict(params=ocp.args.StandardRestore(abstract_state["params"]), meta=ocp.args.JsonRestore())
        if not params_only:
            items["opt_state"] = ocp.args.StandardRestore(abstract_state["opt_state"])
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        meta = dict(restored["meta"])
        if meta.get("project") != PROJECT:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} was not written by {PROJECT}")
        state = {"params": restored["params"]}
        if not params_only:
            state["opt_state"] = restored["opt_state"]
        return state, meta

    def restore(self, abstract_state: dict, step: int | None = None,
                params_only: bool = False) -> tuple[dict, dict] | None:
        """(state, meta) of `step`, or of the newest readable step; None when there is none.

        abstract_state: {"params": ..., "opt_state": ...} of ShapeDtypeStructs with shardings.
        """
        steps = self.steps()
        if step is not None:
            if step not in steps:
                raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; "
                                      f"available steps: {steps or 'none'}")
            return self._restore_step(step, abstract_state, params_only)
        for candidate in reversed(steps):
            try:
                return self._restore_step(candidate, abstract_state, params_only)
            except CheckpointError:
                raise
            except Exception as error:  # an unreadable step: fall back, and say so
                older = [s for s in steps if s < candidate]
                logging.warning("checkpoint step %d in %s is unreadable (%s: %s); %s", candidate, self.directory,
                                type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "",
                                f"falling back to step {older[-1]}" if older else "no older step to fall back to")
                print(f"warning: checkpoint step {candidate} is unreadable; "
                      + (f"falling back to step {older[-1]}" if older else "no older step"), flush=True)
        if steps:
            # Starting over would overwrite what is there: leave that to the user.
            raise CheckpointError(f"no readable checkpoint in {self.directory} (steps {steps}); "
                                  f"move the directory away to start over, or use a new --workdir")
        return None

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the last async save, then releases the manager (call in a finally)."""
        self._manager.wait_until_finished()
        self._manager.close()
