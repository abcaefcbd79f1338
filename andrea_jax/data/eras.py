"""The training split cached in eras, and the one reader of them for every `data.order`.

A finite split, and a stream's budget read in data.order="random", is one era (`train.bin`), encoded
before the first step and shared by the runs of its source. A stream read in data.order="epochs" is
cut in eras built by an encoder beside the training loop, the run's own. Era k is tokens
[k·era_tokens, (k + 1)·era_tokens) of the split (`order.py` cuts its windows; a raised budget's eras follow
the last, short one of the budget before: `raise_budget`), in `<cache>/train.era<k>.bin`
with a manifest `train.era<k>.json` written last: an era is there whole or not at all. Where each era
starts in the stream (the document, the token inside it, the `datasets` state of a read at or before that
document) is recorded in the workdir's `eras.json` as soon as the era before it is done, so a resume on a
fresh machine with an empty cache opens the stream where the first era it needs starts, and builds only the
eras from its step on. With `keep_eras`, the training loop deletes the eras its steps have passed and the
encoder waits while that many are on disk.

The encoder is its own process (`encoder.py`), so that encoding never takes the training loop's
interpreter. A step whose era is not ready waits for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
import subprocess
import time
import uuid
from typing import Callable

import ml_collections
import numpy as np

from andrea_jax.data import DataError, batcher, order, token_cache
from andrea_jax.data.sources import StreamedDocuments
from andrea_jax.data.token_cache import TOKEN_BYTES, require_space
from andrea_jax.data.tokenizer import Tokenizer
from andrea_jax.runtime import atomic

RECORD_FILE = "eras.json"  # in the workdir: the eras' starts, all a fresh machine needs
POSITION_FILE = "eras.position.json"  # in the workdir: the eras the training loop's latest step reads
_POLL_S = 0.2


def era_tokens(data: ml_collections.ConfigDict, seq_len: int) -> int:
    """Tokens an era holds: `data.era_windows` windows of seq_len + 1 that share their edge tokens."""
    return int(data.era_windows) * seq_len + 1


def tokens_for_windows(windows: int, seq_len: int, era_windows: int) -> int:
    """The split's tokens that hold `windows` windows in epoch 0, cut in eras of `era_windows`."""
    full, rest = divmod(windows, era_windows)
    return full * (era_windows * seq_len + 1) + (rest * seq_len + 1 if rest else 0)


