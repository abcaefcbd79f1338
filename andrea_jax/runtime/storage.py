"""Workdirs on Cloud Storage (`--workdir gs://bucket/path`, docs/cloud_storage.md): checkpoints go to the
bucket through Orbax; every other file is a local file of a working copy, pushed back whole (atomic on Cloud
Storage, which has no rename) through gcsfs, as Orbax's own files; the run's lock is a lease, through
google-cloud-storage's generation preconditions. A local workdir is its own working copy."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import pathlib
import posixpath
import shutil
import socket
import tempfile
import threading
import time

from andrea_jax import UserError, first_line

# Before gcsfs is imported: its experimental zonal-bucket support asks a gRPC service about every bucket, and
# where none answers (an emulator) waits 60 s an operation. Orbax's epath then uses gcsfs also beside TensorFlow.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("EPATH_USE_TF", "false")

SCHEME = "gs://"
LOCK_NAME = "run.lock"
LEASE_S = 120  # a lock not renewed for this long is a dead run's (docs/cloud_storage.md)
RENEW_S = 20
_TIMEOUT_S = 10  # a request of the start-up gives up after this: an unreachable bucket stops a start in seconds
_NOT_PULLED = ("checkpoints/", "checkpoints_unreadable/", "profile/", LOCK_NAME)  # profile/: the traces
_RETRY_PUSH_S = 5

_copies: dict[str, "WorkingCopy"] = {}  # the working copies of gs:// workdirs this process holds, by directory


class StorageError(UserError):
    """A workdir on Cloud Storage that cannot be used; the message names the fix."""


def is_remote(path: str | os.PathLike) -> bool:
    return os.fspath(path).startswith(SCHEME)


def remote_of(path: str | os.PathLike) -> str | None:
    """The gs:// workdir whose working copy `path` is (itself if it is one); None for a local workdir."""
    path = os.fspath(path)
    return path.rstrip("/") if is_remote(path) else getattr(_copies.get(os.path.abspath(path)), "remote", None)


def shown(path: str | os.PathLike) -> str:
    """`path` as the user named it: in a working copy, the same place in its workdir on the bucket."""
    path = os.fspath(path)
    absolute = os.path.abspath(path)
    for local, copy in _copies.items():
        if absolute == local or absolute.startswith(local + os.sep):
            return copy.remote + absolute[len(local):].replace(os.sep, "/")
    return path


def names_in(directory: str) -> list[str]:
    """The names in `directory` (local or gs://); none where it does not exist."""
    fs, root = _filesystem(directory)
    with contextlib.suppress(FileNotFoundError), _explained(directory):
        return [posixpath.basename(name.rstrip("/")) for name in fs.ls(root, detail=False, refresh=True)]
    return []


def exists(path: str) -> bool:
    fs, root = _filesystem(path)
    fs.invalidate_cache(root)  # another writer (Orbax's tensorstore, another process) may have added it
    with _explained(path):
        return fs.exists(root)


def rename(source: str, destination: str) -> None:
    """Moves a file or directory (on Cloud Storage object by object: copy, then delete)."""
    fs, root = _filesystem(source)
    target = _filesystem(destination)[1]
    with _explained(source):
        fs.makedirs(posixpath.dirname(target), exist_ok=True)
        fs.mv(root, target, recursive=True)


def remove_tree(path: str) -> None:
    fs, root = _filesystem(path)
    with contextlib.suppress(FileNotFoundError), _explained(path):
        fs.rm(root, recursive=True)


def _filesystem(url: str):
    import fsspec

    return fsspec.core.url_to_fs(url)


