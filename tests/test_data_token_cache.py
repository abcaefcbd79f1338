import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from andrea_jax.data import DataError, token_cache
from andrea_jax.data.sources import ListDocuments
from andrea_jax.data.tokenizer import ByteTokenizer, CharTokenizer

DOCS = ["first doc é", "", "second 😀", "café"]
IDENTITY = {"source": "test", "split_rule": "none"}


def build(tmp_path, documents=DOCS, tokenizer=None, split="train"):
    tokenizer = tokenizer or ByteTokenizer()
    directory = token_cache.cache_directory(str(tmp_path), IDENTITY, tokenizer.sha256)
    return directory, token_cache.build(ListDocuments(documents), tokenizer, directory, split,
                                        IDENTITY, progress=False)


def test_documents_are_encoded_with_end_of_text_after_each(tmp_path):
    directory, split = build(tmp_path)
    expected = []
    for doc in DOCS:
        if doc:  # empty documents add nothing
            expected += list(doc.encode("utf-8")) + [256]
    assert split.tokens.dtype == np.uint16
    assert split.tokens.tolist() == expected
    assert split.num_tokens == len(expected)
    assert split.num_bytes == sum(len(d.encode("utf-8")) for d in DOCS)
    manifest = split.manifest
    assert (manifest["format_version"], manifest["source"], manifest["vocab_size"]) == (1, IDENTITY, 257)
    assert manifest["tokenizer_sha256"] == ByteTokenizer().sha256
    assert sorted(os.listdir(directory)) == ["train.bin", "train.json"]


def test_a_tokenizer_without_end_of_text_joins_documents(tmp_path):
    """nanoGPT's char vocabulary has no end-of-text: the documents abut, as in its train.bin."""
    documents = ["abc", "", "ca\nb"]
    tokenizer = CharTokenizer("abc\n", end_of_text=False)
    _, split = build(tmp_path, documents, tokenizer)
    assert split.tokens.tolist() == tokenizer.encode("abcca\nb") == [1, 2, 3, 3, 1, 0, 2]
    assert split.manifest["eot_id"] is None and split.manifest["vocab_size"] == 4


def test_many_batches_match_one_encoding(tmp_path):
    documents = [f"document number {i} " * (i % 7 + 1) for i in range(3000)]
    _, split = build(tmp_path, documents)
    tokenizer = ByteTokenizer()
    expected = np.concatenate([np.append(ids, 256) for ids in tokenizer.encode_arrays(documents)])
    np.testing.assert_array_equal(split.tokens, expected)


def test_reload_reuses_the_cache(tmp_path):
    directory, built = build(tmp_path)
    modified = os.path.getmtime(built.path)
    loaded = token_cache.load_or_build(ListDocuments(["would be different"]), ByteTokenizer(),
                                       directory, "train", IDENTITY, progress=False)
    np.testing.assert_array_equal(loaded.tokens, built.tokens)
    assert os.path.getmtime(loaded.path) == modified


def test_changed_source_or_tokenizer_gets_another_directory():
    byte = ByteTokenizer().sha256
    char = CharTokenizer("abc").sha256
    directory = token_cache.cache_directory("/c", IDENTITY, byte)
    assert os.path.dirname(directory) == "/c/tokens" and len(os.path.basename(directory)) == 20
    assert directory == token_cache.cache_directory("/c", dict(reversed(IDENTITY.items())), byte)
    assert directory != token_cache.cache_directory("/c", IDENTITY, char)
    assert directory != token_cache.cache_directory("/c", {**IDENTITY, "source": "other"}, byte)


def test_truncated_cache_is_detected_and_rebuilt(tmp_path, capsys):
    directory, built = build(tmp_path)
    expected = built.tokens.tolist()
    with open(built.path, "r+b") as f:
        f.truncate(6)
    cached, problem = token_cache.load(directory, "train")
    assert cached is None and "token file has 6 bytes" in problem
    rebuilt = token_cache.load_or_build(ListDocuments(DOCS), ByteTokenizer(), directory, "train",
                                        IDENTITY, progress=False)
    assert rebuilt.tokens.tolist() == expected
    assert "unusable (token file has 6 bytes" in capsys.readouterr().out


def test_corrupt_manifest_is_detected(tmp_path):
    directory, _ = build(tmp_path)
    with open(os.path.join(directory, "train.json"), "w") as f:
        f.write('{"num_tokens": ')
    cached, problem = token_cache.load(directory, "train")
    assert cached is None and problem.startswith("unreadable manifest")


