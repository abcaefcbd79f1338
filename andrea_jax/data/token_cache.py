"""Documents encoded once into a flat uint16 token file per split + a JSON manifest.

Layout: `<cache_dir>/tokens/<key>/<split>.bin` and `<split>.json`, where the key
hashes the source identity, the tokenizer and the format, so a changed source
or tokenizer gets a new cache. The token file is renamed into place before the
manifest is written, so a killed build never leaves a cache that looks complete;
a cache whose size disagrees with its manifest is rebuilt. Builds of one split
take turns through a lock file (`<split>.lock`, flock): a second run on the same
cache waits for the first one's build and reads it, instead of deleting its
half-written file and building its own. flock holds across the processes of one
machine and on file systems that implement it (local disks, NFS with locking);
GCS FUSE grants it per machine, so runs on different machines sharing a bucket
still must not build the same cache at once.
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
import time

import numpy as np
import tqdm

from andrea_jax.runtime import atomic
from andrea_jax.data import DataError
from andrea_jax.data.sources import Documents
from andrea_jax.data.tokenizer import Tokenizer

FORMAT_VERSION = 1
TOKEN_DTYPE = np.uint16
_TARGET_BATCH_BYTES = 4 << 20  # documents per encode call: about this much text


@dataclasses.dataclass(frozen=True)
class TokenSplit:
    tokens: np.ndarray  # uint16, read-only memmap; documents end with end-of-text
    num_tokens: int
    num_bytes: int  # UTF-8 bytes of the split's text, for bits per byte
    manifest: dict
    path: str


def cache_key(identity: dict, tokenizer_sha256: str) -> str:
    content = json.dumps({"identity": identity, "tokenizer": tokenizer_sha256,
                          "format": FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(content.encode("utf-8")).hexdigest()[:20]


def cache_directory(cache_dir: str, identity: dict, tokenizer_sha256: str) -> str:
    return os.path.join(cache_dir, "tokens", cache_key(identity, tokenizer_sha256))


def _paths(directory: str, split: str) -> tuple[str, str]:
    return os.path.join(directory, f"{split}.bin"), os.path.join(directory, f"{split}.json")


def load(directory: str, split: str, tokenizer_sha256: str) -> tuple[TokenSplit | None, str]:
    """(the cached split, "") or (None, why it cannot be used; "" when there is none)."""
    tokens_path, manifest_path = _paths(directory, split)
    if not os.path.exists(manifest_path):
        return None, ""
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
        num_tokens = int(manifest["num_tokens"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"unreadable manifest ({error})"
    if manifest.get("format_version") != FORMAT_VERSION:
        return None, f"format version {manifest.get('format_version')}, expected {FORMAT_VERSION}"
    if manifest.get("tokenizer_sha256") != tokenizer_sha256:
        return None, "made by another tokenizer"
    expected = num_tokens * np.dtype(TOKEN_DTYPE).itemsize
    size = os.path.getsize(tokens_path) if os.path.exists(tokens_path) else -1
    if size != expected or num_tokens < 1:
        return None, f"token file has {size} bytes, manifest says {expected}"
    tokens = np.memmap(tokens_path, dtype=TOKEN_DTYPE, mode="r", shape=(num_tokens,))
    return TokenSplit(tokens, num_tokens, int(manifest["num_bytes"]), manifest, tokens_path), ""


def _encode_with_separators(tokenizer: Tokenizer, texts: list[str],
                            budget: int | None = None) -> tuple[np.ndarray, int, int]:
    """(tokens, UTF-8 bytes, texts used): each non-empty text's tokens and then end-of-text.

    With a budget, only the first `budget` tokens: the text they end in is cut, and counts the
    bytes its kept tokens decode to.
    """
    pieces, num_tokens, num_bytes, used = [], 0, 0, 0
    # Without an end-of-text token (nanoGPT's char vocabulary) documents just abut, as in nanoGPT.
    separator = [] if tokenizer.eot_id is None else [np.array([tokenizer.eot_id], np.int32)]
    encoded = iter(tokenizer.encode_arrays([t for t in texts if t]))
    for used, text in enumerate(texts, 1):
        if not text:  # empty documents add nothing
            continue
        ids = next(encoded)
        if budget is not None and num_tokens + ids.size + len(separator) > budget:
            ids = ids[:budget - num_tokens]
            pieces.append(ids)
            num_tokens += ids.size
            num_bytes += len(tokenizer.decode(ids.tolist()).encode("utf-8"))
            break
        pieces += [ids, *separator]
        num_tokens += ids.size + len(separator)
        num_bytes += len(text.encode("utf-8"))
        if budget is not None and num_tokens >= budget:
            break
    ids = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
        bad = int(ids.max() if ids.max() >= tokenizer.vocab_size else ids.min())
        raise DataError(f"the tokenizer produced id {bad}, outside its vocabulary of "
                        f"{tokenizer.vocab_size}; its tokenizer.json is inconsistent, use another")
    return ids.astype(TOKEN_DTYPE), num_bytes, used


def _next_read(documents: int, num_bytes: int, num_tokens: int, remaining_tokens: float | None) -> int:
    """Documents to read next, from the `documents` encoded so far: about _TARGET_BATCH_BYTES of
    text whatever the document size; with a token budget, at most half of what its rest seems to
    need (the first documents' sizes may mislead), so the reads close in on its end."""
    if num_tokens == 0:
        return 16
    size = _TARGET_BATCH_BYTES * documents / max(num_bytes, 1)
    if remaining_tokens is None:
        return int(np.clip(size, 16, 65536))
    if remaining_tokens <= 0:
        return 0
    return int(np.clip(min(size, remaining_tokens * documents / num_tokens / 2), 1, 65536))


def _encode_into(out, documents: Documents, tokenizer: Tokenizer, split: str, progress: bool,
                 max_tokens: int = 0) -> tuple[int, int, int]:
    """Writes the split's tokens (with max_tokens, its first max_tokens) to `out`; returns the
    (tokens, UTF-8 bytes, documents) written. A read that returns fewer documents than asked is
    the end of the split: a stream's length is only a bound."""
    num_documents, num_tokens, num_bytes, position = len(documents), 0, 0, 0
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(1) as reader, \
            tqdm.tqdm(total=max_tokens or num_documents, unit="tok" if max_tokens else "doc",
                      disable=not progress, desc=f"tokenizing {split}") as bar:

        def read_next(encoded: int, remaining_tokens: float | None):
            """The read of the documents after `position`, sized from the first `encoded` documents."""
            asked = min(_next_read(encoded, num_bytes, num_tokens, remaining_tokens), num_documents - position)
            return (reader.submit(documents.read, position, position + asked), asked) if asked > 0 else (None, 0)

        # Read the next batch while this one is encoded (HF encodes in parallel).
        pending, asked = read_next(0, None)
        while pending is not None:
            texts, encoded = pending.result(), position
            if len(texts) < asked:
                num_documents = position + len(texts)
            position += len(texts)
            # With a budget, read ahead only what the budget seems to need after this batch,
            # guessing its tokens a document from the batches before it.
            pending, asked = read_next(encoded, max_tokens - num_tokens - len(texts) * num_tokens / max(encoded, 1)
                                       if max_tokens else None)
            ids, size, used = _encode_with_separators(tokenizer, texts,
                                                      max_tokens - num_tokens if max_tokens else None)
            out.write(ids.tobytes())
            num_tokens += ids.size
            num_bytes += size
            bar.update(ids.size if max_tokens else len(texts))
            seconds = max(time.perf_counter() - started, 1e-9)
            bar.set_postfix_str(f"{num_bytes / seconds / 1e6:.1f} MB/s, "
                                f"{num_tokens / seconds / 1e6:.2f} Mtok/s")
            if max_tokens and num_tokens >= max_tokens:
                position -= len(texts) - used  # what was read ahead goes unused
                break
            if pending is None and max_tokens:  # the guess fell short of the budget: read on
                pending, asked = read_next(position, max_tokens - num_tokens)
    return num_tokens, num_bytes, position


def build(documents: Documents, tokenizer: Tokenizer, directory: str, split: str,
          identity: dict, progress: bool = True, max_tokens: int = 0) -> TokenSplit:
    """Encodes every non-empty document, end-of-text after each (if the tokenizer has one), into the cache.

    With max_tokens, the split stops at exactly that many tokens (the last document cut), and the
    documents after it are not read."""
    if tokenizer.vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise DataError(f"a vocabulary of {tokenizer.vocab_size} does not fit the uint16 token "
                        f"cache (at most 65536); use a smaller tokenizer")
    os.makedirs(directory, exist_ok=True)
    tokens_path, manifest_path = _paths(directory, split)
    for stale in glob.glob(f"{glob.escape(tokens_path)}.tmp*"):  # from killed builds
        os.remove(stale)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)  # the old cache stops looking complete first
    started = time.perf_counter()
    temporary = f"{tokens_path}.tmp{os.getpid()}"
    try:
        with atomic.writing(tokens_path), open(temporary, "wb") as out:
            num_tokens, num_bytes, num_documents = _encode_into(out, documents, tokenizer, split,
                                                                 progress, max_tokens)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:  # a failed build leaves nothing behind
        with contextlib.suppress(FileNotFoundError):  # `open` itself may have failed
            os.remove(temporary)
        raise
    if num_tokens == 0:
        os.remove(temporary)
        raise DataError(f"the {split} split has no text (0 tokens); add text to the source "
                        f"or change data.val_fraction")
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
    cached, problem = load(directory, split, tokenizer.sha256)
    if cached is None:
        raise DataError(f"token cache {tokens_path} failed its check right after writing "
                        f"({problem}); check the disk and free space")
    return cached