class WorkingCopy:
    """The local files of `workdir`: the directory itself, or for a gs:// workdir a copy in a directory of its
    own, pulled from the bucket when made and pushed back at `close`. `owns(name)` says which files this process
    writes back (the training run's process 0 all of them, another process its own traces, eval.py its report)."""

    def __init__(self, workdir: str, owns=lambda name: False):
        self.remote, self.owns, self.lease, self._closed = remote_of(workdir), owns, None, False
        if self.remote is None:
            self.local = os.fspath(workdir)
            return
        bucket, _, prefix = self.remote[len(SCHEME):].partition("/")
        with _explained(self.remote):  # one listing: no credentials, bucket or network stop the start in seconds
            next(iter(_client(self.remote).list_blobs(bucket, prefix=prefix, max_results=1, retry=_retry(),
                                                      timeout=_TIMEOUT_S)), None)
        self.fs, self.root = _filesystem(self.remote)
        self.local = tempfile.mkdtemp(prefix="andrea_workdir_")
        _copies[os.path.abspath(self.local)] = self
        self._known: dict[str, tuple | None] = {}  # name -> (size, mtime) as last pulled or handed to a push
        self._uploads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="workdir-push")  # in order
        self._last, self.failure = None, None  # the latest push; why the latest write failed, None once one works
        self.pull()

    def __enter__(self) -> "WorkingCopy":
        return self

    def __exit__(self, *failure) -> None:
        self.close()

    @property
    def created(self) -> bool:
        """Whether the workdir held nothing (not even checkpoints) when the copy was made."""
        if self.remote is None:
            return not os.path.lexists(self.local)
        with _explained(self.remote):
            return not [name for name in self.fs.find(self.root) if not name.endswith("/" + LOCK_NAME)]

    def pull(self) -> None:
        """Makes the copy what the bucket holds (all but checkpoints, traces and the lock)."""
        if self.remote is None:
            return
        self.fs.invalidate_cache()  # another process may have pushed since this one listed
        with _explained(self.remote):
            for source in self.fs.find(self.root):
                name = posixpath.relpath(source, self.root)
                if not name.startswith(_NOT_PULLED):
                    target = os.path.join(self.local, name)
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    pathlib.Path(target).write_bytes(self.fs.cat_file(source))
                    self._known[name] = _signature(target)

    def push(self, wait: bool = False) -> None:
        """Hands the files changed since the last push (and the deletions) to the upload thread, read now;
        `wait`: until they are on the bucket, unless writes are failing (training goes on, and a file whose
        write failed goes again with the next push)."""
        if self.remote is None or not os.path.isdir(self.local):
            return
        if self.lease is not None:
            self.lease.check()
        changes = {}
        for name in {*self._local_names(), *self._known}:
            signature = _signature(os.path.join(self.local, name))
            if signature != self._known.get(name) and self.owns(name):
                with contextlib.suppress(FileNotFoundError):  # gone since it was listed
                    changes[name] = pathlib.Path(self.local, name).read_bytes() if signature else None
                    self._known[name] = signature
        if changes:
            self._last = self._uploads.submit(self._write, changes)
        if wait and self._last is not None and self.failure is None:
            concurrent.futures.wait([self._last])

    def _local_names(self) -> list[str]:
        return [os.path.relpath(os.path.join(directory, name), self.local)
                for directory, _, files in os.walk(self.local) for name in files
                if ".tmp" not in name]  # a file being written atomically: its rename comes next

    def _write(self, changes: dict[str, bytes | None]) -> None:
        for index, (name, content) in enumerate(changes.items()):
            target = posixpath.join(self.root, name)
            try:
                if content is None:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(target)
                else:
                    self.fs.pipe_file(target, content)
                self.failure = None
            except Exception as error:  # the bucket unreachable (after gcsfs's retries): the next push sends them
                self.failure = f"{type(error).__name__}: {error}"[:200]
                self._known.update(dict.fromkeys(list(changes)[index:], _UNWRITTEN))
                return

    def close(self) -> None:
        """Pushes what is left (trying for a minute while the bucket fails), then removes the copy; one line
        where files could not be written back, which are then kept in the copy."""
        if self.remote is None or self._closed:
            return
        self._closed, deadline = True, time.monotonic() + 60
        while True:
            self.push(wait=True)
            concurrent.futures.wait([self._last] if self._last else [])
            if _UNWRITTEN not in self._known.values() or time.monotonic() > deadline:
                break
            time.sleep(_RETRY_PUSH_S)
        self._uploads.shutdown()
        _copies.pop(os.path.abspath(self.local), None)
        unwritten = [name for name, signature in self._known.items() if signature is _UNWRITTEN]
        if unwritten:
            raise StorageError(f"{len(unwritten)} files could not be written back to {self.remote} ({self.failure}); "
                               f"they are in {self.local}: copy them with `gcloud storage cp -r {self.local}/* "
                               f"{self.remote}/` before the next run")
        shutil.rmtree(self.local, ignore_errors=True)


_UNWRITTEN = ("unwritten",)  # the signature of a file whose write failed: it differs from the file's own


def _signature(path: str) -> tuple | None:
    with contextlib.suppress(FileNotFoundError):
        status = os.stat(path)
        return status.st_size, status.st_mtime_ns
    return None


# --- The lease -------------------------------------------------------------------------------------------

def hold(path: str):
    """Takes the lease on the gs:// workdir whose working copy `path` is (`Lease`); returns what releases it."""
    copy = _copies[os.path.abspath(path)]
    copy.lease = Lease(copy.remote).acquire()
    return copy.lease.release


