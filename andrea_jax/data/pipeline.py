"""`prepare`: config -> tokenizer (in the workdir) + train and validation token caches.

The leading process opens the source, trains or loads the tokenizer and builds
the caches; the others then read what it wrote (so the workdir and
`data.cache_dir` must be on a filesystem all processes share). The order, and
how a failure on any process reaches the others, is `andrea_jax/runtime/leader_first.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Iterator

import ml_collections

from andrea_jax.runtime import atomic
from andrea_jax.data import DataError, batcher, sources, token_cache
from andrea_jax.data import tokenizer as tokenizers
from andrea_jax.data.sources import Documents
from andrea_jax.data.token_cache import TokenSplit
from andrea_jax.data.tokenizer import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
RECORD_FILE = "data.json"  # where the leader put the caches, for the other processes
_SAMPLE_CHUNKS = 64  # the BPE sample is spread over this many stretches of the split
_READ_DOCUMENTS = 256


@dataclasses.dataclass(frozen=True)
class Prepared:
    tokenizer: Tokenizer
    train: TokenSplit
    val: TokenSplit


def open_splits(config: ml_collections.ConfigDict) -> sources.Splits:
    """The documents of `config.data`; a stream sized by the tokens the run's steps read."""
    steps_tokens = int(config.steps) * int(config.batch_size) * (int(config.seq_len) + 1)
    return sources.open_source(config.data, steps_tokens)


def _texts(documents: Documents, start: int = 0, stop: int = sys.maxsize) -> Iterator[str]:
    """The documents from start to stop (a stream's end: an empty read), read in batches."""
    while start < stop and (texts := documents.read(start, min(stop, start + _READ_DOCUMENTS))):
        yield from texts
        start += len(texts)


