"""Orbax checkpoints of a run: params, optimizer state (and loss scale) and metadata as separate items.

Separate items let eval restore params alone. Restores take abstract targets carrying the
*current* shardings, so a checkpoint written on one mesh restores on any other. Orbax renames
each step into place when complete, so a killed save is never picked up; a step unreadable
anyway (truncated by hand, disk trouble) is skipped for the previous one, and a training run
moves it aside (never deletes it) so it can save that step again.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from andrea_jax import UserError, first_line
from andrea_jax.runtime import atomic, storage
from andrea_jax.run_dir import PROJECT

FORMAT_VERSION = 1
UNREADABLE_DIR = "checkpoints_unreadable"  # in the workdir, next to checkpoints/
# Steps past `keep` are renamed in here (one atomic step), then removed: a kill while removing
# never leaves a half-deleted step among the kept ones.
DELETING_DIR = "deleting"  # in checkpoints/


class CheckpointError(UserError):
    """No usable checkpoint where one was asked for; the message says what to do."""


def directory_of(workdir: str) -> str:
    """The checkpoints of `workdir`: of a working copy, on the bucket (`runtime/storage.py`)."""
    return os.path.join(storage.remote_of(workdir) or os.path.abspath(workdir), "checkpoints")  # POSIX: gs:// too


def saved_steps(workdir: str) -> list[int]:
    """The steps of the workdir's checkpoints, read from the directory (no checkpoint manager needed)."""
    return sorted(int(name) for name in storage.names_in(directory_of(workdir)) if name.isdigit())