class Lease:
    """The run's lock on a gs:// workdir: `run.lock`, an object created only where absent (a generation
    precondition), rewritten every RENEW_S while the run lives on the generation it wrote. One not rewritten
    for LEASE_S, or written by a process of this host that is gone, is a dead run's and is taken over."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        bucket, _, prefix = workdir[len(SCHEME):].partition("/")
        self.blob = _client(workdir).bucket(bucket).blob(posixpath.join(prefix, LOCK_NAME))
        self.text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                "started": time.strftime("%Y-%m-%d %H:%M:%S")})
        self.generation, self.lost = None, None
        self._stopped = threading.Event()

    def acquire(self) -> "Lease":
        from google.api_core import exceptions

        for attempt in range(2):
            try:
                with _explained(self.workdir):
                    self.blob.upload_from_string(self.text, if_generation_match=0, retry=_retry(), timeout=_TIMEOUT_S)
                break
            except exceptions.PreconditionFailed:
                holder, generation, dead = self._holder()
                if attempt or not dead:
                    raise StorageError(
                        f"--workdir {self.workdir} is in use by a training run ({holder}); wait for it to end or "
                        f"stop it (it saves and exits on Ctrl-C or SIGTERM), or use another --workdir; a killed "
                        f"run's lock ends {LEASE_S} s after it last renewed it") from None
                with contextlib.suppress(exceptions.NotFound, exceptions.PreconditionFailed), _explained(self.workdir):
                    self.blob.delete(if_generation_match=generation, retry=_retry(), timeout=_TIMEOUT_S)
        self.generation = self.blob.generation
        threading.Thread(target=self._renew, daemon=True, name="workdir-lease").start()
        return self

    def _holder(self) -> tuple[str, int | None, bool]:
        """(who holds the lock, its generation, whether that run is dead)."""
        from google.api_core import exceptions

        lock = self.blob.bucket.blob(self.blob.name)  # the live object, whichever generation it is
        with _explained(self.workdir):
            try:
                lock.reload(retry=_retry(), timeout=_TIMEOUT_S)  # its generation and when it was written
                text = lock.download_as_text(retry=_retry(), timeout=_TIMEOUT_S)
            except exceptions.NotFound:  # released meanwhile
                return "a run that just ended", None, True
        holder = json.loads(text) if text.startswith("{") else {}
        age = time.time() - lock.updated.timestamp()
        gone = holder.get("host") == socket.gethostname() and not _alive(int(holder.get("pid", 0)))
        about = (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}, "
                 f"lock renewed {age:.0f} s ago")
        return about, lock.generation, gone or age > LEASE_S

    def _renew(self) -> None:
        while not self._stopped.wait(RENEW_S) and self._renew_once():
            pass

    def _renew_once(self) -> bool:
        """Rewrites the lock on the generation this run wrote; False once another run holds it."""
        from google.api_core import exceptions

        try:
            self.blob.upload_from_string(self.text, if_generation_match=self.generation, retry=None,
                                         timeout=_TIMEOUT_S)
            self.generation = self.blob.generation
        except exceptions.PreconditionFailed:
            self.lost = self._holder()[0]
            return False
        except Exception:  # unreachable for now: tried again at the next renewal
            pass
        return True

    def check(self) -> None:
        """Raises where another run took the workdir over (this one could not renew its lock for LEASE_S)."""
        if self.lost is not None:
            raise StorageError(f"the lock on {self.workdir} was taken over by another run ({self.lost}) after this "
                               f"one could not renew it for {LEASE_S} s; this run stops without writing more")

    def release(self) -> None:
        self._stopped.set()
        if self.lost is None:
            with contextlib.suppress(Exception):
                self.blob.delete(if_generation_match=self.generation, retry=None, timeout=_TIMEOUT_S)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        pass
    return pid > 0


def _client(workdir: str):
    from google.cloud import storage

    with _explained(workdir):
        return storage.Client()


def _retry():
    from google.api_core import retry

    return retry.Retry(initial=0.5, maximum=2.0, timeout=_TIMEOUT_S)


@contextlib.contextmanager
def _explained(workdir: str):
    """Turns what Cloud Storage and its clients raise into one StorageError line that names the fix."""
    try:
        yield
    except StorageError:
        raise
    except Exception as error:
        if not is_remote(workdir):  # a local path's errors are its own
            raise
        from google.api_core import exceptions
        from google.auth import exceptions as auth

        bucket = SCHEME + workdir[len(SCHEME):].split("/")[0]
        about = first_line(error)
        if isinstance(error, (auth.DefaultCredentialsError, auth.RefreshError)):
            raise StorageError(f"no Google Cloud credentials for {workdir} ({about}); run `gcloud auth "
                               f"application-default login` (on Colab: `from google.colab import auth; "
                               f"auth.authenticate_user()`), then the same command") from None
        if isinstance(error, (exceptions.Forbidden, exceptions.Unauthorized, PermissionError)):
            raise StorageError(f"permission denied on {workdir} ({about}); give the account roles/storage."
                               f"objectAdmin on {bucket} (objectViewer to only read it)") from None
        if isinstance(error, FileNotFoundError):  # an object that is not there: the caller's to handle
            raise
        if isinstance(error, exceptions.NotFound):
            raise StorageError(f"the bucket {bucket} does not exist ({about}); create it (`gcloud storage buckets "
                               f"create {bucket}`) or correct --workdir") from None
        if isinstance(error, (exceptions.RetryError, exceptions.ServiceUnavailable, ConnectionError, TimeoutError,
                              OSError)) or "connect" in about.lower():
            raise StorageError(f"{workdir} cannot be reached ({about}); check the network, then run the same "
                               f"command") from None
        raise
