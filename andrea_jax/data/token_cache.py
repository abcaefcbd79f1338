"""Documents encoded once into a flat uint16 token file per split + a JSON manifest.

Layout: `<cache_dir>/tokens/<key>/<split>.bin` and `<split>.json`, where the key
hashes the source identity, the tokenizer and the format, so a changed source
or tokenizer gets a new cache. The token file is written as `<split>.bin.tmp`
and renamed into place before the manifest is written, so a killed build never
leaves a cache that looks complete; a cache whose size disagrees with its
manifest is rebuilt. The file grows in recorded chunks (`<split>.progress.json`), so a build
that is killed, loses its connection or runs out of retries goes on from its last finished chunk,
and a stream from where that chunk ended. Builds of one split take turns through a lock file
(`<split>.lock`, flock): a second run on the same cache waits for the first
one's build and reads it, instead of overwriting its half-written file. flock
holds across the processes of one machine and on file systems that implement
it (local disks, NFS with locking); GCS FUSE grants it per machine, so runs on
different machines sharing a bucket still must not build the same cache at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import shutil
import sys
import time

import numpy as np
import tqdm

from andrea_jax.runtime import atomic
from andrea_jax.data import DataError
from andrea_jax.data.sources import Documents, StreamedDocuments
from andrea_jax.data.tokenizer import Tokenizer

FORMAT_VERSION = 1
TOKEN_DTYPE = np.uint16
TOKEN_BYTES = np.dtype(TOKEN_DTYPE).itemsize
_TARGET_BATCH_BYTES = 4 << 20  # documents per read: about this much text
# A build records its progress every this many tokens (128 MB of uint16): a killed one loses at most
# that much encoding, minutes of one core on English text.
CHUNK_TOKENS = 1 << 26
_ESTIMATE_AFTER_BYTES = 16 << 20  # text encoded before the start-up's estimate of the build's time


@dataclasses.dataclass(frozen=True)
class TokenSplit:
    tokens: np.ndarray  # uint16, read-only memmap; documents end with end-of-text
    num_tokens: int
    num_bytes: int  # UTF-8 bytes of the split's text, for bits per byte
    manifest: dict
    path: str


def cache_directory(cache_dir: str, identity: dict, tokenizer_sha256: str) -> str:
    """`<cache_dir>/tokens/<key>`, the key a hash of the source identity, the tokenizer and the format."""
    content = json.dumps({"identity": identity, "tokenizer": tokenizer_sha256,
                          "format": FORMAT_VERSION}, sort_keys=True)
    return os.path.join(cache_dir, "tokens", hashlib.sha256(content.encode("utf-8")).hexdigest()[:20])


def _paths(directory: str, split: str) -> tuple[str, str]:
    return os.path.join(directory, f"{split}.bin"), os.path.join(directory, f"{split}.json")


def load(directory: str, split: str) -> tuple[TokenSplit | None, str]:
    """(the cached split, "") or (None, why it cannot be used; "" when there is none). The format
    and the tokenizer need no check: the directory's key holds them."""
    tokens_path, manifest_path = _paths(directory, split)
    if not os.path.exists(manifest_path):
        return None, ""
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
        num_tokens, num_bytes = int(manifest["num_tokens"]), int(manifest["num_bytes"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"unreadable manifest ({error})"
    expected = num_tokens * TOKEN_BYTES
    size = os.path.getsize(tokens_path) if os.path.exists(tokens_path) else -1
    if size != expected:
        return None, f"token file has {size} bytes, manifest says {expected}"
    tokens = np.memmap(tokens_path, dtype=TOKEN_DTYPE, mode="r", shape=(num_tokens,))
    return TokenSplit(tokens, num_tokens, num_bytes, manifest, tokens_path), ""


def _encode_with_separators(tokenizer: Tokenizer, texts: list[str], budget: int) -> tuple[np.ndarray, int, int]:
    """(tokens, UTF-8 bytes, texts used): each non-empty text's tokens and then end-of-text, the first
    `budget` of them: the text they end in is cut, and counts the bytes its kept tokens decode to."""
    pieces, num_tokens, num_bytes, used = [], 0, 0, 0
    # Without an end-of-text token (nanoGPT's char vocabulary) documents just abut, as in nanoGPT.
    separator = [] if tokenizer.eot_id is None else [np.array([tokenizer.eot_id], np.int32)]
    encoded = iter(tokenizer.encode_arrays([t for t in texts if t]))
    for used, text in enumerate(texts, 1):
        if not text:  # empty documents add nothing
            continue
        ids, room = next(encoded), budget - num_tokens
        if ids.size + len(separator) > room:  # the budget ends inside this text
            pieces.append(ids[:room])
            num_bytes += len(tokenizer.decode(ids[:room].tolist()).encode("utf-8"))
            break
        pieces += [ids, *separator]
        num_tokens += ids.size + len(separator)
        num_bytes += len(text.encode("utf-8"))
        if num_tokens >= budget:
            break
    ids = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    if ids.size and ids.max() >= tokenizer.vocab_size:  # ids are never negative
        raise DataError(f"the tokenizer produced id {ids.max()}, outside its vocabulary of "
                        f"{tokenizer.vocab_size}; its tokenizer.json is inconsistent, use another")
    return ids.astype(TOKEN_DTYPE), num_bytes, used


def _progress_path(directory: str, split: str) -> str:
    return os.path.join(directory, f"{split}.progress.json")


def _finished_chunks(directory: str, split: str, max_tokens: int) -> dict:
    """What an unfinished build of the split wrote and recorded: its tokens, bytes, documents and the
    stream's state after them (nothing, if there is no usable record)."""
    nothing = {"num_tokens": 0, "num_bytes": 0, "num_documents": 0, "stream_state": None, "dataset_revision": None}
    temporary = f"{_paths(directory, split)[0]}.tmp"
    try:
        with open(_progress_path(directory, split), encoding="utf-8") as f:
            finished = json.load(f)
        recorded = {key: finished.get(key) for key in nothing}  # records before dataset_revision have none
        size = os.path.getsize(temporary)
    except (OSError, ValueError, KeyError, TypeError):
        return nothing
    fits = size >= int(recorded["num_tokens"]) * TOKEN_BYTES
    return recorded if fits and finished.get("max_tokens") == max_tokens else nothing


def tokens_on_disk(cache_dir: str, identity: dict, split: str = "train") -> int:
    """The most tokens of `split` of this source that a cache under `cache_dir` holds, whole or in finished
    chunks, whatever its tokenizer: before a new tokenizer exists, what a build need not write again."""
    found = 0
    for directory in glob.glob(os.path.join(cache_dir, "tokens", "*")):
        for path in (_paths(directory, split)[1], _progress_path(directory, split)):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                with open(path, encoding="utf-8") as f:
                    record = json.load(f)
                if record["source"] == identity:
                    found = max(found, int(record["num_tokens"]))
    return found


def hf_stream_moved(described: str, recorded: str | None, now: str | None, fix: str) -> DataError:
    return DataError(f"{described} moved from commit {recorded} to {now} since this cache began; {fix}")


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


def _encode_into(out, documents: Documents, tokenizer: Tokenizer, split: str, progress: bool,
                 max_tokens: int, finished: dict, commit) -> tuple[int, int, int]:
    """Writes the split's tokens (with max_tokens, its first max_tokens) to `out`, going on after the
    `finished` part, and calls `commit` with what is written at each CHUNK_TOKENS; returns the
    (tokens, UTF-8 bytes, documents) written. An empty read is the end of the split: a stream's
    length is only a bound."""
    budget = max_tokens or sys.maxsize
    num_tokens, num_bytes, position = (int(finished[key]) for key in ("num_tokens", "num_bytes", "num_documents"))
    committed, started_tokens, started_bytes, estimated = num_tokens, num_tokens, num_bytes, not max_tokens
    if position and isinstance(documents, StreamedDocuments):
        recorded, now = finished["dataset_revision"], documents.revision()
        if recorded is not None and recorded != now:  # None: local files, or a record older than the check
            raise hf_stream_moved(documents.described, recorded, now,
                                  f"delete {out.name} and run again to build the cache from the new commit")
        documents.resume(position, finished["stream_state"])
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(1) as reader, \
            tqdm.tqdm(total=max_tokens or len(documents), initial=num_tokens if max_tokens else position,
                      unit="tok" if max_tokens else "doc", disable=not progress, desc=f"tokenizing {split}") as bar:

        def read_next(unencoded: int):
            """Starts reading after `position`, while the `unencoded` documents before it are encoded:
            about _TARGET_BATCH_BYTES of text, and at most half of what the budget's rest seems to
            need (the first documents' sizes may mislead), so the reads close in on its end."""
            count, encoded = 16, position - unencoded
            if num_tokens:
                left = (budget - num_tokens) * encoded / num_tokens - unencoded  # documents, guessed
                count = int(np.clip(min(_TARGET_BATCH_BYTES * encoded / max(num_bytes, 1), left / 2), 1, 65536))
            return reader.submit(documents.read, position, min(position + count, len(documents)))

        pending = read_next(0)
        while texts := pending.result():
            position += len(texts)
            pending = read_next(len(texts))  # read the next batch while this one is encoded
            ids, size, used = _encode_with_separators(tokenizer, texts, budget - num_tokens)
            out.write(ids.tobytes())
            num_tokens += ids.size
            num_bytes += size
            bar.update(ids.size if max_tokens else len(texts))
            seconds = max(time.perf_counter() - started, 1e-9)
            rate = (num_bytes - started_bytes) / seconds  # text bytes a second
            bar.set_postfix_str(f"{rate / 1e6:.1f} MB/s, {(num_tokens - started_tokens) / seconds / 1e6:.2f} Mtok/s")
            if num_tokens >= budget:
                position -= len(texts) - used  # what was read ahead goes unused
                break
            if not estimated and num_bytes - started_bytes >= _ESTIMATE_AFTER_BYTES:
                estimated = True
                text_left = (budget - num_tokens) * num_bytes / num_tokens
                seconds_left = text_left / rate
                duration = (f"{seconds_left / 3600:.1f} hours" if seconds_left >= 3600
                            else f"{seconds_left / 60:.0f} minutes")
                print(f"the {split} split has {budget - num_tokens:,} tokens left to encode, about "
                      f"{text_left / 1e9:.2f} GB of text at its {num_bytes / num_tokens:.2f} bytes a token so far; "
                      f"at this machine's {rate / 1e6:.1f} MB/s that takes about {duration}", flush=True)
            if num_tokens - committed >= CHUNK_TOKENS:
                committed = num_tokens
                streamed = isinstance(documents, StreamedDocuments)
                commit({"num_tokens": num_tokens, "num_bytes": num_bytes, "num_documents": position,
                        "stream_state": documents.state_at(position) if streamed else None,
                        "dataset_revision": documents.revision() if streamed else None})
    return num_tokens, num_bytes, position


def build(documents: Documents, tokenizer: Tokenizer, directory: str, split: str,
          identity: dict, progress: bool = True, max_tokens: int = 0) -> TokenSplit:
    """Encodes every non-empty document, end-of-text after each (if the tokenizer has one), into the cache.

    With max_tokens, the split stops at exactly that many tokens (the last document cut), and the
    documents after it are not read. The token file grows in chunks of CHUNK_TOKENS, each made
    durable and recorded (`<split>.progress.json`) before the next: a build killed at any moment
    goes on from its last recorded chunk, and ends with the same bytes as one never stopped."""
    if tokenizer.vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise DataError(f"a vocabulary of {tokenizer.vocab_size} does not fit the uint16 token "
                        f"cache (at most 65536); use a smaller tokenizer")
    finished = _finished_chunks(directory, split, max_tokens)
    # A source's size in tokens is known before only for a budget; its finished chunks are on disk already.
    require_space(directory, (max_tokens - finished["num_tokens"]) * TOKEN_BYTES if max_tokens else 0)
    os.makedirs(directory, exist_ok=True)
    tokens_path, manifest_path = _paths(directory, split)
    progress_path = _progress_path(directory, split)
    with contextlib.suppress(FileNotFoundError):
        os.remove(manifest_path)  # the old cache stops looking complete first
    if finished["num_tokens"]:
        print(f"going on with the token cache {tokens_path} after its {finished['num_tokens']:,} finished "
              f"tokens ({finished['num_documents']:,} documents)", flush=True)
    started = time.perf_counter()
    temporary = f"{tokens_path}.tmp"

    def commit(written: dict) -> None:
        out.flush()
        os.fsync(out.fileno())
        atomic.write(progress_path, json.dumps({**written, "max_tokens": max_tokens, "source": identity}))

    try:
        with atomic.writing(tokens_path), open(temporary, "r+b" if finished["num_tokens"] else "wb") as out:
            out.truncate(finished["num_tokens"] * TOKEN_BYTES)  # what followed the last chunk
            out.seek(0, os.SEEK_END)
            num_tokens, num_bytes, num_documents = _encode_into(out, documents, tokenizer, split, progress,
                                                                 max_tokens, finished, commit)
            out.flush()
            os.fsync(out.fileno())
        if num_tokens == 0:
            raise DataError(no_text(split))
    except BaseException:  # a failed build leaves only its finished chunks behind
        if not os.path.exists(progress_path):
            with contextlib.suppress(FileNotFoundError):  # `open` itself may have failed
                os.remove(temporary)
        raise
    if num_tokens < max_tokens:
        print(f"note: the {split} split ends after {num_tokens:,} tokens, fewer than the "
              f"{max_tokens:,} asked for; the run repeats its text more often", flush=True)
    os.replace(temporary, tokens_path)
    manifest = {
        "format_version": FORMAT_VERSION, "split": split, "source": identity,
        "tokenizer_sha256": tokenizer.sha256, "tokenizer_kind": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
        "dtype": np.dtype(TOKEN_DTYPE).name, "num_tokens": num_tokens, "num_bytes": num_bytes,
        "num_documents": num_documents, "max_tokens": max_tokens, "build_seconds": round(time.perf_counter() - started, 3),
    }
    atomic.write(manifest_path, json.dumps(manifest, indent=1))
    with contextlib.suppress(FileNotFoundError):
        os.remove(progress_path)
    return load(directory, split)[0]  # as the next run will read it


def load_or_build(documents: Documents, tokenizer: Tokenizer, directory: str, split: str,
                  identity: dict, progress: bool = True, max_tokens: int = 0) -> TokenSplit:
    cached, _ = load(directory, split)
    if cached is not None:  # the common case, lock-free (the cache may sit on a read-only disk)
        return cached
    os.makedirs(directory, exist_ok=True)
    tokens_path = _paths(directory, split)[0]
    # The lock goes with the open file, so a killed build never leaves it held. Where there is no
    # lock to take (a lock file another user owns, a file system without flock) the build goes
    # ahead unguarded, as it did before locks.
    with contextlib.ExitStack() as turn:
        try:
            lock = turn.enter_context(open(os.path.join(directory, f"{split}.lock"), "a"))
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process to finish the token cache {tokens_path}", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            pass
        cached, problem = load(directory, split)  # another process may have built it
        if cached is not None:
            return cached
        if problem:
            print(f"token cache {tokens_path} is unusable ({problem}); rebuilding")
        amount = f"'s first {max_tokens:,} tokens ({max_tokens * TOKEN_BYTES / 1e9:.2f} GB)" if max_tokens else ""
        print(f"encoding the {split} split{amount} into the token cache {tokens_path}", flush=True)
        return build(documents, tokenizer, directory, split, identity, progress, max_tokens)
