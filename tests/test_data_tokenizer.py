import collections
import json
import os
import pickle

import numpy as np
import pytest

from andrea_jax.data import DataError, local_files
from andrea_jax.data import tokenizer as tokenizers

SAMPLES = [
    "plain ascii, with  two spaces\nand a newline",
    "emoji 😀👩‍👩‍👧 and flags 🇫🇷, CJK 漢字かな, accents éàü, math ∑∫",
    "\t\r\n\x00\x7f control characters",
    "literal <|endoftext|> inside a document",
    "",
]
SHAKESPEARE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                           "tinyshakespeare.txt")


@pytest.fixture(scope="module")
def bpe():
    """The full 8449-entry BPE, trained on a few MB of standard-library source."""
    root, files = local_files.list_stdlib_files()
    texts, size = [], 0
    for path in files[::3]:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
        size += len(texts[-1])
        if size > 3_000_000:
            break
    return tokenizers.train_bpe(texts)


def test_bpe_has_exactly_8449_entries_with_end_of_text_last(bpe):
    assert bpe.vocab_size == 8449
    assert len(json.loads(bpe.to_json())["model"]["merges"]) == 8192
    assert bpe.eot_id == 8448
    assert bpe.decode([bpe.eot_id]) == "<|endoftext|>"
    # The first 256 ids are the 256 single bytes, in some order.
    assert sorted(bpe._table[i] for i in range(256)) == [bytes([b]) for b in range(256)]


@pytest.mark.parametrize("name", ["bpe", "byte"])
def test_round_trip_is_exact_for_any_text(name, bpe):
    tokenizer = bpe if name == "bpe" else tokenizers.ByteTokenizer()
    for text in SAMPLES:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode_batch(SAMPLES) == [tokenizer.encode(t) for t in SAMPLES]


def test_bpe_compresses_source_code(bpe):
    text = "def function(self, argument):\n    return self.value + argument\n" * 20
    assert len(bpe.encode(text)) < len(text.encode()) / 3


def test_decode_of_arbitrary_ids_never_raises(bpe):
    rng = np.random.default_rng(0)
    for tokenizer in (bpe, tokenizers.ByteTokenizer(), tokenizers.CharTokenizer("abc")):
        ids = rng.integers(-5, tokenizer.vocab_size + 200, size=500).tolist()
        text = tokenizer.decode(ids)
        assert isinstance(text, str) and len(text) > 0
        text.encode("utf-8")  # printable: no lone surrogates


def test_byte_tokenizer_is_257_bytes_plus_end_of_text():
    tokenizer = tokenizers.ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.eot_id) == (257, 256)
    assert tokenizer.encode("é😀") == list("é😀".encode())


def test_char_tokenizer_is_sorted_characters_plus_end_of_text():
    tokenizer = tokenizers.build_char(["hello", "world!"])
    assert tokenizer.chars == sorted(set("helloworld!"))
    assert (tokenizer.vocab_size, tokenizer.eot_id) == (9, 8)
    assert tokenizer.encode("hello") == [tokenizer.chars.index(c) for c in "hello"]
    assert tokenizer.decode(tokenizer.encode("world") + [8]) == "world<|endoftext|>"
    with pytest.raises(DataError, match="not in the char vocabulary"):
        tokenizer.encode("hello?")


def test_char_tokenizer_of_tinyshakespeare_has_65_plus_1_entries():
    if not os.path.exists(SHAKESPEARE):
        pytest.skip(f"{SHAKESPEARE} is not on this machine")
    with open(SHAKESPEARE, encoding="utf-8") as f:
        text = f.read()
    tokenizer = tokenizers.build_char([text])
    assert (tokenizer.vocab_size, tokenizer.eot_id) == (66, 65)
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("name", ["bpe", "byte", "char", "char without end-of-text"])
def test_save_and_load_keep_ids_and_hash(name, bpe, tmp_path):
    tokenizer = {"bpe": bpe, "byte": tokenizers.ByteTokenizer(),
                 "char": tokenizers.build_char(SAMPLES),
                 "char without end-of-text": tokenizers.CharTokenizer("".join(SAMPLES), end_of_text=False),
                 }[name]
    path = tmp_path / "tokenizer.json"
    tokenizer.save(path)
    loaded = tokenizers.load(path)
    assert (loaded.kind, loaded.vocab_size, loaded.eot_id) == (tokenizer.kind, tokenizer.vocab_size,
                                                               tokenizer.eot_id)
    assert loaded.sha256 == tokenizer.sha256
    assert loaded.encode_batch(SAMPLES) == tokenizer.encode_batch(SAMPLES)
    assert not list(tmp_path.glob("*.tmp*"))