@contextlib.contextmanager
def _build_turn(directory: str, split: str):
    """Holds the split's lock file until the block ends. The lock goes with the open file, so a
    killed build never leaves it held. Where there is no lock to take (a lock file another user
    owns, a file system without flock) the build goes ahead unguarded, as it did before locks."""
    os.makedirs(directory, exist_ok=True)
    lock_path = os.path.join(directory, f"{split}.lock")
    try:
        handle = open(lock_path, "a")
    except OSError:
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process to finish the token cache {_paths(directory, split)[0]}",
                  flush=True)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX)
            except OSError as error:  # someone holds it: building now could break their cache
                raise DataError(f"could not wait for the lock {lock_path} ({error}); rerun once the "
                                f"other run has built the cache") from error
        except OSError:
            pass
        yield


def load_or_build(documents: Documents, tokenizer: Tokenizer, directory: str, split: str,
                  identity: dict, progress: bool = True, max_tokens: int = 0) -> TokenSplit:
    cached, _ = load(directory, split, tokenizer.sha256)
    if cached is not None:  # the common case, lock-free (the cache may sit on a read-only disk)
        return cached
    with _build_turn(directory, split):
        cached, problem = load(directory, split, tokenizer.sha256)  # another process may have built it
        if cached is not None:
            return cached
        tokens_path = _paths(directory, split)[0]
        if problem:
            print(f"token cache {tokens_path} is unusable ({problem}); rebuilding")
        print(f"encoding the {split} split into the token cache {tokens_path}", flush=True)
        return build(documents, tokenizer, directory, split, identity, progress, max_tokens)