def test_killed_build_leaves_no_complete_looking_cache(tmp_path):
    directory = str(tmp_path / "cache")
    os.makedirs(directory)
    # What a build killed mid-write leaves: a temporary token file, no manifest.
    with open(os.path.join(directory, "train.bin.tmp"), "wb") as f:
        f.write(np.arange(10, dtype=np.uint16).tobytes())
    assert token_cache.load(directory, "train") == (None, "")
    split = token_cache.build(ListDocuments(DOCS), ByteTokenizer(), directory, "train",
                              IDENTITY, progress=False)
    assert split.num_tokens > 10
    assert sorted(os.listdir(directory)) == ["train.bin", "train.json"]


def test_a_cache_that_cannot_be_written_raises_its_own_error(tmp_path, monkeypatch):
    def refuse(path, *args, **kwargs):  # what a read-only cache directory gives a non-root user
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(token_cache, "open", refuse, raising=False)
    with pytest.raises(PermissionError, match="Permission denied"):
        build(tmp_path)


class HugeVocabulary(ByteTokenizer):
    vocab_size = 70_000


class OutOfRangeIds(ByteTokenizer):
    def encode_arrays(self, texts):
        return [np.array([1, 2, 300], np.int32) for _ in texts]


def test_vocabulary_beyond_uint16_is_refused(tmp_path):
    with pytest.raises(DataError, match="does not fit the uint16"):
        build(tmp_path, tokenizer=HugeVocabulary())


def test_ids_beyond_the_vocabulary_are_refused(tmp_path):
    with pytest.raises(DataError, match="produced id 300, outside its vocabulary of 257"):
        build(tmp_path, tokenizer=OutOfRangeIds())
    # Nothing is left behind: no manifest and no temporary token file.
    assert os.listdir(token_cache.cache_directory(str(tmp_path), IDENTITY, OutOfRangeIds().sha256)) == []


def test_empty_split_is_refused(tmp_path):
    with pytest.raises(DataError, match="no text"):
        build(tmp_path, documents=["", ""], split="val")


def test_manifest_is_json_with_counts(tmp_path):
    directory, split = build(tmp_path)
    with open(os.path.join(directory, "train.json")) as f:
        manifest = json.load(f)
    assert manifest["num_tokens"] == split.num_tokens
    assert manifest["num_documents"] == len(DOCS)
    assert manifest["dtype"] == "uint16"


class RecordedReads(ListDocuments):
    def read(self, start, stop):
        self.stops.append(min(stop, len(self)))
        return super().read(start, stop)


def test_max_tokens_stops_the_split_there_and_reads_no_further(tmp_path):
    documents = RecordedReads([f"doc {i} é " * (i % 9 + 1) for i in range(20_000)])
    object.__setattr__(documents, "stops", [])
    split = token_cache.build(documents, ByteTokenizer(), str(tmp_path), "train", IDENTITY,
                              progress=False, max_tokens=100_000)
    expected = [t for d in documents for t in [*d.encode("utf-8"), 256]]
    needed = int(np.searchsorted(np.cumsum([len(d.encode()) + 1 for d in documents]), 100_000)) + 1
    assert split.tokens.tolist() == expected[:100_000]
    assert split.manifest["num_documents"] == needed and split.manifest["max_tokens"] == 100_000
    kept = expected[:100_000]
    assert split.num_bytes == len(kept) - kept.count(256)  # one byte a token, but the end-of-text ones
    # 1,733 of the 20,000 documents hold the tokens; the reads go no further than a few past them.
    assert needed <= max(documents.stops) <= needed + 16


_SLOW_BUILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from andrea_jax.data import token_cache
from andrea_jax.data.sources import ListDocuments
from andrea_jax.data.tokenizer import ByteTokenizer

class SlowDocuments(ListDocuments):
    def read(self, start, stop):
        time.sleep(0.005 * (stop - start))  # 640 documents: the build takes about 3 s
        return super().read(start, stop)

docs = SlowDocuments(["slow %d" % i for i in range(640)])
split = token_cache.load_or_build(docs, ByteTokenizer(), sys.argv[2], "train", {"source": "test"}, progress=False)
print(split.num_tokens)
"""


def test_a_second_process_waits_for_the_first_build_and_reads_it(tmp_path):
    """Without the lock, the second build deletes the first one's half-written file and the first fails."""
    directory = str(tmp_path / "cache")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    first = subprocess.Popen([sys.executable, "-c", _SLOW_BUILD, root, directory],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(".tmp" in name for name in (os.listdir(directory) if os.path.isdir(directory) else [])):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.01)
    split = token_cache.load_or_build(ListDocuments(["other text"]), ByteTokenizer(), directory, "train",
                                      {"source": "test"}, progress=False)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-2000:]
    expected = sum(len(f"slow {i}") + 1 for i in range(640))
    assert int(out.split()[-1]) == expected
    assert split.num_tokens == expected  # the first process's cache, not a rebuild from "other text"
    assert split.tokens[:7].tolist() == list(b"slow 0") + [256]