def test_hash_differs_between_tokenizers(bpe):
    hashes = {bpe.sha256, tokenizers.ByteTokenizer().sha256, tokenizers.build_char(["ab"]).sha256,
              tokenizers.build_char(["abc"]).sha256, tokenizers.CharTokenizer("abc", end_of_text=False).sha256}
    assert len(hashes) == 5


def nanogpt_meta(text: str) -> dict:
    """The meta.pkl content nanoGPT's shakespeare_char/prepare.py writes."""
    chars = sorted(set(text))
    return {"vocab_size": len(chars), "itos": {i: c for i, c in enumerate(chars)},
            "stoi": {c: i for i, c in enumerate(chars)}}


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_nanogpt_meta_pkl_is_a_char_tokenizer_without_end_of_text(tmp_path, protocol):
    text = "First Citizen:\nBefore we proceed any further, hear me speak. ¿Qué? 日本"
    meta = nanogpt_meta(text)
    path = tmp_path / "meta.pkl"
    path.write_bytes(pickle.dumps(meta, protocol=protocol))
    tokenizer = tokenizers.load(path)
    assert (tokenizer.kind, tokenizer.vocab_size, tokenizer.eot_id) == ("char", meta["vocab_size"], None)
    assert tokenizer.encode(text) == [meta["stoi"][c] for c in text]
    assert tokenizer.decode(tokenizer.encode(text) + [meta["vocab_size"]]) == text + "\ufffd"  # no end-of-text id


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)  # what a general unpickle would run


def test_meta_pkl_other_than_a_plain_dict_is_refused_unrun(tmp_path):
    marker = str(tmp_path / "unpickled")
    good = nanogpt_meta("abc")
    cases = {
        "code": ({**good, "payload": _RunsCode(marker)}, r"asks for \w+\.mkdir"),
        "a class": ({**good, "itos": collections.OrderedDict(enumerate("abc"))}, "asks for collections"),
        "a list": ({**good, "itos": list("abc")}, "no itos dict"),
        "a float": ({**good, "vocab_size": 3.0}, "no itos dict"),
        "unsorted": ({**good, "itos": {0: "b", 1: "a", 2: "c"}}, "sorted order"),
        "stoi off": ({**good, "stoi": {"a": 1, "b": 0, "c": 2}}, "inverse of itos"),
        "no itos": ({"vocab_size": 3}, "no itos"),
        "not a dict": ([good], "no itos dict"),
    }
    for name, (content, words) in cases.items():
        path = tmp_path / f"{name}.pkl"
        path.write_bytes(pickle.dumps(content))
        with pytest.raises(DataError, match=words) as error:
            tokenizers.load(path)
        assert "not nanoGPT's character vocabulary" in str(error.value) and "\n" not in str(error.value), name
    path.write_bytes(pickle.dumps(good)[:-5])
    with pytest.raises(DataError, match="unreadable"):
        tokenizers.load(path)
    assert not os.path.exists(marker)


def test_bpe_stops_at_the_merges_a_small_text_allows():
    tokenizer = tokenizers.train_bpe(["abababab cdcdcd"] * 10, num_merges=8192)
    assert 257 < tokenizer.vocab_size < 300
    assert tokenizer.eot_id == tokenizer.vocab_size - 1


def test_load_rejects_files_that_are_not_tokenizers(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(DataError, match="cannot read tokenizer"):
        tokenizers.load(broken)
    word_level = tmp_path / "word.json"
    word_level.write_text(json.dumps({"model": {"type": "WordLevel"}, "pre_tokenizer": None}))
    with pytest.raises(DataError, match="not a byte-level BPE"):
        tokenizers.load(word_level)
    with pytest.raises(DataError, match="cannot read tokenizer"):
        tokenizers.load(tmp_path / "missing.json")
