"""The run directory: its resolved config, its lock and its identity, and the checks that keep runs apart.

A workdir holds one run (docs/lifecycle.md). Resuming it with a change `RESUMABLE` does not allow, pointing a
run at a directory that holds something else, or at one another run holds, stops with one line before
anything in it is touched.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import tempfile
import time
import uuid
from functools import partial
from typing import Callable

import ml_collections

from andrea_jax.runtime import atomic, storage
from andrea_jax.config import ConfigError, base_config

CONFIG_FILE = "config.json"
LOCK_FILE = "run.lock"  # held by the training run's process 0 for the run's whole life
IDENTITY_FILE = "run.json"  # {"id": the run's identity, "start": this start's token, "previous": the last one's}
PROJECT = "andrea-jax"
# Attention kernels this version replaced, as a saved config names them: what each one reads as now.
RENAMED_ATTENTION = {"flash": "splash", "dot_product": "auto"}


def load_saved_config(workdir: str) -> ml_collections.ConfigDict | None:
    """The config a run in `workdir` was started with, or None for a new directory."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir {workdir} is a file, not a directory; pick a new or empty directory")
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        if os.path.isdir(workdir) and set(os.listdir(workdir)) - {LOCK_FILE}:
            raise ConfigError(f"--workdir {workdir} is not empty and holds no {PROJECT} run "
                              f"(no {CONFIG_FILE}); pick an empty or new directory")
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path} is unreadable ({error}); restore it or use a new --workdir") from error
    if not isinstance(saved, dict) or saved.get("project") != PROJECT:
        raise ConfigError(f"{path} was not written by {PROJECT}; use a new --workdir")
    # Over the defaults: keys added to the config since the run began take their default.
    config = base_config()
    try:
        config.update(saved["config"])
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(f"{path} does not fit this version's config ({error}); use the andrea-jax version "
                          f"that wrote it or a new --workdir") from error
    config.model.attention = RENAMED_ATTENTION.get(config.model.attention, config.model.attention)
    if "order" not in saved["config"].get("data", {}):  # a run started before data.order: random offsets
        config.data.order = "random"
    if "muon_ns_dtype" not in saved["config"].get("optimizer", {}):  # saved before the key: computed in float32
        config.optimizer.muon_ns_dtype = "float32"
    return config


# What a resume may change (docs/lifecycle.md, "Resume"): how long and how fast it trains, what it logs and
# when, how it computes and where its caches live. Any other key decides what the run reads or is, and a change
# of it is a new run.
RESUMABLE = (
    "steps", "optimizer.learning_rate", "optimizer.warmup_steps", "optimizer.decay", "optimizer.cooldown_steps",
    "optimizer.cooldown_shape", "optimizer.min_learning_rate_ratio", "optimizer.muon_ns_dtype",
    "log_every", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints", "peak_flops",
    "diagnostics", "profile_steps", "wandb.", "hellaswag.", "microbatches", "model.remat", "model.dtype",
    "model.attention", "mesh.", "logical_axis_rules", "data.stream_tokens", "data.keep_eras", "data.cache_dir",
    "data.tfds_data_dir", "init_params_from")


def _flat(config: ml_collections.ConfigDict) -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            flat.update({f"{key}.{inner}": leaf for inner, leaf in _flat(value).items()})
        else:
            flat[key] = value
    return flat


def check_compatible(saved: ml_collections.ConfigDict, config: ml_collections.ConfigDict, workdir: str,
                     only: str = "") -> None:
    """Refuses, in one line naming the key, a resume that changes a key outside `RESUMABLE` (model.vocab_size=0,
    "take the tokenizer's size", matches any); `only`: the keys under this prefix (evaluation: "model.")."""
    old, new = _flat(saved), _flat(config)
    for key, value in new.items():
        if not key.startswith(only) or key.startswith(RESUMABLE) or key not in old or _same(old[key], value):
            continue
        if key == "model.vocab_size" and 0 in (old[key], value):
            continue
        if only:  # evaluation: the checkpoint's model is built as it was trained
            raise ConfigError(f"{workdir} holds a run with {key}={old[key]!r}, not {value!r}; pass "
                              f"--config.{key}={old[key]!r}")
        raise ConfigError(f"{workdir} holds a run with {key}={old[key]!r}, which a resume cannot change to "
                          f"{value!r}; pass --config.{key}={old[key]!r} to resume it, or start a new --workdir "
                          f"from its checkpoint with --config.init_params_from={workdir}")


