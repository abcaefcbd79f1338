"""Files written so that a kill leaves the old version or the new one, and a full disk says so in one line."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from typing import Iterator

from andrea_jax import UserError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# How tensorstore (under Orbax) reports a failed write: the file, then the OS error.
_TENSORSTORE_NO_SPACE = re.compile(r'Failed writing: "([^"]+)".*(No space left on device|Disk quota exceeded)')


class DiskFull(UserError):
    """A write that found no space; the message names the path, the free space and what to do."""


def disk_full(path: str, needed_bytes: int | None = None) -> DiskFull:
    directory = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(directory):
        directory = os.path.dirname(directory)
    free = f"{shutil.disk_usage(directory).free / 2**20:.1f} MiB free there"
    if needed_bytes is not None:
        free = f"it needs {needed_bytes / 2**20:.1f} MiB, {free}"
    return DiskFull(f"the disk is full: writing {path} ({free}); free some space or point --workdir / "
                    f"data.cache_dir at a larger disk, then run the same command again (training "
                    f"resumes from its last checkpoint)")


def as_disk_full(error: BaseException) -> DiskFull | None:
    """The DiskFull an exception amounts to (an OSError, or Orbax's message for one), else None."""
    for cause in (error, error.__cause__, error.__context__):
        if isinstance(cause, DiskFull):
            return cause
        if isinstance(cause, OSError) and cause.errno in NO_SPACE and cause.filename:
            return disk_full(cause.filename)
        found = _TENSORSTORE_NO_SPACE.search(str(cause)) if cause is not None else None
        if found:
            return disk_full(found.group(1))
    return None


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Turns running out of space inside the block into DiskFull naming `path`."""
    try:
        yield
    except OSError as error:
        if error.errno in NO_SPACE:
            raise disk_full(path) from error
        raise


def write(path: str | os.PathLike, content: str | bytes, temporary_name: str | None = None) -> None:
    """Writes `content` to a temporary file beside `path` (named per process), syncs it, then renames it over `path`.

    `temporary_name`: the temporary file's name in the same directory, for directories whose readers
    take every file whose name resembles `path` (default: `path` + ".tmp<pid>"). On any failure the
    temporary file is removed and `path` is as it was."""
    path = os.fspath(path)
    temporary = os.path.join(os.path.dirname(path), temporary_name or f"{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with writing(path), open(temporary, "wb") as f:
            f.write(content.encode("utf-8") if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())  # else a crash can persist the rename before the content: an empty file
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    os.replace(temporary, path)
    with contextlib.suppress(OSError):  # a filesystem that cannot sync a directory has made the rename all the same
        directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself, so the new version is the one a crash leaves
        finally:
            os.close(directory)