def abstract_like(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs with the given shardings: the restore target."""
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        tree, shardings)


def check_meta(meta: dict, where: str, tokenizer_sha256: str | None = None) -> None:
    """Stops on a checkpoint this run cannot continue from, before any array is read."""
    if meta.get("project") != PROJECT:
        raise CheckpointError(f"{where} was not written by {PROJECT}; use a new --workdir")
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{where} has checkpoint format {meta.get('format')}, this version reads "
                              f"{FORMAT_VERSION}; use the andrea-jax version that wrote it or a new --workdir")
    saved_sha = meta.get("tokenizer_sha256")
    if tokenizer_sha256 is not None and saved_sha is not None and saved_sha != tokenizer_sha256:
        raise CheckpointError(f"{where} was trained with tokenizer {saved_sha[:12]}, but the workdir's "
                              f"tokenizer.json is {tokenizer_sha256[:12]}; put the run's own tokenizer.json "
                              f"back or use a new --workdir")


class Checkpointer:
    """A CheckpointManager keeping the newest `keep` steps, saving asynchronously."""

    def __init__(self, workdir: str, keep: int = 3, read_only: bool = False):
        self.directory = directory_of(workdir)
        self.read_only, remote = read_only, storage.is_remote(self.directory)
        # Cloud Storage has no rename: a step past `keep` is deleted in place (a killed deletion leaves a step
        # without Orbax's commit marker, which is never read).
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                               create=not read_only, read_only=read_only,
                                               cleanup_tmp_directories=not read_only,
                                               todelete_subdir=None if read_only or remote else DELETING_DIR)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Starts an async save of the state at `step`; training goes on while it writes.

        A save the disk cannot hold is refused before anything is written: one that fails halfway
        fails in Orbax's writer threads, long after the step, in many tracebacks.
        """
        self.wait()  # as save() would: nothing is being renamed into DELETING_DIR now
        self._remove_deleted()
        # The shards this process writes (one copy of each, uncompressed), and 1 MiB for Orbax's metadata and indexes.
        needed = 2**20 + sum(shard.data.nbytes for leaf in jax.tree.leaves(state)
                             for shard in leaf.addressable_shards if shard.replica_id == 0)
        short = not storage.is_remote(self.directory) and shutil.disk_usage(self.directory).free < needed
        if jax.process_count() > 1:  # all processes refuse together, or none does
            short = bool(multihost_utils.process_allgather(np.int32(short)).any())
        if short:
            raise atomic.disk_full(os.path.join(self.directory, str(step)), needed)
        meta = {"project": PROJECT, "format": FORMAT_VERSION, "step": int(step), **meta}
        arrays = {item: ocp.args.StandardSave(tree) for item, tree in state.items() if item != "step"}
        self._manager.save(step, args=ocp.args.Composite(**arrays, meta=ocp.args.JsonSave(meta)), force=True)

    def _remove_deleted(self) -> None:
        if jax.process_index() == 0 and not storage.is_remote(self.directory):  # the process that deletes
            shutil.rmtree(os.path.join(self.directory, DELETING_DIR), ignore_errors=True)

    def restore(self, abstract_state: dict, step: int | None = None, params_only: bool = False,
                tokenizer_sha256: str | None = None) -> tuple[dict, dict] | None:
        """(state, meta) of `step`, or of the newest readable step; None when there is none.

        abstract_state: {"params": ..., "opt_state": ..., ["loss_scale": ...]} of ShapeDtypeStructs with shardings,
        an item each ("params" alone with params_only). A checkpoint of another project or tokenizer raises
        CheckpointError (the model's shape is `run_dir.check_compatible`'s); an unreadable one is skipped.
        """
        steps = self.steps()
        if step is not None and step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; "
                                  f"available steps: {', '.join(map(str, steps)) or 'none'}")
        unreadable: list[tuple[int, Exception]] = []
        for candidate in reversed(steps) if step is None else [step]:
            try:
                meta = self._manager.restore(candidate, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                check_meta(meta, f"checkpoint step {candidate} in {self.directory}", tokenizer_sha256)
                # A run that computed in another dtype saved no loss scale: the caller starts one.
                names = ["params"] if params_only else [item for item in abstract_state if item != "step" and (
                    item != "loss_scale" or storage.exists(os.path.join(self.directory, str(candidate), item)))]
                restored = self._manager.restore(candidate, args=ocp.args.Composite(
                    **{item: ocp.args.StandardRestore(abstract_state[item]) for item in names}))
            except CheckpointError:
                raise
            except Exception as error:  # an unreadable step: fall back, and say so
                if step is not None:
                    raise CheckpointError(f"checkpoint step {step} in {self.directory} is unreadable "
                                          f"({first_line(error)}); pick another --step") from error
                unreadable.append((candidate, error))
                continue
            # Newer steps are set aside only once an older one has been read: a passing
            # fault (a flaky mount, memory) can then cost the steps since `candidate`,
            # never the whole run.
            for bad_step, error in unreadable:
                print(f"warning: checkpoint step {bad_step} in {self.directory} is unreadable ({first_line(error)}); "
                      f"{self._set_aside(bad_step)}; falling back to step {candidate}", flush=True)
            return {item: restored[item] for item in names}, dict(meta)
        for bad_step, error in unreadable:
            logging.warning("checkpoint step %d in %s is unreadable (%s)", bad_step, self.directory,
                            first_line(error))
        if steps:
            # Starting over would overwrite what is there: leave that to the user.
            raise CheckpointError(f"no readable checkpoint in {self.directory} (steps "
                                  f"{', '.join(map(str, steps))}); move the directory away to start over, "
                                  f"or use a new --workdir")
        return None

    def _set_aside(self, step: int) -> str:
        """Moves an unreadable step out of the manager's way, so the run can save it again; kept for inspection."""
        if self.read_only:
            return "kept in place"
        aside = os.path.join(os.path.dirname(self.directory), UNREADABLE_DIR, str(step))
        if jax.process_index() == 0:
            if storage.exists(aside):
                aside += f".{int(time.time())}"
            storage.rename(os.path.join(self.directory, str(step)), aside)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"andrea_checkpoint_aside_{step}")
        self._manager.reload()
        return f"moved to {aside}"

    def wait(self) -> None:
        """Waits for the save being written; one that failed (a bucket that stayed unreachable through Orbax's
        retries, a disk error) is a CheckpointError naming the newest checkpoint kept."""
        try:
            self._manager.wait_until_finished()
        except Exception as error:
            if atomic.as_disk_full(error) is not None:
                raise
            kept = self._manager.all_steps()
            raise CheckpointError(f"a checkpoint could not be written to {self.directory} ({first_line(error)}); "
                                  f"the newest one kept is {f'step {max(kept)}' if kept else 'none'}: run the same "
                                  f"command to resume from it once the storage answers") from error

    def saving(self) -> bool:
        """Whether a save is being written (a stop at once would lose it)."""
        return self._manager.is_saving_in_progress()

    def close(self) -> None:
        """Waits for the last async save, then releases the manager (call in a finally)."""
        try:
            self.wait()
        finally:
            self._manager.close()
        if not self.read_only:
            self._remove_deleted()