def _same(old, new) -> bool:
    as_list = lambda value: [as_list(item) for item in value] if isinstance(value, (list, tuple)) else value
    return as_list(old) == as_list(new)


def save_config(workdir: str, config: ml_collections.ConfigDict) -> None:
    """Writes the resolved config atomically (a kill leaves the old file or the new one)."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, CONFIG_FILE)
    atomic.write(path, json.dumps({"project": PROJECT, "config": json.loads(config.to_json())}, indent=2))


def require_writable(directory: str, setting: str, fix: str) -> None:
    """Makes `directory` if it is missing and writes a file in it that vanishes at close, or raises ConfigError
    in one line about `setting` (the flag or key and its value) ending in `fix` (DiskFull where the disk is
    full)."""
    try:
        with atomic.writing(directory):
            os.makedirs(directory, exist_ok=True)
            tempfile.TemporaryFile(dir=directory).close()
    except OSError as error:
        raise _unusable(error, setting, fix) from None


def _unusable(error: OSError, setting: str, fix: str) -> ConfigError:
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ConfigError(f"{setting} cannot be written to ({error.strerror}); make it (or the directory it goes "
                           f"in) writable, or {fix}")
    # A path through a file (NotADirectoryError), a file system that refuses new directories, ...
    return ConfigError(f"{setting} cannot be made ({error.strerror}); every directory on its path must be one that "
                       f"can hold it; {fix}")


def hold(workdir: str) -> Callable[[], None]:
    """Takes the run's lock on `workdir`, or raises ConfigError naming the process that holds it (or saying
    that the directory is not writable, or DiskFull); returns what releases it at the run's end. A refused run
    removes nothing: the directory and the lock file are then the holder's (two runs starting at once on a new
    workdir both make them).

    The lock is an flock on `run.lock`: the kernel drops it when its holder exits, even by kill -9 or a lost
    machine, so a dead run never blocks the next. On Cloud Storage it is a lease (`storage.Lease`).
    """
    if storage.remote_of(workdir) is not None:
        return storage.hold(workdir)
    path = os.path.join(workdir, LOCK_FILE)
    # A directory the run cannot write to stops here, before it holds anything.
    require_writable(workdir, f"--workdir {workdir}", "use another --workdir")
    with atomic.writing(path):
        return partial(os.close, _lock_run(path, workdir))


def _lock_run(path: str, workdir: str) -> int:
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        if error.errno in atomic.NO_SPACE:
            raise
        raise _unusable(error, f"--workdir {workdir}", "use another --workdir") from None
    try:
        return lock(descriptor)
    except Held as held:
        raise ConfigError(f"--workdir {workdir} is in use by a training run ({held}); wait for it to end or "
                          f"stop it (it saves and exits on Ctrl-C or SIGTERM), or use another --workdir") from None
    except OSError as error:
        if error.errno in atomic.NO_SPACE:  # the lock was taken; writing who holds it found no space
            raise
        raise ConfigError(f"--workdir {workdir} is on a file system without file locks ({error.strerror}), which "
                          f"keep two runs apart; use a local disk or NFS") from None


class Held(Exception):
    """The lock is another process's; the message is what its file says of that process."""


def lock(descriptor: int, about: str = "") -> int:
    """Takes an exclusive flock on the open file `descriptor` and writes this process (and `about`) in it;
    returns the descriptor. Raises Held where another process holds it, OSError where the file system has
    no locks; either way the descriptor is closed."""
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"pid {os.getpid()} on {socket.gethostname()}, started "
                              f"{time.strftime('%Y-%m-%d %H:%M:%S')}{about}".encode(), 0)
    except BlockingIOError:  # only flock's: another process holds it
        holder, deadline = "", time.monotonic() + 1
        while not holder and time.monotonic() < deadline:  # a holder writes itself in right after it locks
            holder = os.pread(descriptor, 300, 0).decode("utf-8", "replace").strip()
            time.sleep(0 if holder else 0.01)
        os.close(descriptor)
        raise Held(holder or "another process") from None
    except OSError:  # no file locks, or a full disk
        os.close(descriptor)
        raise
    return descriptor


