"""Local text files as documents: `text:` (a file, a directory walked, or a glob), `stdlib`, and
`url:`, a file downloaded once into the data cache.

Each file is one document, read when asked, in sorted path order; bytes that
are not UTF-8 read as U+FFFD. TFDS is only for `tfds:` sources.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
import urllib.parse
import urllib.request
from typing import Callable, Sequence

from andrea_jax.runtime import atomic
from andrea_jax.data import DataError

# What a directory source reads; a glob reads whatever it matches.
TEXT_SUFFIXES = frozenset(
    ".txt .md .rst .tex .py .pyi .c .h .cc .cpp .hpp .cu .java .kt .scala .js .ts .go "
    ".rs .rb .jl .lua .sh .sql .html .css .json .yaml .yml .toml".split())
# Directories that hold tests or installed packages, not the standard library.
STDLIB_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
DOWNLOAD_TIMEOUT_S = 60


def walk(root: str, keep: Callable[[str], bool], skipped: frozenset = frozenset()) -> list[str]:
    """Sorted paths of the files under `root` whose names `keep` takes; hidden and `skipped` directories left out."""
    found = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in skipped and not d.startswith(".")]
        found += [os.path.join(directory, n) for n in names if keep(n)]
    return sorted(found)


def _is_text_file(path: str) -> bool:
    """Readable, non-empty, and no NUL byte near the start (binary files have them)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
    except OSError:
        return False
    return bool(head) and b"\0" not in head


def _keep_text_files(paths: Sequence[str], described: str) -> list[str]:
    if not paths:
        raise DataError(f"{described} matches no files; point data.source at .txt/.md/code files")
    readable = [p for p in paths if _is_text_file(p)]
    if readable:
        return readable
    if all(os.path.isfile(p) and os.path.getsize(p) == 0 for p in paths):
        raise DataError(f"{described} is an empty corpus ({len(paths)} empty files); add text to it")
    raise DataError(f"{described} has no readable text ({len(paths)} files are binary or unreadable); "
                    f"point data.source at text files")


def list_text_files(path_or_glob: str) -> tuple[str, list[str]]:
    """(root, sorted text files) of a file, a directory (walked) or a glob."""
    path = os.path.abspath(os.path.expanduser(path_or_glob))
    if os.path.isfile(path):
        return os.path.dirname(path), _keep_text_files([path], path_or_glob)
    if os.path.isdir(path):
        found = walk(path, lambda name: os.path.splitext(name)[1].lower() in TEXT_SUFFIXES)
        return path, _keep_text_files(found, f"directory {path_or_glob!r}")
    matches = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
    files = _keep_text_files(matches, f"text source {path_or_glob!r}")
    root = os.path.commonpath(matches)
    return (os.path.dirname(root) if os.path.isfile(root) else root), files


def list_stdlib_files() -> tuple[str, list[str]]:
    """(root, sorted .py files) of this Python's standard library, without its tests."""
    root = sysconfig.get_paths()["stdlib"]
    found = walk(root, lambda name: name.endswith(".py"), STDLIB_SKIPPED_DIRS)
    return root, _keep_text_files(found, f"standard library {root!r}")


def download(url: str, cache_dir: str) -> str:
    """The copy of `url` in `<cache_dir>/downloads/`, fetched on first use, whole, then renamed into place."""
    name = os.path.basename(urllib.parse.urlparse(url).path) or "download"
    path = os.path.join(cache_dir, "downloads", hashlib.sha256(url.encode("utf-8")).hexdigest()[:16], name)
    if os.path.exists(path):
        return path
    print(f"downloading {url} to {path}", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            content = response.read()
    except (OSError, ValueError) as error:  # offline, refused, timed out, HTTP errors, a malformed URL
        raise DataError(f"cannot download {url} ({getattr(error, 'reason', error)}); without a network, "
                        f"point data.source at a local copy: --config.data.source=text:PATH") from None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic.write(path, content)
    return path


def fingerprint(root: str, files: Sequence[str]) -> str:
    """Identity of a file set: names, sizes and modification times (cheap, no reads)."""
    digest = hashlib.sha256()
    for path in files:
        status = os.stat(path)
        digest.update(f"{os.path.relpath(path, root)}\t{status.st_size}\t{status.st_mtime_ns}\n"
                      .encode("utf-8", "replace"))
    return digest.hexdigest()[:20]


class FileTexts(list):
    """The files, as records {"text": a file's contents} of a data source `sources.DataSourceDocuments` reads."""

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        records = []
        for index in indices:
            with open(self[index], encoding="utf-8", errors="replace", newline="") as f:
                records.append({"text": f.read()})
        return records