class InterruptedDocuments(ListDocuments):
    """Documents whose read from `stop_at` on is interrupted once (a kill, as far as the build knows);
    every read's start is recorded."""

    def __init__(self, texts, stop_at):
        super().__init__(texts)
        self.stop_at, self.starts = stop_at, []

    def read(self, start, stop):
        self.starts.append(start)
        if self.stop_at is not None and stop > self.stop_at:
            self.stop_at = None
            raise KeyboardInterrupt
        return super().read(start, stop)


def test_an_interrupted_build_goes_on_from_its_last_chunk_and_ends_identical(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(token_cache, "CHUNK_TOKENS", 200)
    monkeypatch.setattr(token_cache, "_ESTIMATE_AFTER_BYTES", 1000)
    texts = [f"document {i} " + "words " * (i % 7) for i in range(600)]
    reference = token_cache.build(ListDocuments(texts), ByteTokenizer(), str(tmp_path / "a"), "train", IDENTITY,
                                  progress=False, max_tokens=15_000)
    # Once some text is encoded, the build says what is left and how long it should take on this machine.
    assert re.search(r"the train split has [\d,]+ tokens left to encode, about 0\.00 GB of text at its 0\.9\d bytes "
                     r"a token so far; at this machine's [\d.]+ MB/s that takes about \d+ minutes", capsys.readouterr().out)
    directory, documents = str(tmp_path / "b"), InterruptedDocuments(texts, stop_at=300)
    with pytest.raises(KeyboardInterrupt):
        token_cache.build(documents, ByteTokenizer(), directory, "train", IDENTITY, progress=False, max_tokens=15_000)
    assert token_cache.load(directory, "train") == (None, "")  # not a cache yet
    with open(os.path.join(directory, "train.progress.json")) as f:
        finished = json.load(f)
    assert 0 < finished["num_documents"] <= 300 and finished["num_tokens"] >= 200
    assert os.path.getsize(os.path.join(directory, "train.bin.tmp")) >= 2 * finished["num_tokens"]
    # The disk check counts what the finished chunks hold: room for the rest is enough, a byte less is not.
    room = 2 * (15_000 - finished["num_tokens"])
    monkeypatch.setattr(token_cache.shutil, "disk_usage", lambda path: type("Usage", (), {"free": room - 1}))
    with pytest.raises(token_cache.atomic.DiskFull):
        token_cache.build(documents, ByteTokenizer(), directory, "train", IDENTITY, progress=False, max_tokens=15_000)
    monkeypatch.setattr(token_cache.shutil, "disk_usage", lambda path: type("Usage", (), {"free": room}))
    documents.starts.clear()
    resumed = token_cache.build(documents, ByteTokenizer(), directory, "train", IDENTITY, progress=False,
                                max_tokens=15_000)
    assert documents.starts[0] == finished["num_documents"]  # no document before the chunk is read again
    assert open(resumed.path, "rb").read() == open(reference.path, "rb").read()
    without_time = lambda manifest: {k: v for k, v in manifest.items() if k != "build_seconds"}
    assert without_time(resumed.manifest) == without_time(reference.manifest)
    assert sorted(os.listdir(directory)) == ["train.bin", "train.json"]  # the progress record goes with the build


def test_a_build_the_disk_cannot_hold_stops_before_reading(tmp_path, monkeypatch):
    free = type("Usage", (), {"free": 10_000})
    monkeypatch.setattr(token_cache.shutil, "disk_usage", lambda path: free)
    documents = InterruptedDocuments(DOCS, stop_at=None)
    with pytest.raises(token_cache.atomic.DiskFull) as refused:
        token_cache.build(documents, ByteTokenizer(), str(tmp_path), "train", IDENTITY, progress=False,
                          max_tokens=1_000_000)
    message = str(refused.value)
    assert f"needs 2.00 MB more in {tmp_path} and 0.01 MB is free there" in message  # a million uint16 tokens
    assert "\n" not in message and "data.cache_dir" in message
    assert documents.starts == [] and os.listdir(tmp_path) == []
