"""Token files: documents encoded once into a flat uint16 file + a JSON manifest written last.

Every cache lives in `<cache_dir>/tokens/<key>/`, the key a hash of the source identity, the
tokenizer and the format, so a changed source or tokenizer gets a new directory. `encode` writes a
stretch of a split's token stream (an era: `eras.py`) as `<file>.tmp`, renames it into place and
returns the manifest, which its caller writes last: a killed build never leaves a file that looks
complete. The manifest holds the file's size and CRC-32, taken as the file is written: a file shortened
since is found when it is read, one overwritten since when it is read with its checksum (an era, as the
training loop opens it). `load_or_build` makes a whole split one file, built once and shared by the runs
of its source (validation, and training splits read before the first step), taking turns through a
lock file (flock: local disks, NFS with locking; GCS FUSE grants it per machine only); every start
checks it by its manifest and size, not by a read of the whole file.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
import zlib

import numpy as np

from andrea_jax import run_dir
from andrea_jax.runtime import atomic
from andrea_jax.data import DataError
from andrea_jax.data.sources import Documents
from andrea_jax.data.tokenizer import Tokenizer

FORMAT_VERSION = 1
TOKEN_DTYPE = np.uint16
TOKEN_BYTES = np.dtype(TOKEN_DTYPE).itemsize
START = {"document": 0, "token": 0, "state_position": 0, "state": None}  # where a split's token stream begins
_TARGET_READ_BYTES = 4 << 20  # text a read of the documents brings, about


@dataclasses.dataclass(frozen=True)
class TokenSplit:
    tokens: np.ndarray  # uint16, read-only memmap; documents end with end-of-text
    num_tokens: int
    num_bytes: int  # UTF-8 bytes of the split's text, for bits per byte
    path: str


def cache_directory(cache_dir: str, identity: dict, tokenizer_sha256: str) -> str:
    """`<cache_dir>/tokens/<key>`, the key a hash of the source identity, the tokenizer and the format."""
    content = json.dumps({"identity": identity, "tokenizer": tokenizer_sha256,
                          "format": FORMAT_VERSION}, sort_keys=True)
    return os.path.join(cache_dir, "tokens", hashlib.sha256(content.encode("utf-8")).hexdigest()[:20])


def require_writable(directory: str) -> None:
    """Makes a token cache's directory (`cache_directory`'s, two levels under data.cache_dir) and writes in it,
    or stops in one line naming data.cache_dir, as --workdir's are named."""
    cache_dir = os.path.dirname(os.path.dirname(directory))
    run_dir.require_writable(directory, f"data.cache_dir {cache_dir}", "point data.cache_dir at another directory")


def no_text(split: str) -> str:
    return (f"the {split} split has no text (0 tokens); add text to the source, or hold out "
            f"{'less' if split == 'train' else 'more'} of it for validation (data.val_fraction; "
            f"data.stream_val_documents for hf:)")


def require_space(directory: str, needed_bytes: int) -> None:
    """Stops a build the disk cannot hold before it streams anything."""
    existing = os.path.abspath(directory)  # a relative path's dirname ends in "", not "/"
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    if needed_bytes > free:
        size = lambda count: f"{count / 1e9:.2f} GB" if count >= 1e8 else f"{count / 1e6:.2f} MB"
        raise atomic.DiskFull(f"the token cache needs {size(needed_bytes)} more in {directory} and {size(free)} "
                              f"is free there; point data.cache_dir at a larger disk, free space, or lower "
                              f"data.stream_tokens")


