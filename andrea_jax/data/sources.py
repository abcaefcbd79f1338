"""`data.source` -> train and validation documents (`pipeline.open_source` picks the kind).

`tfds:NAME[/CONFIG]` opens a registered dataset (downloaded and prepared on
first use); `hf:OWNER/NAME[/CONFIG]` streams a Hugging Face dataset, as much as
the run needs (`hf_stream.py`); `text:PATH_OR_GLOB` and `stdlib` read local
files, and `url:URL` a file downloaded once into the data cache (`local_files.py`).
Validation is the dataset's own split when it has one, else every k-th document,
else (few documents) the last fraction of the text (`hf_stream.py` says how a
stream holds out its own).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import itertools
import logging
import os
import re
import socket
import sys
import time
from typing import Any, Callable, Iterator, Sequence, Union

import ml_collections
import tensorflow_datasets as tfds

from andrea_jax.data import DataError, local_files

# Below this many held-out documents the split is by text, not by document.
MIN_VAL_DOCUMENTS = 10
# TFDS downloads from many hosts; its own bucket stands for "the internet".
NETWORK_PROBE = ("storage.googleapis.com", 443)


def cache_dir_of(data: ml_collections.ConfigDict) -> str:
    """Where token caches and downloads go."""
    return os.path.expanduser(data.cache_dir or "~/.cache/andrea_jax")


class _RandomAccess:
    """A finite split's documents, read at any position: the stream interface a token file's build uses,
    with nothing to resume."""

    def state_at(self, position: int) -> None:
        return None

    def resume(self, position: int, state: None) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class DataSourceDocuments(_RandomAccess):
    """Field `field` of the records of a TFDS-style data source, optionally every k-th one (or all but those)."""

    source: Sequence  # with __getitems__(positions) -> records
    field: str
    stride: int = 0  # 0: all documents
    held_out: bool = False  # with a stride: the k-th documents, else all others

    def __len__(self) -> int:
        held_out = len(self.source) // self.stride if self.stride else 0
        return held_out if self.held_out else len(self.source) - held_out

    def read(self, start: int, stop: int) -> list[str]:
        # Held out: the last of each group of k; the others: each skips the held-out ones before it.
        k = self.stride
        positions = [i * k + k - 1 if self.held_out else i + i // (k - 1) if k else i
                     for i in range(start, min(stop, len(self)))]
        texts = [record[self.field] for record in self.source.__getitems__(positions)]
        return [t.decode("utf-8", "replace") if isinstance(t, bytes) else str(t) for t in texts]  # TFDS Text: bytes


class ListDocuments(_RandomAccess, list):
    def read(self, start: int, stop: int) -> list[str]:
        return self[start:stop]


class StreamedDocuments:
    """Documents read in order from a stream that `open_texts` starts (again, for a read before
    the last one's end). Its length is only a bound, `limit` (else unknown): an empty read is its end.

    A stream whose iterator has `state()` (a Hugging Face stream) is resumable: `state_at(position)`
    is its state after a recent read that ended there, and `resume(position, state)` makes the next
    read open it there through `open_texts(state)`, with no document before it read again (an era's
    build starts where the era does). Opening, resumed or not, is part of the read: a read that
    fails with an error `transient` accepts (a timeout, a 5xx) is retried after each of RETRY_DELAYS_S
    from the last known state, then reported in one line.
    """

    RETRY_DELAYS_S = (2, 4, 8, 16, 32, 64)
    _KEPT_STATES = 4  # a build asks for the state of the read before the one its reader runs ahead on

    def __init__(self, open_texts: Callable[..., Iterator[str]], limit: int = sys.maxsize,
                 transient: Callable[[BaseException], bool] = lambda error: False,
                 described: str = "the stream", revision: Callable[[], str | None] = lambda: None) -> None:
        self.open_texts, self.limit, self.transient, self.described = open_texts, limit, transient, described
        self._revision = revision
        self._texts: Iterator[str] | None = None
        self._position = 0
        self._states: dict[int, dict] = {}
        self._resume_at: tuple[int, dict] | None = None  # where the next open starts, if not at the beginning

    def __len__(self) -> int:
        return self.limit

    def state_at(self, position: int) -> dict | None:
        return self._states.get(position)

    def resume(self, position: int, state: dict | None) -> None:
        """The next read from `position` goes on from `state` (None: from the start, skipping to it).
        The stream opens at that read, inside its retries."""
        self._texts, self._position = None, 0
        self._resume_at = None if state is None else (position, state)
        if state is not None:  # a retry goes back here rather than to the start
            self._states[position] = state

    def revision(self) -> str | None:
        """The commit of the dataset the stream reads, where it has one; asked for with a read's retries."""
        return self._retried(self._revision)

    def read(self, start: int, stop: int) -> list[str]:
        def from_the_last_known_state() -> None:
            known = max((position for position in self._states if position <= start), default=0)
            self.resume(known, self._states.get(known))

        return self._retried(lambda: self._read(start, stop), from_the_last_known_state)

    def _retried(self, call: Callable[[], Any], after_failure: Callable[[], None] = lambda: None) -> Any:
        for delay in (*self.RETRY_DELAYS_S, None):
            try:
                return call()
            except Exception as error:
                if not self.transient(error):
                    raise
                reason = " ".join(str(error).split())[:200] or type(error).__name__
                if delay is None:
                    raise DataError(f"{self.described} failed {len(self.RETRY_DELAYS_S) + 1} times in a row "
                                    f"({reason}); run the same command again when it answers (the eras "
                                    f"encoded so far are kept)") from None
                print(f"{self.described} failed ({reason}); trying again in {delay} s", flush=True)
                time.sleep(delay)
                after_failure()

    def _read(self, start: int, stop: int) -> list[str]:
        if self._texts is None or start < self._position:
            position, state = self._resume_at if self._resume_at and self._resume_at[0] <= start else (0, None)
            self._texts = self.open_texts() if state is None else self.open_texts(state)
            self._position, self._resume_at = position, None
        skip, count = start - self._position, max(0, min(stop, self.limit) - start)
        texts = list(itertools.islice(self._texts, skip, skip + count))
        self._position += skip + len(texts)
        if hasattr(self._texts, "state"):
            self._states[self._position] = self._texts.state()
            for old in sorted(self._states)[:-self._KEPT_STATES]:
                del self._states[old]
        return texts


# A split's documents: read(start, stop) -> their texts; all but a stream's at random.
Documents = Union[DataSourceDocuments, ListDocuments, StreamedDocuments]


@dataclasses.dataclass(frozen=True)
class Splits:
    train: Documents
    val: Documents
    # What the documents are (dataset, version or file fingerprint, split rule):
    # keys the token caches, so a changed source builds new ones.
    identity: dict
    train_tokens: int = 0  # the training tokens to take (a stream's budget; 0 = all of them)


def network_available(timeout_s: float = 3.0, address: tuple[str, int] = NETWORK_PROBE) -> bool:
    try:
        socket.create_connection(address, timeout=timeout_s).close()
        return True
    except OSError:
        return False


def missing_to_prepare(source: str | type) -> str | None:
    """A module that preparing `source` (a `tfds:NAME[/CONFIG]` string, or a TFDS builder class) imports
    and this machine lacks, else None.

    It reads the builder's code: no data and no network, so a notebook can install what is missing
    first. Many TFDS builders read files through TensorFlow (lm1b, tiny_shakespeare) or run on Apache
    Beam (wikipedia, c4); finding out after a long download is worse.
    """
    if isinstance(source, str):
        kind, _, name = source.partition(":")
        if kind != "tfds":
            return None
        source = tfds.builder_cls(name.split("/")[0])
    try:
        code = inspect.getsource(sys.modules[source.__module__])
    except OSError:
        return None
    for module, pattern in (("tensorflow", r"\bimport tensorflow\b"), ("apache_beam", r"\bapache_beam\b")):
        if re.search(pattern, code) and importlib.util.find_spec(module) is None:
            return module
    return None


def _is_prepared(builder) -> bool:
    """builder.is_prepared(), without the warning TFDS logs (through absl) for each version folder it finds
    unprepared (`Variant folder ... has no dataset_info.json`): the answer is what matters, and an unprepared
    dataset is prepared next, or is one error line offline. Errors it logs still show."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        return builder.is_prepared()
    finally:
        logger.setLevel(level)


def ensure_prepared(builder, network_check: Callable[[], bool] = network_available,
                    instead: str = "or use data.source='stdlib' or 'text:PATH'") -> None:
    """Prepares a TFDS dataset, failing in seconds (not minutes of retries) offline; `instead` ends the
    offline message with what else the user can pass."""
    if _is_prepared(builder):
        return
    name = builder.info.full_name
    missing = missing_to_prepare(type(builder))
    if missing:
        raise DataError(f"preparing TFDS dataset {name} needs {missing}, which is not installed; "
                        f"pip install {'tensorflow-cpu' if missing == 'tensorflow' else 'apache-beam'}, or "
                        f"prepare it where it is and set data.tfds_data_dir")
    if not network_check():
        raise DataError(
            f"TFDS dataset {name} is not prepared in {builder.data_dir} and there is no network "
            f"to download it; run once online, set data.tfds_data_dir to a prepared copy, {instead}")
    try:
        builder.download_and_prepare(file_format="array_record")
    except ImportError as error:
        raise DataError(f"preparing TFDS dataset {name} needs {error.name or error} "
                        f"(its builder imports it); install it, or prepare the dataset "
                        f"where it is installed and set data.tfds_data_dir") from None


def open_split(builder, split: str):
    try:
        return builder.as_data_source(split=split)
    except Exception as error:  # TFDS raises several types for one cause
        raise DataError(
            f"cannot read split {split!r} of {builder.info.full_name} as array_record ({error}); "
            f"prepare it again into an empty data.tfds_data_dir") from None


def hold_out(documents: DataSourceDocuments, val_fraction: float) -> tuple[Documents, Documents, str]:
    """(train, val, rule): every k-th document held out, or the text's last fraction."""
    stride = max(2, round(1.0 / val_fraction))
    if len(documents) // stride >= MIN_VAL_DOCUMENTS:
        return (dataclasses.replace(documents, stride=stride),
                dataclasses.replace(documents, stride=stride, held_out=True), f"every {stride}th document")
    # Too few documents: hold out the last fraction of the text (nanoGPT's
    # 90/10 split for a single file such as tinyshakespeare).
    texts = documents.read(0, len(documents))
    cut = int(sum(map(len, texts)) * (1.0 - val_fraction) + 1e-6)  # 1 - 0.3 is 0.6999...
    starts = itertools.accumulate(map(len, texts), initial=0)
    halves = [(text[:max(cut - start, 0)], text[max(cut - start, 0):]) for text, start in zip(texts, starts)]
    return (ListDocuments(head for head, _ in halves if head), ListDocuments(tail for _, tail in halves if tail),
            f"last {val_fraction} of the text")


def open_tfds(name: str, data: ml_collections.ConfigDict,
              network_check: Callable[[], bool] = network_available) -> Splits:
    """A registered TFDS dataset `NAME[/CONFIG]`: downloaded and prepared on first use."""
    try:
        builder = tfds.builder(name, data_dir=data.tfds_data_dir or None, file_format="array_record")
    except tfds.core.registered.DatasetNotFoundError:
        raise DataError(f"TFDS has no dataset {name!r}; check the name with "
                        f"tfds.list_builders() and data.source='tfds:NAME[/CONFIG]'") from None
    field, train_split, val_split = data.text_field, data.train_split, data.val_split
    features = builder.info.features  # from the builder's code: checked before any download
    if field not in features:
        raise DataError(f"{builder.info.full_name} has no field {field!r}; set data.text_field "
                        f"to one of {sorted(features.keys())}")
    ensure_prepared(builder, network_check)
    available = set(builder.info.splits.keys())
    if train_split.split("[")[0] not in available:
        raise DataError(f"{builder.info.full_name} has no split {train_split!r}; set "
                        f"data.train_split to one of {sorted(available)}")
    train = DataSourceDocuments(open_split(builder, train_split), field)
    if val_split and val_split.split("[")[0] in available:
        val, rule = DataSourceDocuments(open_split(builder, val_split), field), f"split {val_split}"
    else:
        train, val, rule = hold_out(train, float(data.val_fraction))
    return Splits(train, val, {"dataset": builder.info.full_name, "field": field,
                               "train_split": train_split, "val_rule": rule})


def open_local(root: str, files: Sequence[str], data: ml_collections.ConfigDict) -> Splits:
    """Local files, one document each: every k-th held out, or (few files) the text's last fraction."""
    train, val, rule = hold_out(DataSourceDocuments(local_files.FileTexts(files), "text"),
                                float(data.val_fraction))
    return Splits(train, val, {"files": local_files.fingerprint(root, files), "num_files": len(files),
                               "val_rule": rule})
