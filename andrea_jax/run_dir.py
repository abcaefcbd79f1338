"""The run directory: its resolved config, and the checks that keep runs apart.

A workdir holds one run. Resuming it with a config that changes the model's shape, or pointing a run at a
directory that holds something else, stops with one line before anything in it is touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import tempfile
import time

import ml_collections

from andrea_jax.runtime import atomic
from andrea_jax.config import ConfigError, base_config

CONFIG_FILE = "config.json"
LOCK_FILE = "run.lock"  # held by the training run's process 0 for the run's whole life
PROJECT = "andrea-jax"
# Attention kernels this version replaced, as a saved config names them: what each one reads as now.
RENAMED_ATTENTION = {"flash": "splash", "dot_product": "auto"}
# Keys that decide the shapes or layout of the saved params.
SHAPE_KEYS = ("n_layer", "d_model", "n_head", "mlp_dim", "vocab_size", "vocab_pad_multiple", "max_len",
              "scan_layers", "norm_position", "residual", "activation", "mlp_ratio")


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
    return config


def check_compatible(saved: ml_collections.ConfigDict, config: ml_collections.ConfigDict, workdir: str) -> None:
    """The new config must build the same model and optimizer state as the saved one (other keys may change).

    A saved model.vocab_size=0 is a run stopped before it knew its tokenizer: its tokenizer.json decides.
    """
    for key in SHAPE_KEYS:
        old, new = saved.model[key], config.model[key]
        if old != new and not (key == "vocab_size" and 0 in (old, new)):
            raise ConfigError(f"{workdir} holds a run with model.{key}={old}, not {new}; "
                              f"pass --config.model.{key}={old}, or use a new --workdir")
    if saved.optimizer.name != config.optimizer.name:  # the checkpoints' optimizer state has another tree
        raise ConfigError(f"{workdir} holds a run trained with optimizer.name={saved.optimizer.name!r}, whose "
                          f"optimizer state {config.optimizer.name!r} cannot take; pass "
                          f"--config.optimizer.name={saved.optimizer.name}, or use a new --workdir")


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


def hold(workdir: str) -> int:
    """Takes the run's lock on `workdir`, or raises ConfigError naming the process that holds it (or saying
    that the directory is not writable, or DiskFull); a refused run leaves no directory or lock file it made.

    The lock is an flock on `run.lock`: the kernel drops it when its holder exits, even by kill -9 or a lost
    machine, so a dead run never blocks the next. Returns the descriptor to keep open for the run's life.
    """
    path = os.path.join(workdir, LOCK_FILE)
    made = _missing(path)
    try:
        # A directory the run cannot write to stops here, before it holds anything.
        require_writable(workdir, f"--workdir {workdir}", "use another --workdir")
        with atomic.writing(path):
            return _lock_run(path, workdir)
    except BaseException:
        _remove(made)
        raise


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


def _missing(path: str) -> list[str]:
    """`path` and the directories above it that do not exist, deepest first."""
    missing, path = [], os.path.abspath(path)
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _remove(paths: list[str]) -> None:
    """Removes what a refused run made, deepest first; a directory something else has written in stays."""
    for path in paths:
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.remove(path)


class Held(Exception):
    """The lock is another process's; the message is what its file says of that process."""


def lock(descriptor: int, about: str = "") -> int:
    """Takes an exclusive flock on the open file `descriptor` and writes this process (and `about`) in it;
    returns the descriptor. Raises Held where another process holds it, OSError where the file system has
    no locks; either way the descriptor is closed."""
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        holder = os.pread(descriptor, 300, 0).decode("utf-8", "replace").strip() or "another process"
        os.close(descriptor)
        if isinstance(error, BlockingIOError):
            raise Held(holder) from None
        raise
    try:
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"pid {os.getpid()} on {socket.gethostname()}, started "
                              f"{time.strftime('%Y-%m-%d %H:%M:%S')}{about}".encode(), 0)
    except OSError:  # a full disk
        os.close(descriptor)
        raise
    return descriptor