@dataclasses.dataclass(frozen=True)
class EraCache:
    """A training split's eras in `directory`, their starts recorded in `record_path` (the workdir's).

    era_tokens 0: the whole split is one era, `train.bin`, built before the first step and shared by the runs
    of its source (`token_cache.load_or_build`); its planned_tokens are then the tokens it holds."""

    directory: str
    record_path: str
    era_tokens: int
    planned_tokens: int  # the stream's budget; `final_tokens` in the record when the stream ended before it

    @property
    def encoded_beside_training(self) -> bool:
        return self.era_tokens > 0

    def paths(self, era: int) -> tuple[str, str]:
        stem = os.path.join(self.directory, f"train.era{era:05d}" if self.era_tokens else "train")
        return f"{stem}.bin", f"{stem}.json"

    def record(self) -> dict:
        try:
            with open(self.record_path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            raise DataError(f"{self.record_path} is unreadable ({error}); delete it and the run rebuilds "
                            f"its eras from the start of the stream") from None

    def total_tokens(self) -> int:
        return int(self.record().get("final_tokens") or self.planned_tokens)

    def layout(self, seed: int, seq_len: int) -> order.Layout:
        breaks = tuple(self.record().get("extended_from", ())) if self.era_tokens else ()
        return order.Layout(self.total_tokens(), seq_len, self.era_tokens, seed, breaks)

    def built(self, era: int) -> bool:
        """Whether era `era` is on disk whole and the run's, by its manifest and its file's size (the cheap check)."""
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            manifest = self.manifest(era)
            return (os.path.getsize(self.paths(era)[0]) == int(manifest["num_tokens"]) * TOKEN_BYTES
                    and self._starts_as_recorded(era, manifest))
        return False

    def _starts_as_recorded(self, era: int, manifest: dict) -> bool:
        """Whether the era begins where the run's record says its era `era` begins: an era another run's layout
        put there is never read (an era built before manifests said where they begin is taken as it is)."""
        recorded = self.record().get("starts", {}).get(str(era))
        return not self.encoded_beside_training or "start" not in manifest or manifest["start"] == recorded

    def verified(self, era: int) -> np.ndarray | None:
        """Era `era`'s tokens (a read-only memmap) once its manifest is written, else None; an era whose tokens
        are not those its manifest describes (the file shortened, removed or overwritten since) stops the run
        in one line."""
        fix = (f"delete {os.path.basename(self.paths(era)[1])} there and run the same command to resume: the era is "
               f"encoded again")
        with contextlib.suppress(OSError, ValueError):
            if not self._starts_as_recorded(era, self.manifest(era)):
                return None  # the encoder builds the run's own in its place
        # A split of one era was checked when it was prepared, before the first step, by its manifest and size.
        split = token_cache.read(*self.paths(era), fix, f"era {era} of the training split in {self.directory}",
                                 checksum=self.encoded_beside_training)
        return None if split is None else split.tokens

    def manifest(self, era: int) -> dict:
        with open(self.paths(era)[1], encoding="utf-8") as f:
            return json.load(f)

    def on_disk(self) -> list[int]:
        names = glob.glob(os.path.join(self.directory, "train.era*.json"))
        return sorted(int(re.search(r"era(\d+)\.json$", name).group(1)) for name in names)

    def delete(self, era: int) -> None:
        for path in reversed(self.paths(era)):  # the manifest first: a half-deleted era is not there
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    @property
    def position_path(self) -> str:
        """Where the training loop says which era of the run's order (its sequence number) it reads now."""
        return os.path.join(os.path.dirname(self.record_path), POSITION_FILE)

    def position(self) -> tuple[int, int] | None:
        """(the first, the last) sequence number of the eras the training loop's latest step reads."""
        with contextlib.suppress(OSError, ValueError, KeyError):
            with open(self.position_path, encoding="utf-8") as f:
                position = json.load(f)
            return int(position["sequence"]), int(position["needed"])
        return None


def era_range(layout: order.Layout, batch_size: int, first_step: int, last_step: int) -> tuple[int, int]:
    """The sequence numbers (`Layout.era_sequence_number`) of the first and last era steps first..last read."""
    first = layout.locate(np.arange(first_step * batch_size, (first_step + 1) * batch_size))
    last = layout.locate(np.arange(last_step * batch_size, (last_step + 1) * batch_size))
    return (int(layout.era_sequence_number(*first[:2]).min()), int(layout.era_sequence_number(*last[:2]).max()))


# ---- building ----

def build_era(cache: EraCache, era: int, documents: StreamedDocuments, tokenizer: Tokenizer, start: dict,
              first_token: int, length: int, log=print) -> tuple[dict | None, int]:
    """Encodes era `era` from `start` (a record of where it begins; `first_token` of the split) into the cache: at
    most `length` tokens. Returns (the start of the next era, or None where the stream ended; the tokens written)."""
    _same_commit(cache, documents)
    tokens_path, manifest_path = cache.paths(era)
    next_start, manifest = token_cache.encode(tokens_path, documents, tokenizer, start, length)
    written, seconds = manifest["num_tokens"], manifest["build_seconds"]
    if written == 0:  # the stream ended where this era would start
        _record_start(cache, era, None, final_tokens=first_token)
        return None, 0
    _record_start(cache, era + 1, next_start, final_tokens=None if next_start else first_token + written)
    atomic.write(manifest_path, json.dumps({"era": era, "start": start, **manifest}, indent=1))
    per_second = lambda count: count / max(seconds, 1e-9) / 1e6
    log(f"era {era} encoded: {written:,} tokens in {seconds:.1f} s ({per_second(manifest['num_bytes']):.1f} MB/s of "
        f"text, {per_second(written):.2f} M tokens/s)")
    return next_start, written


def _same_commit(cache: EraCache, documents: StreamedDocuments) -> None:
    """Eras of one run are of one commit of a hub dataset: the first era's is recorded, a later one's checked."""
    now, record = documents.revision(), cache.record()
    if "dataset_revision" not in record:
        atomic.write(cache.record_path, json.dumps({**record, "dataset_revision": now}))
    elif record["dataset_revision"] != now:
        raise DataError(f"{documents.described} moved from commit {record['dataset_revision']} to {now} since this "
                        f"cache began; its eras in this run are of the old one: train the new one in a new workdir")


def _record_start(cache: EraCache, era: int, start: dict | None, final_tokens: int | None) -> None:
    record = cache.record()
    if start is not None:
        record.setdefault("starts", {})[str(era)] = start
    if final_tokens is not None:
        record["final_tokens"] = final_tokens
    atomic.write(cache.record_path, json.dumps(record))


def start_record(record_path: str, identity: dict, era_tokens: int, planned_tokens: int,
                 run_id: str | None = None) -> dict:
    """The workdir's record of its run's eras: read, or begun for a new run. Its "run", the run's id
    (`run_dir.claim_identity`; a new one without), keys the run's era directory: the eras are the run's,
    deleted as its steps pass them, and a workdir given a new id encodes its own from the starts recorded here.
    A larger budget is `raise_budget`'s."""
    record = EraCache("", record_path, era_tokens, planned_tokens).record()
    if record and (record["era_tokens"] != era_tokens or record["identity"] != identity):
        raise DataError(f"{record_path} records the eras of another source, tokenizer or seq_len; resume with the "
                        f"data.source, data.era_windows and seq_len the run started with, or use a new workdir")
    if not record:
        record = {"identity": identity, "era_tokens": era_tokens, "planned_tokens": planned_tokens,
                  "starts": {"0": dict(token_cache.START)}}
    if not record.get("run") or run_id not in (None, record["run"]):
        record["run"] = run_id or uuid.uuid4().hex[:12]
        os.makedirs(os.path.dirname(record_path) or ".", exist_ok=True)
        atomic.write(record_path, json.dumps(record))
    return record


def raise_budget(cache: EraCache, tokens: int, first_step: int, batch_size: int, seed: int,
                 seq_len: int) -> tuple[EraCache, str | None]:
    """The run's eras for a budget of `tokens`, the run resuming at `first_step`, and a line saying what changed.

    A larger budget goes on encoding the stream where the run's budget ended: the eras planned stay as they are
    (the last one, short, too: `order.Layout.breaks`) and new ones follow them in epoch 0, so the steps trained
    read the same windows and the steps after them read the rest of epoch 0, then text none has read. It is
    refused, the budget kept, where the steps have read into a second epoch (extending epoch 0 would change what
    they read) or the stream ended before the budget."""
    planned, record = cache.planned_tokens, cache.record()
    keeps = (f"it keeps them (these steps would plan {tokens:,}; steps past them read them again, in another "
             f"epoch)")
    if tokens <= planned:
        kept = f"the run's eras were planned for {planned:,} tokens of the stream, and {keeps}"
        return cache, None if tokens == planned else kept
    if "final_tokens" in record:
        return cache, (f"the stream ended after {int(record['final_tokens']):,} tokens, fewer than the {planned:,} the "
                       f"run planned: {keeps}")
    first_epoch = cache.layout(seed, seq_len).windows_in_epoch(0)
    if first_step * batch_size > first_epoch:
        return cache, (f"the run's eras were planned for {planned:,} tokens of the stream and its steps read them "
                       f"again from step {first_epoch // batch_size + 1}: {keeps}; a new workdir reads "
                       f"{tokens:,} once")
    record["extended_from"] = [*record.get("extended_from", []), planned]
    record["planned_tokens"] = tokens
    atomic.write(cache.record_path, json.dumps(record))
    return dataclasses.replace(cache, planned_tokens=tokens), (
        f"the run's stream budget rises from {planned:,} to {tokens:,} tokens: its eras go on encoding the stream "
        f"where the first {planned:,} ended; the steps trained keep their windows and the later ones read text none "
        f"read before")


def encode(cache: EraCache, documents: StreamedDocuments, tokenizer: Tokenizer, layout_of, batch_size: int,
           first_step: int, last_step: int, keep_eras: int, alive=lambda: True, log=print) -> None:
    """Builds, in the order the steps first..last meet them, the eras they read that are not on disk; with
    keep_eras, only the keep_eras from the one the training loop reads now (`EraCache.position`; before it
    says, the first step's) on. `layout_of()` is the split's current layout."""
    os.makedirs(cache.directory, exist_ok=True)
    for stale in glob.glob(os.path.join(cache.directory, "train.era*.bin.tmp")):  # a killed encoder's
        os.remove(stale)
    layout = layout_of()
    sequence, last = era_range(layout, batch_size, first_step, last_step)
    position, needed = sequence, sequence  # where the steps are, and the last era they wait for: only move on
    while sequence <= last and alive():
        while keep_eras and sequence > max(position + keep_eras - 1, needed):
            if not alive():
                return
            time.sleep(_POLL_S)
            said = cache.position() or (0, 0)
            position, needed = map(max, (position, needed), said)
            # An era built for steps still to come and deleted since (a tmp cleaner, a user freeing disk) would
            # have them wait for ever: it is built again. One gone because the steps moved past it meanwhile
            # (they say so first, then delete it) is not.
            gone = [ahead for ahead in range(position, sequence) if not cache.built(ahead % layout.num_eras)]
            if gone and (cache.position() or (0, 0)) == said:
                log(f"era {gone[0] % layout.num_eras} was deleted before training read it; it is encoded again")
                sequence = gone[0]
                break
        if keep_eras:  # an earlier run's eras outside the steps' window go before another is built
            drop_outside(cache, layout, position, max(keep_eras, needed - position + 1))
        era = sequence % layout.num_eras
        sequence += 1
        if cache.built(era):
            continue
        known = max(k for k in map(int, cache.record()["starts"]) if k <= era)
        for building in range(known, era + 1):  # the eras before `era` only to find where it starts
            next_start, _ = build_era(cache, building, documents, tokenizer, cache.record()["starts"][str(building)],
                                      layout.era_start(building), layout.era_length(building), log)
            if building < era:
                cache.delete(building)
            if next_start is None and cache.total_tokens() < layout.total_tokens:  # fewer eras than planned
                log(f"the stream ended after {cache.total_tokens():,} tokens, fewer than the {layout.total_tokens:,} "
                    f"planned; later epochs read its text again")
                layout = layout_of()  # still in epoch 0, which now ends sooner
                sequence, last = min(sequence, layout.num_eras), era_range(layout, batch_size, first_step, last_step)[1]
                break


# ---- reading ----

class WaitStopped(Exception):
    """A stop request (`Reader.stop_waiting`) ended a step's wait for its era: the run stops at the last finished
    step."""


class Reader:
    """The eras as the training loop reads them, in `data.order` ("random": windows drawn with replacement from
    a split of one era): waits for an era not built yet (saying which, and for how long). With `keep_eras`,
    process 0 (`delete_passed`) says which eras the step being built reads (`EraCache.position_path`: the
    encoder builds up to them, and keep_eras from the first) and deletes the eras outside that window; every
    process lets go of those it no longer reads."""

    def __init__(self, cache: EraCache, seed: int, seq_len: int, keep_eras: int, delete_passed: bool,
                 encoder: subprocess.Popen | None = None, log=print, order: str = "epochs") -> None:
        self.cache, self.seed, self.seq_len, self.order = cache, seed, seq_len, order
        self.keep_eras = keep_eras if cache.encoded_beside_training else 0  # a split of one era keeps it
        self.delete_passed, self.encoder, self.log = delete_passed, encoder, log
        self.wait_seconds = 0.0  # waited for eras since the training loop last took it
        self._layout = cache.layout(seed, seq_len)
        self._final = not cache.encoded_beside_training  # the stream's end is known: the layout no longer changes
        self._open: dict[int, np.ndarray] = {}
        self._position: tuple[int, int] | None = None
        # Whether to give up a wait for an era (`WaitStopped`): a SIGTERM's grace is seconds, an era's may be more.
        self.stop_waiting: Callable[[], bool] = lambda: False

    def layout(self) -> order.Layout:
        if not self._final and "final_tokens" in self.cache.record():  # the stream ended: its length is known
            self._final = True
            self._layout = self.cache.layout(self.seed, self.seq_len)
            self._open.clear()
        return self._layout

    def _era(self, era: int, step: int) -> np.ndarray | None:
        """Era `era`'s tokens, waited for; None when the stream's end became known meanwhile."""
        if era in self._open:
            return self._open[era]
        started, said, final = time.perf_counter(), False, self._final
        while (tokens := self.cache.verified(era)) is None:
            ended = self.encoder is not None and self.encoder.poll() is not None
            # Looked at after the encoder's end is seen: what it wrote before it ended is there now.
            if self.layout() is not self._layout or self._final != final:
                return None
            if ended and (tokens := self.cache.verified(era)) is not None:
                break
            if not self.cache.encoded_beside_training:  # nothing would build it: encoded before the first step
                raise DataError(f"the training split's {self.cache.paths(0)[0]} is gone; run the same command to "
                                f"resume (it is encoded again)")
            if ended and self.encoder.returncode == 0:
                raise DataError(f"era {era} is not in {self.cache.directory}, and the era encoder has ended, its "
                                f"work done: something else deleted it; run the same command to resume (it is "
                                f"encoded again)")
            if ended:
                raise DataError(f"the era encoder stopped (exit code {self.encoder.returncode}, its message is above) "
                                f"before era {era}; fix what it says and run the same command to resume")
            if self.stop_waiting():
                raise WaitStopped(f"step {step + 1} stopped waiting for era {era}")
            if not said:
                self.log(f"step {step + 1} waits for era {era} of the training split (being encoded)")
                said = True
            time.sleep(_POLL_S)
        if said:
            waited = time.perf_counter() - started
            self.wait_seconds += waited
            self.log(f"step {step + 1} waited {waited:.1f} s for era {era}")
        self._open[era] = tokens
        return tokens

    def batch(self, step: int, batch_size: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """This process's rows of the step's batch: int32 [batch_size // process_count, seq_len + 1]."""
        rows = batcher.local_rows(batch_size, process_index, process_count)
        if self.order == "random":
            return batcher.random_windows(self._era(0, step), seed=self.seed, step=step, batch_size=batch_size,
                                          seq_len=self.seq_len, rows=rows)
        positions = np.arange(step * batch_size, (step + 1) * batch_size)
        while True:
            final, layout = self._final, self.layout()
            epochs, eras_of_step, offsets = layout.locate(positions)
            sequence = layout.era_sequence_number(epochs, eras_of_step)
            self._window(layout, int(sequence.min()), int(sequence.max()))
            eras = {int(era): self._era(int(era), step) for era in np.unique(eras_of_step)}
            # A stream that ended short (its end recorded before the last era's manifest) changes the layout.
            if all(tokens is not None for tokens in eras.values()) and self.layout() is layout and final == self._final:
                break
        return batcher.read_windows(eras, eras_of_step[rows], offsets[rows], self.seq_len)

    def _window(self, layout: order.Layout, first: int, last: int) -> None:
        """The step reads the eras of sequence numbers first..last: the encoder is told, the rest let go."""
        if not self.keep_eras or self._position == (first, last):
            return
        self._position = (first, last)
        if self.delete_passed:
            atomic.write(self.cache.position_path, json.dumps({"sequence": first, "needed": last}))
            try:
                drop_outside(self.cache, layout, first, max(self.keep_eras, last - first + 1))
            except OSError as error:  # the encoder would wait for room that never comes: stop, at the checkpoints
                raise DataError(f"the passed eras in {self.cache.directory} cannot be deleted ({error.strerror}), "
                                f"so keep_eras={self.keep_eras} cannot bound them; make the directory writable "
                                f"(or --config.data.keep_eras=0 to keep every era) and run the same command to "
                                f"resume from the last checkpoint") from None
        window = {sequence % layout.num_eras for sequence in range(first, max(first + self.keep_eras, last + 1))}
        for era in set(self._open) - window:
            del self._open[era]


def drop_outside(cache: EraCache, layout: order.Layout, position: int, keep_eras: int) -> None:
    """Deletes the eras on disk outside the keep_eras of the run's order from `position` on."""
    window = {sequence % layout.num_eras for sequence in range(position, position + keep_eras)}
    for era in set(cache.on_disk()) - window:
        cache.delete(era)


def check_space(cache: EraCache, keep_eras: int) -> None:
    """Stops unless the disk holds the bytes the eras still to write need: keep_eras + 1 of them at once, else all."""
    count = -(-cache.planned_tokens // cache.era_tokens) + len(cache.record().get("extended_from", ()))
    at_once = min(count, keep_eras + 1) if keep_eras else count
    on_disk = sum(os.path.getsize(cache.paths(era)[0]) for era in cache.on_disk() if cache.built(era))
    require_space(cache.directory, max(0, at_once * cache.era_tokens * TOKEN_BYTES - on_disk))