def crc32(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    crc = 0
    for start in range(0, tokens.size, chunk):
        crc = zlib.crc32(tokens[start:start + chunk], crc)
    return crc


def read(tokens_path: str, manifest_path: str, fix: str, described: str = "",
         checksum: bool = False) -> TokenSplit | None:
    """The file's tokens (a read-only memmap) once its manifest is written, else None; a file that is not what
    its manifest describes (shortened, removed or, `checksum` checked, overwritten since) is a DataError about
    `described` (default: the file) ending in `fix`.

    The checksum reads the whole file: an era is checked as it is opened, while a shared one-file cache,
    which every process of every run opens at its start, is checked by its manifest and its size."""
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None  # not encoded yet (the manifest is written after the tokens)
    except (OSError, ValueError):
        manifest = None
    num_tokens = manifest.get("num_tokens") if isinstance(manifest, dict) else None
    size = os.path.getsize(tokens_path) if os.path.exists(tokens_path) else 0
    if not isinstance(num_tokens, int):
        found = "its manifest unreadable"
    elif size != num_tokens * TOKEN_BYTES:
        found = f"{size:,} bytes of tokens where its manifest says {num_tokens * TOKEN_BYTES:,}"
    else:
        tokens = np.memmap(tokens_path, dtype=TOKEN_DTYPE, mode="r", shape=(num_tokens,))
        if not checksum or "crc32" not in manifest or crc32(tokens) == manifest["crc32"]:  # older files have none
            return TokenSplit(tokens, num_tokens, int(manifest.get("num_bytes", 0)), tokens_path)
        found = "tokens that are not those its manifest's checksum describes"
    raise DataError(f"{described or tokens_path} was changed after it was encoded ({found}); {fix}")


def _encode_documents(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Each text's tokens and then end-of-text (none for an empty text, nor without an end-of-text token:
    nanoGPT's char vocabulary, where documents just abut)."""
    separator = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
    encoded = iter(tokenizer.encode_arrays([t for t in texts if t]))
    arrays = [np.concatenate([next(encoded), np.array(separator, np.int32)]) if text else np.zeros(0, np.int32)
              for text in texts]
    largest = max((int(ids.max()) for ids in arrays if ids.size), default=0)
    if largest >= tokenizer.vocab_size:  # ids are never negative
        raise DataError(f"the tokenizer produced id {largest}, outside its vocabulary of "
                        f"{tokenizer.vocab_size}; its tokenizer.json is inconsistent, use another")
    return arrays


def encode(tokens_path: str, documents: Documents, tokenizer: Tokenizer, start: dict,
           length: int) -> tuple[dict | None, dict]:
    """Encodes at most `length` tokens of the documents' token stream from `start` (where a stretch begins:
    the document, the token inside it, a stream's state at or before it) into `tokens_path`. Returns (where
    the next stretch starts, or None where the documents ended; the manifest, for the caller to write)."""
    if tokenizer.vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise DataError(f"a vocabulary of {tokenizer.vocab_size} does not fit the uint16 token "
                        f"cache (at most 65536); use a smaller tokenizer")
    temporary = f"{tokens_path}.tmp"
    started = time.perf_counter()
    state_position, state = int(start["state_position"]), start["state"]
    position, skip = int(start["document"]), int(start["token"])
    documents.resume(state_position, state)
    written = num_bytes = checksum = text_bytes = 0
    next_start, first_document, per_read = None, position, 16
    try:
        with atomic.writing(tokens_path), open(temporary, "wb") as out, \
                concurrent.futures.ThreadPoolExecutor(1) as reader:
            pending = reader.submit(documents.read, position, position + per_read)
            while next_start is None and (texts := pending.result()):
                read_at, read_state = position, (state if position == state_position else documents.state_at(position))
                if read_state is not None or position == 0:
                    state_position, state = read_at, read_state
                position += len(texts)
                text_bytes += sum(len(t.encode("utf-8")) for t in texts)
                # The next read, while this one is encoded: about _TARGET_READ_BYTES of text, and at most half of
                # the documents the rest seems to need (the first ones may mislead), closing in on the stretch's end.
                encoded = position - first_document - len(texts)  # the documents `written` holds, about
                documents_left = (length - written) * encoded / written - len(texts) if written else 2 * len(texts)
                per_read = int(np.clip(min(_TARGET_READ_BYTES * (encoded + len(texts)) / max(text_bytes, 1),
                                           documents_left / 2), 1, 65536))
                pending = reader.submit(documents.read, position, min(position + per_read, len(documents)))
                for index, ids in enumerate(_encode_documents(tokenizer, texts)):
                    taken = ids[skip:skip + length - written]
                    chunk = taken.astype(TOKEN_DTYPE).tobytes()
                    out.write(chunk)
                    checksum = zlib.crc32(chunk, checksum)
                    written += taken.size
                    num_bytes += len(tokenizer.decode(taken.tolist()).encode("utf-8")) \
                        if skip or taken.size < ids.size else len(texts[index].encode("utf-8"))
                    if written == length:  # the stretch ends here: the next one starts with this document's rest
                        cut = skip + taken.size
                        document = read_at + index + (cut == ids.size)
                        next_start = {"document": document, "token": 0 if cut == ids.size else cut,
                                      "state_position": state_position, "state": state}
                        break
                    skip = 0
            pending.cancel()
            out.flush()
            os.fsync(out.fileno())
    except BaseException:  # a failed build leaves no file behind
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise
    if written == 0:  # the documents ended where this stretch would start
        os.remove(temporary)
    else:
        os.replace(temporary, tokens_path)
    seconds = time.perf_counter() - started
    return next_start, {"num_tokens": written, "crc32": checksum, "num_bytes": num_bytes,
                        "build_seconds": round(seconds, 3), "tokens_per_second": round(written / max(seconds, 1e-9)),
                        "start": start, "tokenizer_sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size}


def load_or_build(directory: str, name: str, documents: Documents, tokenizer: Tokenizer, split: str,
                  max_tokens: int = 0) -> TokenSplit:
    """The whole split (with max_tokens, its first max_tokens) as the one file `<directory>/<name>.bin`, encoded
    if it is not there; a file that no longer matches its manifest is encoded again."""
    tokens_path, manifest_path = (os.path.join(directory, f"{name}.{ending}") for ending in ("bin", "json"))
    rebuild = "it is encoded again"
    with contextlib.suppress(DataError):
        if (cached := read(tokens_path, manifest_path, rebuild)) is not None:
            return cached  # the common case, lock-free (the cache may sit on a read-only disk)
    require_space(directory, max_tokens * TOKEN_BYTES)  # a finite split's size is known only once encoded
    if not os.path.exists(manifest_path):  # nothing there to read: a new file (a changed one is said below)
        require_writable(directory)
    os.makedirs(directory, exist_ok=True)
    # The lock goes with the open file, so a killed build never leaves it held. Where there is no
    # lock to take (a lock file another user owns, a file system without flock) the build goes
    # ahead unguarded, as it did before locks.
    with contextlib.ExitStack() as turn:
        try:
            lock = turn.enter_context(open(os.path.join(directory, f"{name}.lock"), "a"))
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process to finish the token cache {tokens_path}", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            pass
        try:
            if (cached := read(tokens_path, manifest_path, rebuild)) is not None:  # another process built it
                return cached
        except DataError as error:
            if not os.access(directory, os.W_OK):
                raise DataError(f"{error.args[0].split(';')[0]}, in a directory this process cannot write; make "
                                f"{directory} writable or point data.cache_dir elsewhere") from None
            print(f"{error}", flush=True)
            with contextlib.suppress(FileNotFoundError):
                os.remove(manifest_path)  # the file stops looking complete first
        amount = f"'s first {max_tokens:,} tokens ({max_tokens * TOKEN_BYTES / 1e9:.2f} GB)" if max_tokens else ""
        print(f"encoding the {split} split{amount} into the token cache {tokens_path}", flush=True)
        _, manifest = encode(tokens_path, documents, tokenizer, START, max_tokens or sys.maxsize)
        if manifest["num_tokens"] == 0:
            raise DataError(no_text(split))
        if manifest["num_tokens"] < max_tokens:
            print(f"note: the {split} split ends after {manifest['num_tokens']:,} tokens, fewer than the "
                  f"{max_tokens:,} asked for; the run repeats its text more often", flush=True)
        atomic.write(manifest_path, json.dumps({"split": split, **manifest}, indent=1))
        return read(tokens_path, manifest_path, rebuild)  # its checksum was computed from the tokens written
