import dataclasses
import json
import os
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from andrea_jax.data import DataError, token_cache
from andrea_jax.data.sources import ListDocuments
from andrea_jax.data.tokenizer import ByteTokenizer, CharTokenizer

DOCS = ["first doc é", "", "second 😀", "café"]
IDENTITY = {"source": "test", "split_rule": "none"}


def build(tmp_path, documents=DOCS, tokenizer=None, split="train", max_tokens=0):
    tokenizer = tokenizer or ByteTokenizer()
    directory = token_cache.cache_directory(str(tmp_path), IDENTITY, tokenizer.sha256)
    documents = documents if isinstance(documents, ListDocuments) else ListDocuments(documents)
    return directory, token_cache.load_or_build(directory, split, documents, tokenizer, split, max_tokens)


def read(directory, name="train", checksum=False):
    return token_cache.read(os.path.join(directory, f"{name}.bin"), os.path.join(directory, f"{name}.json"), "fix",
                            checksum=checksum)


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
    with open(os.path.join(directory, "train.json")) as f:
        manifest = json.load(f)
    assert (manifest["split"], manifest["vocab_size"]) == ("train", 257)
    assert manifest["tokenizer_sha256"] == ByteTokenizer().sha256
    assert manifest["crc32"] == zlib.crc32(open(split.path, "rb").read())
    assert sorted(os.listdir(directory)) == ["train.bin", "train.json", "train.lock"]
    # The manifest's other fields no reader needs: the split does not carry them.
    assert [field.name for field in dataclasses.fields(split)] == ["tokens", "num_tokens", "num_bytes", "path"]


def test_a_tokenizer_without_end_of_text_joins_documents(tmp_path):
    """nanoGPT's char vocabulary has no end-of-text: the documents abut, as in its train.bin."""
    documents = ["abc", "", "ca\nb"]
    tokenizer = CharTokenizer("abc\n", end_of_text=False)
    directory, split = build(tmp_path, documents, tokenizer)
    assert split.tokens.tolist() == tokenizer.encode("abcca\nb") == [1, 2, 3, 3, 1, 0, 2]
    with open(os.path.join(directory, "train.json")) as f:
        assert json.load(f)["vocab_size"] == 4


def test_many_batches_match_one_encoding(tmp_path):
    documents = [f"document number {i} " * (i % 7 + 1) for i in range(3000)]
    _, split = build(tmp_path, documents)
    tokenizer = ByteTokenizer()
    expected = np.concatenate([np.append(ids, 256) for ids in tokenizer.encode_arrays(documents)])
    np.testing.assert_array_equal(split.tokens, expected)


def test_reload_reuses_the_cache(tmp_path):
    directory, built = build(tmp_path)
    modified = os.path.getmtime(built.path)
    loaded = token_cache.load_or_build(directory, "train", ListDocuments(["would be different"]), ByteTokenizer(),
                                       "train")
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
    with pytest.raises(DataError, match=r"train\.bin was changed after it was encoded \(6 bytes of tokens where its "
                                        r"manifest says \d+\); fix$"):
        read(directory)
    rebuilt = token_cache.load_or_build(directory, "train", ListDocuments(DOCS), ByteTokenizer(), "train")
    assert rebuilt.tokens.tolist() == expected
    assert "(6 bytes of tokens where its manifest says" in capsys.readouterr().out


def test_an_overwritten_cache_is_found_by_its_checksum(tmp_path):
    directory, built = build(tmp_path)
    with open(built.path, "r+b") as f:
        f.write(b"\x07\x00")
    with pytest.raises(DataError, match="tokens that are not those its manifest's checksum describes"):
        read(directory, checksum=True)  # as an era is opened


def test_corrupt_manifest_is_detected(tmp_path):
    directory, _ = build(tmp_path)
    with open(os.path.join(directory, "train.json"), "w") as f:
        f.write('{"num_tokens": ')
    with pytest.raises(DataError, match=r"\(its manifest unreadable\)"):
        read(directory)


def test_killed_build_leaves_no_complete_looking_cache(tmp_path):
    directory = str(tmp_path / "cache")
    os.makedirs(directory)
    # What a build killed mid-write leaves: a temporary token file, no manifest.
    with open(os.path.join(directory, "train.bin.tmp"), "wb") as f:
        f.write(np.arange(10, dtype=np.uint16).tobytes())
    assert read(directory) is None
    split = token_cache.load_or_build(directory, "train", ListDocuments(DOCS), ByteTokenizer(), "train")
    assert split.num_tokens > 10
    assert sorted(os.listdir(directory)) == ["train.bin", "train.json", "train.lock"]


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
    assert os.listdir(token_cache.cache_directory(str(tmp_path), IDENTITY, OutOfRangeIds().sha256)) == ["train.lock"]


def test_empty_split_is_refused(tmp_path):
    with pytest.raises(DataError, match="no text"):
        build(tmp_path, documents=["", ""], split="val")


def test_manifest_is_json_with_counts(tmp_path):
    directory, split = build(tmp_path)
    with open(os.path.join(directory, "train.json")) as f:
        manifest = json.load(f)
    assert manifest["num_tokens"] == split.num_tokens == os.path.getsize(split.path) // 2
    assert manifest["num_bytes"] == split.num_bytes


class RecordedReads(ListDocuments):
    def read(self, start, stop):
        self.stops.append(min(stop, len(self)))
        return super().read(start, stop)


def test_max_tokens_stops_the_split_there_and_reads_no_further(tmp_path):
    documents = RecordedReads([f"doc {i} é " * (i % 9 + 1) for i in range(20_000)])
    object.__setattr__(documents, "stops", [])
    _, split = build(tmp_path, documents, max_tokens=100_000)
    expected = [t for d in documents for t in [*d.encode("utf-8"), 256]]
    needed = int(np.searchsorted(np.cumsum([len(d.encode()) + 1 for d in documents]), 100_000)) + 1
    assert split.tokens.tolist() == expected[:100_000]
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
split = token_cache.load_or_build(sys.argv[2], "train", docs, ByteTokenizer(), "train")
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
    split = token_cache.load_or_build(directory, "train", ListDocuments(["other text"]), ByteTokenizer(), "train")
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-2000:]
    expected = sum(len(f"slow {i}") + 1 for i in range(640))
    assert int(out.split()[-1]) == expected
    assert split.num_tokens == expected  # the first process's cache, not a rebuild from "other text"
    assert split.tokens[:7].tolist() == list(b"slow 0") + [256]


class RecordedStarts(ListDocuments):
    def read(self, start, stop):
        self.starts.append(start)
        return super().read(start, stop)


def test_a_build_the_disk_cannot_hold_stops_before_reading(tmp_path, monkeypatch):
    free = type("Usage", (), {"free": 10_000})
    monkeypatch.setattr(token_cache.shutil, "disk_usage", lambda path: free)
    documents = RecordedStarts(DOCS)
    documents.starts = []
    with pytest.raises(token_cache.atomic.DiskFull) as refused:
        token_cache.load_or_build(str(tmp_path / "cache"), "train", documents, ByteTokenizer(), "train", 1_000_000)
    message = str(refused.value)
    assert f"needs 2.00 MB more in {tmp_path}/cache and 0.01 MB is free there" in message  # a million uint16 tokens
    assert "\n" not in message and "data.cache_dir" in message
    assert documents.starts == [] and os.listdir(tmp_path) == []