def identity(workdir: str) -> str | None:
    """The id of the run in `workdir` (`claim_identity`), None before a run has claimed one."""
    return _read_json(os.path.join(workdir, IDENTITY_FILE)).get("id")


def claim_identity(workdir: str, cache_dir: str) -> tuple[str, int | None]:
    """(the run's id, the descriptor holding it for the run's life) (docs/lifecycle.md, "Identity").

    The id is claimed in `<cache_dir>/runs/<id>.lock`, an flock whose text says which start claimed it last
    (a token) and from which directory (host, device, inode). Another live run holding it, a token this
    workdir did not write, or another directory on this host means that another workdir runs as this id (a
    copy, or the original of one): this one takes a new id. A cache without the lock (another machine's, a
    cleared one) keeps the id, and so does a workdir renamed: a workdir moved or resumed elsewhere is the run."""
    path = os.path.join(workdir, IDENTITY_FILE)
    record = _read_json(path)
    run_id = record.get("id") or _read_json(os.path.join(workdir, "eras.json")).get("run") or uuid.uuid4().hex[:12]
    ours, token = {record.get("start"), record.get("previous")} - {None}, uuid.uuid4().hex[:12]
    # Written first: a kill before the lock is rewritten leaves a token the next start accepts.
    atomic.write(path, json.dumps({"id": run_id, "start": token, "previous": record.get("start")}))
    descriptor, claimed_by = _claim(cache_dir, run_id, token, ours, workdir)
    if claimed_by is not None:
        copied, run_id = run_id, uuid.uuid4().hex[:12]
        print(f"{workdir} is a copy, or the original of one: its run {copied} is {claimed_by}; it becomes run "
              f"{run_id}, with eras and a W&B run of its own", flush=True)
        atomic.write(path, json.dumps({"id": run_id, "start": token, "previous": None}))
        descriptor, _ = _claim(cache_dir, run_id, token, set(), workdir)
    return run_id, descriptor


def unclaim(cache_dir: str, run_id: str) -> None:
    """Removes a new run's claim of `run_id` and the directories it made (a run that stops before its first
    step leaves the cache as it found it)."""
    runs = os.path.join(cache_dir, "runs")
    for remove, path in ((os.remove, os.path.join(runs, f"{run_id}.lock")), (os.rmdir, runs), (os.rmdir, cache_dir)):
        try:
            remove(path)
        except OSError:  # another run's claims are there, or the cache holds more
            return


def _claim(cache_dir: str, run_id: str, token: str, ours: set, workdir: str) -> tuple[int | None, str | None]:
    """(the descriptor of the id's lock, what else claimed the id: None if nothing did)."""
    status = os.stat(workdir)
    # Of a gs:// workdir its address, which names one directory wherever it runs.
    here = storage.remote_of(workdir) or f"{socket.gethostname()}:{status.st_dev}:{status.st_ino}"
    try:
        os.makedirs(os.path.join(cache_dir, "runs"), exist_ok=True)
        descriptor = os.open(os.path.join(cache_dir, "runs", f"{run_id}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        last = re.search(r"start (\w+) in (\S+)$", os.pread(descriptor, 400, 0).decode("utf-8", "replace"))
        # The inode tells a copy from its original on this host only: on another it may be another disk's.
        comparable = last is not None and (last.group(2).startswith(f"{socket.gethostname()}:") or
                                           storage.is_remote(last.group(2)) or storage.is_remote(here))
        another_directory = comparable and last.group(2) != here
        if last is not None and (last.group(1) not in ours or another_directory):
            os.close(descriptor)  # the claim stays the other workdir's
            return None, "claimed by another workdir since this one last ran"
        return lock(descriptor, f", start {token} in {here}"), None
    except Held as held:
        return None, f"held by a live run ({held})"
    except OSError:  # a cache the run cannot lock in: the id is kept, unguarded (its data work says what fails)
        return None, None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