def training_sample(documents: Documents, max_bytes: int) -> list[str]:
    """About max_bytes of text from evenly spaced stretches of the documents (a stream: its first).

    A sample from the start alone would over-represent whatever sorts first; a stream has
    no random access, and what its start holds is what the run trains on first.
    """
    total = len(documents)
    chunks = 1 if isinstance(documents, sources.StreamedDocuments) else max(1, min(_SAMPLE_CHUNKS, total))
    per_chunk = max(1, max_bytes // chunks)
    sample = []
    for chunk in range(chunks):
        taken = 0
        for text in _texts(documents, chunk * total // chunks, (chunk + 1) * total // chunks):
            sample.append(text[:per_chunk - taken])
            taken += len(sample[-1])
            if taken >= per_chunk:
                break
    return sample


def _new_tokenizer(config: ml_collections.ConfigDict, train: Documents) -> Tokenizer:
    kind = str(config.data.tokenizer)
    if kind == "byte":
        return tokenizers.ByteTokenizer()
    if kind == "char":
        print("collecting the character tokenizer's characters from the training split", flush=True)
        return tokenizers.build_char(_texts(train))
    if kind == "bpe":
        wanted = int(config.model.vocab_size)
        # 256 byte tokens + merges + end-of-text: the model's size fixes the merges.
        merges = wanted - 257 if wanted > 257 else tokenizers.BPE_MERGES
        max_bytes = int(config.data.tokenizer_train_bytes)
        print(f"training the BPE tokenizer ({merges} merges) on up to {max_bytes / 1e6:g} MB of the training split",
              flush=True)
        return tokenizers.train_bpe(training_sample(train, max_bytes), merges)
    if not os.path.isfile(kind):
        raise DataError(f"data.tokenizer={kind!r} is not 'bpe', 'byte', 'char' or an existing "
                        f"tokenizer.json file")
    return tokenizers.load(kind)


def tokenizer_for_run(config: ml_collections.ConfigDict, workdir: str, train: Documents) -> Tokenizer:
    """The workdir's tokenizer.json if it has one (never retrained), else a new one saved there."""
    path, requested = os.path.join(workdir, TOKENIZER_FILE), str(config.data.tokenizer)
    resumed = os.path.exists(path)
    tokenizer = tokenizers.load(path) if resumed else _new_tokenizer(config, train)
    if resumed and requested in ("bpe", "byte", "char"):
        if tokenizer.kind != requested:
            raise DataError(f"{path} is a {tokenizer.kind} tokenizer but data.tokenizer={requested!r}; "
                            f"set data.tokenizer={tokenizer.kind!r} or use a new workdir")
    elif resumed and os.path.isfile(requested) and tokenizers.load(requested).sha256 != tokenizer.sha256:
        raise DataError(f"{path} differs from data.tokenizer={requested!r}; "
                        f"use a new workdir or point data.tokenizer at {path}")
    wanted = int(config.model.vocab_size)
    if wanted and tokenizer.vocab_size != wanted:
        described = path if resumed else f"the new {tokenizer.kind} tokenizer"
        raise DataError(f"{described} has {tokenizer.vocab_size} entries but model.vocab_size={wanted}; "
                        f"set model.vocab_size={tokenizer.vocab_size} (or 0 to take the tokenizer's size)")
    if not resumed:
        tokenizer.save(path)
    return tokenizer


def token_split(config: ml_collections.ConfigDict, splits: sources.Splits, tokenizer: Tokenizer,
                split: str) -> TokenSplit:
    """The token cache of `split` ("train" or "val"), built if missing, where the source and tokenizer key it."""
    directory = token_cache.cache_directory(sources.cache_dir_of(config.data), splits.identity, tokenizer.sha256)
    return token_cache.load_or_build(getattr(splits, split), tokenizer, directory, split, splits.identity,
                                     max_tokens=splits.train_tokens if split == "train" else 0)


def _prepare_as_leader(config: ml_collections.ConfigDict, workdir: str) -> Prepared:
    os.makedirs(workdir, exist_ok=True)
    splits = open_splits(config)
    tokenizer = tokenizer_for_run(config, workdir, splits.train)
    train, val = (token_split(config, splits, tokenizer, split) for split in ("train", "val"))
    seq_len, batch_size = int(config.seq_len), int(config.batch_size)
    if train.num_tokens < seq_len + 1:
        raise DataError(f"the training split has {train.num_tokens} tokens, fewer than seq_len + 1 "
                        f"= {seq_len + 1}; add text or lower seq_len")
    if batcher.num_val_batches(val.num_tokens, batch_size, seq_len) < 1:
        raise DataError(
            f"the validation split has {val.num_tokens} tokens, less than one batch of "
            f"batch_size x seq_len = {batch_size * seq_len} (+1); raise data.val_fraction "
            f"(data.stream_val_documents for hf:), add text, or lower batch_size or seq_len")
    record = {"cache_directory": os.path.dirname(train.path), "tokenizer_sha256": tokenizer.sha256,
              "source": splits.identity}
    atomic.write(os.path.join(workdir, RECORD_FILE), json.dumps(record, indent=1))
    return Prepared(tokenizer, train, val)


def prepare(config: ml_collections.ConfigDict, workdir: str, is_leader: bool = True) -> Prepared:
    """Tokenizer and token caches for this config; only the leader writes anything, the others read
    what it recorded."""
    workdir = os.fspath(workdir)
    if is_leader:
        return _prepare_as_leader(config, workdir)
    record_path = os.path.join(workdir, RECORD_FILE)
    try:
        with open(record_path, encoding="utf-8") as f:
            directory = json.load(f)["cache_directory"]
    except (OSError, ValueError, KeyError) as error:
        raise DataError(f"cannot read {record_path} ({error}); the leading process must prepare "
                        f"the data first, in a workdir all processes share") from None
    tokenizer = tokenizers.load(os.path.join(workdir, TOKENIZER_FILE))  # the leader checked it against the config
    loaded = []
    for split in ("train", "val"):
        cached, problem = token_cache.load(directory, split)
        if cached is None:
            raise DataError(f"the {split} token cache in {directory} is unusable ({problem or 'missing'}); "
                            f"put data.cache_dir on a filesystem all processes share")
        loaded.append(cached)
    return Prepared(tokenizer, *loaded)
