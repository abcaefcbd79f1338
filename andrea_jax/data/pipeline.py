"""`prepare`: config -> source -> tokenizer (in the workdir) -> the training split's eras and the validation
split's token file -> the workdir's record of them.

The leading process opens the source, trains or loads the tokenizer and builds
the caches; the others then read what it wrote (so the workdir and
`data.cache_dir` must be on a filesystem all processes share), or on a gs://
workdir build their own from its tokenizer (docs/cloud_storage.md). The order, and
how a failure on any process reaches the others, is `andrea_jax/runtime/leader_first.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
from typing import Iterator

import ml_collections

from andrea_jax import run_dir
from andrea_jax.runtime import atomic
from andrea_jax.data import DataError, batcher, eras, hf_stream, local_files, sources, token_cache
from andrea_jax.data import tokenizer as tokenizers
from andrea_jax.data.sources import Documents
from andrea_jax.data.token_cache import TokenSplit, cache_directory
from andrea_jax.data.tokenizer import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
RECORD_FILE = "data.json"  # where the leader put each split's cache, for the other processes
_SAMPLE_CHUNKS = 64  # the BPE sample is spread over this many stretches of the split
_READ_DOCUMENTS = 256


@dataclasses.dataclass(frozen=True)
class Prepared:
    tokenizer: Tokenizer
    train: eras.EraCache
    val: TokenSplit


def open_source(data: ml_collections.ConfigDict, steps_tokens: int = 0) -> sources.Splits:
    """The documents `data.source` names; `steps_tokens` (the tokens the run's steps read) is a stream's budget."""
    source = str(data.source)
    kind, colon, spec = source.partition(":")
    kind += colon  # "tfds:", "hf:", "text:", "url:" or "stdlib"
    if kind == "stdlib":
        splits = sources.open_local(*local_files.list_stdlib_files(), data)
    elif kind in ("text:", "url:"):
        path = local_files.download(spec, sources.cache_dir_of(data)) if kind == "url:" else spec
        splits = sources.open_local(*local_files.list_text_files(path), data)
    elif kind == "tfds:":
        splits = sources.open_tfds(spec, data)
    elif kind == "hf:":
        splits = hf_stream.open_hf(spec, data, steps_tokens)
    else:
        raise DataError(f"data.source={source!r} is not 'tfds:NAME[/CONFIG]', "
                        f"'hf:OWNER/NAME[/CONFIG]', 'text:PATH_OR_GLOB', 'url:URL' or 'stdlib'")
    for name, documents in (("train", splits.train), ("validation", splits.val)):
        if len(documents) == 0:  # before a tokenizer is trained on nothing and saved
            raise DataError(f"data.source={source!r} gives an empty {name} split; add text or change "
                            f"data.val_fraction")
    return dataclasses.replace(splits, identity={"source": source, **splits.identity})


def open_splits(config: ml_collections.ConfigDict) -> sources.Splits:
    """The documents of `config.data`; a stream sized by the tokens the run's steps read (data.stream_tokens=0):
    in data.order="epochs" exactly their windows, in "random" a tenth more than they draw."""
    windows, seq_len = int(config.steps) * int(config.batch_size), int(config.seq_len)
    if config.data.order == "random":
        return open_source(config.data, math.ceil(hf_stream.STREAM_MARGIN * windows * (seq_len + 1)))
    return open_source(config.data, eras.tokens_for_windows(windows, seq_len, int(config.data.era_windows)))


def train_cache(config: ml_collections.ConfigDict, workdir: str, splits: sources.Splits, tokenizer: Tokenizer,
                preparing: bool = True, first_step: int = 0, process: int | None = None) -> eras.EraCache:
    """The training split's eras. A stream read in data.order="epochs": eras built beside training by the
    encoder process, the run's own (keyed by the run's id, `run_dir.claim_identity`); `preparing` (the leader's
    preparation, not the encoder process opening the same eras) checks the stream's start for text and the disk
    for the eras, and raises the budget of a run resumed at `first_step` that asks for more
    (`eras.raise_budget`), saying so once; `process`: the eras are that process's own (each process of a run
    keeps its own data). Any other split: one era, built here
    if missing, before the first step, and shared by the runs of its source (keyed by what it holds: the source,
    the tokenizer and a stream's token budget)."""
    cache_dir, seq_len = sources.cache_dir_of(config.data), int(config.seq_len)
    if config.data.order == "epochs" and isinstance(splits.train, sources.StreamedDocuments):
        if preparing and not any(splits.train.read(0, _READ_DOCUMENTS)):
            raise DataError(token_cache.no_text("train"))
        size, record_path = eras.era_tokens(config.data, seq_len), os.path.join(workdir, eras.RECORD_FILE)
        record = eras.start_record(record_path, splits.identity, size, splits.train_tokens, run_dir.identity(workdir))
        identity = {**splits.identity, "run": record["run"], "era_tokens": size,
                    **({} if process is None else {"process": process})}
        cache = eras.EraCache(cache_directory(cache_dir, identity, tokenizer.sha256), record_path, size,
                              int(record["planned_tokens"]))
        if preparing:
            token_cache.require_writable(cache.directory)  # the encoder writes every era of the run there
            cache, said = eras.raise_budget(cache, _budget(config, cache, splits), first_step, int(config.batch_size),
                                            int(config.seed), seq_len)
            if said:
                print(said, flush=True)
            eras.check_space(cache, int(config.data.keep_eras))
        return cache
    identity = {**splits.identity, "train_tokens": splits.train_tokens} if splits.train_tokens else splits.identity
    directory = cache_directory(cache_dir, identity, tokenizer.sha256)
    whole = token_cache.load_or_build(directory, "train", splits.train, tokenizer, "train", splits.train_tokens)
    if whole.num_tokens < seq_len + 1:
        raise DataError(f"the training split has {whole.num_tokens} tokens, fewer than seq_len + 1 "
                        f"= {seq_len + 1}; add text or lower seq_len")
    return eras.EraCache(directory, os.path.join(workdir, eras.RECORD_FILE), 0, whole.num_tokens)


def _budget(config: ml_collections.ConfigDict, cache: eras.EraCache, splits: sources.Splits) -> int:
    """The budget a resumed run's config asks for: data.stream_tokens, or where that is 0 the planned budget and
    what holds the windows its steps read past the planned budget's epoch 0 (those eras follow its own)."""
    if int(config.data.stream_tokens) or cache.planned_tokens == splits.train_tokens:
        return splits.train_tokens
    seq_len, windows = int(config.seq_len), int(config.steps) * int(config.batch_size)
    more = windows - cache.layout(int(config.seed), seq_len).windows_in_epoch(0)
    return cache.planned_tokens + (eras.tokens_for_windows(more, seq_len, int(config.data.era_windows)) if more > 0
                                   else 0)


def validation_split(config: ml_collections.ConfigDict, splits: sources.Splits, tokenizer: Tokenizer,
                     build: bool = True) -> TokenSplit:
    """The validation split's token file, keyed by the source and the tokenizer. Built if missing; without
    `build` (a process reading what the leading one built) a missing one is a DataError."""
    directory = cache_directory(sources.cache_dir_of(config.data), splits.identity, tokenizer.sha256)
    return token_cache.load_or_build(directory, "val", splits.val, tokenizer, "val") if build \
        else _built_by_the_leader(directory)


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


def kept_bpe_path(config: ml_collections.ConfigDict, splits: sources.Splits, merges: int) -> str:
    """Where a BPE trained on this source's training split is kept for every new workdir: keyed by what
    training reads (the source identity, the merges, the sample's size) and by the recipe's version, as a token
    cache is by what it holds and by its format."""
    content = json.dumps({"identity": splits.identity, "merges": merges, "recipe": tokenizers.BPE_RECIPE_VERSION,
                          "sample_bytes": int(config.data.tokenizer_train_bytes)}, sort_keys=True)
    key = hashlib.sha256(content.encode("utf-8")).hexdigest()[:20]
    return os.path.join(sources.cache_dir_of(config.data), "tokenizers", key, TOKENIZER_FILE)


def _bpe_merges(config: ml_collections.ConfigDict) -> int:
    wanted = int(config.model.vocab_size)  # 256 byte tokens + merges + end-of-text: the model's size fixes them
    return wanted - 257 if wanted > 257 else tokenizers.BPE_MERGES


def _new_tokenizer(config: ml_collections.ConfigDict, splits: sources.Splits) -> Tokenizer:
    kind, train = str(config.data.tokenizer), splits.train
    if kind == "byte":
        return tokenizers.ByteTokenizer()
    if kind == "char":
        print("collecting the character tokenizer's characters from the training split", flush=True)
        return tokenizers.build_char(_texts(train))
    if kind == "bpe":
        merges, max_bytes = _bpe_merges(config), int(config.data.tokenizer_train_bytes)
        kept = kept_bpe_path(config, splits, merges)
        if os.path.isfile(kept):
            try:
                tokenizer = tokenizers.load(kept)
                print(f"reusing the BPE tokenizer trained on this source before: {kept}", flush=True)
                return tokenizer
            except Exception:  # HF's loader raises bare Exceptions; a crash's leftover is the cache's, not the user's
                print(f"the BPE tokenizer kept at {kept} is unreadable; training it again, to keep in its place",
                      flush=True)
                with contextlib.suppress(OSError):  # a run beside this one may have removed it first
                    os.remove(kept)  # so that the leader keeps this run's once the data is known to train on
        print(f"training the BPE tokenizer ({merges} merges) on up to {max_bytes / 1e6:g} MB of the training split",
              flush=True)
        sample = training_sample(train, max_bytes)
        if not any(sample):
            held_out = ("a stream without its own validation split gives its first data.stream_val_documents"
                        if isinstance(train, sources.StreamedDocuments) else "data.val_fraction holds out some")
            raise DataError(f"the training split of data.source={config.data.source!r} has no text to train the "
                            f"tokenizer on; add text or check data.train_split ({held_out} to validation)")
        return tokenizers.train_bpe(sample, merges)
    if not os.path.isfile(kind):
        raise DataError(f"data.tokenizer={kind!r} is not 'bpe', 'byte', 'char' or an existing "
                        f"tokenizer.json file")
    return tokenizers.load(kind)


def tokenizer_for_run(config: ml_collections.ConfigDict, workdir: str,
                      splits: sources.Splits) -> tuple[Tokenizer, bool]:
    """(the workdir's tokenizer.json if it has one (never retrained), else a new one (a BPE this source trained
    before if data.cache_dir keeps one); whether it is new to the workdir)."""
    path, requested = os.path.join(workdir, TOKENIZER_FILE), str(config.data.tokenizer)
    resumed = os.path.exists(path)
    tokenizer = tokenizers.load(path) if resumed else _new_tokenizer(config, splits)
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
    return tokenizer, not resumed


def _built_by_the_leader(directory: str, name: str = "val", split: str = "validation") -> TokenSplit:
    fix = "put data.cache_dir on a filesystem all processes share"
    built = token_cache.read(os.path.join(directory, f"{name}.bin"), os.path.join(directory, f"{name}.json"), fix)
    if built is None:
        raise DataError(f"the {split} token cache in {directory} is missing; {fix}")
    return built


def _prepare_as_leader(config: ml_collections.ConfigDict, workdir: str, first_step: int,
                       process: int | None) -> Prepared:
    os.makedirs(workdir, exist_ok=True)
    splits = open_splits(config)
    cache_dir, keep_eras = sources.cache_dir_of(config.data), int(config.data.keep_eras)
    era_size = eras.era_tokens(config.data, int(config.seq_len))
    if splits.train_tokens and not os.path.exists(os.path.join(workdir, TOKENIZER_FILE)):
        # A new tokenizer may stream its sample first: the disk is checked before that, for the eras kept at
        # once (the encoder checks again, counting what is on disk), or a random order's whole budget.
        kept = keep_eras and config.data.order == "epochs"
        at_once = min(splits.train_tokens, (keep_eras + 1) * era_size) if kept else splits.train_tokens
        token_cache.require_space(cache_dir, at_once * token_cache.TOKEN_BYTES)
    tokenizer, new_tokenizer = tokenizer_for_run(config, workdir, splits)
    # Era 0 of a stream: by the encoder the loop starts.
    train = train_cache(config, workdir, splits, tokenizer, first_step=first_step, process=process)
    val = validation_split(config, splits, tokenizer)
    seq_len, batch_size = int(config.seq_len), int(config.batch_size)
    if batcher.num_val_batches(val.num_tokens, batch_size, seq_len) < 1:
        raise DataError(
            f"the validation split has {val.num_tokens} tokens, less than one batch of "
            f"batch_size x seq_len = {batch_size * seq_len} (+1); raise data.val_fraction "
            f"(data.stream_val_documents for hf:), add text, or lower batch_size or seq_len")
    if new_tokenizer:  # saved once the data is known to train on: a refused run leaves none to reuse
        tokenizer.save(os.path.join(workdir, TOKENIZER_FILE))
        kept_bpe = kept_bpe_path(config, splits, _bpe_merges(config)) if str(config.data.tokenizer) == "bpe" else ""
        if kept_bpe and not os.path.exists(kept_bpe):  # for new workdirs; data.cache_dir is known writable by now
            os.makedirs(os.path.dirname(kept_bpe), exist_ok=True)
            tokenizer.save(kept_bpe)
    record = {"train_eras": {key: value for key, value in dataclasses.asdict(train).items() if key != "record_path"},
              "validation_directory": os.path.dirname(val.path),  # the workdir may move: no record_path
              "tokenizer_sha256": tokenizer.sha256, "source": splits.identity}
    atomic.write(os.path.join(workdir, RECORD_FILE), json.dumps(record, indent=1))
    return Prepared(tokenizer, train, val)


def prepare(config: ml_collections.ConfigDict, workdir: str, is_leader: bool = True, first_step: int = 0,
            process: int | None = None) -> Prepared:
    """Tokenizer and token caches for this config, the run starting (or resuming) at `first_step`; only the
    leader writes anything, the others read what it recorded. `process`: a process that prepares its own data
    as the leader does (`train_cache`)."""
    workdir = os.fspath(workdir)
    if is_leader:
        return _prepare_as_leader(config, workdir, first_step, process)
    record_path = os.path.join(workdir, RECORD_FILE)
    try:
        with open(record_path, encoding="utf-8") as f:
            record = json.load(f)
        train = eras.EraCache(**record["train_eras"], record_path=os.path.join(workdir, eras.RECORD_FILE))
        validation_directory = record["validation_directory"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"cannot read {record_path} ({error}); the leading process must prepare "
                        f"the data first, in a workdir all processes share") from None
    tokenizer = tokenizers.load(os.path.join(workdir, TOKENIZER_FILE))  # the leader checked it against the config
    if not train.encoded_beside_training:
        _built_by_the_leader(train.directory, "train", "training")
    return Prepared(tokenizer, train, _built_by_the_leader(validation_directory))
