"""Tokenizers: byte-level BPE (the ANDREA 8449), bytes, and characters.

All three share one small interface and save to one `tokenizer.json`; nanoGPT's
character vocabulary (`meta.pkl`) reads as a char tokenizer.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import json
import os
import pickle
from typing import Iterable, Sequence

import numpy as np

from andrea_jax.runtime import atomic
from andrea_jax.data import DataError

END_OF_TEXT = "<|endoftext|>"
BPE_MERGES = 8192  # 256 byte tokens + 8192 merges + end-of-text = 8449
# Raised when train_bpe, or the sample pipeline.training_sample draws for it, changes: it keys the kept BPE.
BPE_RECIPE_VERSION = 1
_OWN_FORMAT_KEY = "andrea_jax_tokenizer"  # marks the byte and char JSON files
_REPLACEMENT = "\ufffd".encode("utf-8")


@functools.cache
def byte_to_char() -> dict[int, str]:
    """The byte-level BPE alphabet: each byte as one printable character.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are
    shifted to code points from 256 on, so no token contains whitespace or
    control characters (the mapping GPT-2 introduced).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(shifted)}}


class Tokenizer(abc.ABC):
    """What the pipeline, the trainer and eval need from any tokenizer; each kind sets `_json` (its
    `tokenizer.json`) and `_table` (each id's bytes), which saving, hashing and decoding read."""

    kind: str
    vocab_size: int
    eot_id: int | None  # None: no end-of-text token (nanoGPT's character vocabulary), documents just abut
    _json: str
    _table: Sequence[bytes]

    @abc.abstractmethod
    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text as an int32 array (the fast path of the cache)."""

    def encode(self, text: str) -> list[int]:
        return self.encode_arrays([text])[0].tolist()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [ids.tolist() for ids in self.encode_arrays(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; never raises: unknown ids (and bytes that end mid-character) decode as U+FFFD."""
        table, size = self._table, len(self._table)
        return b"".join(table[i] if 0 <= i < size else _REPLACEMENT for i in map(int, ids)).decode("utf-8", "replace")

    def to_json(self) -> str:
        return self._json

    @functools.cached_property
    def sha256(self) -> str:
        """Hash of the JSON: keys the token caches and is checked on resume."""
        return hashlib.sha256(self._json.encode("utf-8")).hexdigest()

    def save(self, path: str | os.PathLike) -> None:
        """Writes `tokenizer.json` atomically (never a half-written file)."""
        atomic.write(path, self._json)


class ByteTokenizer(Tokenizer):
    """256 byte tokens + end-of-text (id 256): no training, any text."""

    kind = "byte"
    vocab_size = 257
    eot_id = 256
    _json = json.dumps({_OWN_FORMAT_KEY: "byte", "version": 1, "end_of_text": END_OF_TEXT})
    _table = [bytes([b]) for b in range(256)] + [END_OF_TEXT.encode()]

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) for t in texts]


class CharTokenizer(Tokenizer):
    """One token per character of the training text, sorted, + end-of-text last (if `end_of_text`)."""

    kind = "char"

    def __init__(self, chars: Sequence[str], end_of_text: bool = True) -> None:
        self.chars = sorted(set(chars))
        self.vocab_size = len(self.chars) + end_of_text
        self.eot_id = len(self.chars) if end_of_text else None
        self._json = json.dumps({_OWN_FORMAT_KEY: "char", "version": 1,
                                 "end_of_text": END_OF_TEXT if end_of_text else None, "chars": self.chars})
        self._table = [c.encode("utf-8") for c in self.chars] + [END_OF_TEXT.encode()] * end_of_text
        self._code_points = np.array([ord(c) for c in self.chars], np.uint32)

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        arrays = []
        for text in texts:
            code_points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
            unknown = code_points[~np.isin(code_points, self._code_points)]
            if unknown.size:
                unknown = chr(int(unknown[0]))
                raise DataError(
                    f"character {unknown!r} (U+{ord(unknown):04X}) is not in the char vocabulary "
                    f"built from the training text; use data.tokenizer='byte' or 'bpe'")
            arrays.append(np.searchsorted(self._code_points, code_points).astype(np.int32))
        return arrays


class BpeTokenizer(Tokenizer):
    """A byte-level BPE held by HF `tokenizers` (trained here or loaded)."""

    kind = "bpe"

    def __init__(self, hf_tokenizer) -> None:
        self._hf = hf_tokenizer
        self.eot_id = hf_tokenizer.token_to_id(END_OF_TEXT)
        if self.eot_id is None:
            raise DataError(f"the tokenizer has no {END_OF_TEXT} token; add it as a special token")
        vocab = hf_tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self._json = hf_tokenizer.to_str()
        char_to_byte = {c: b for b, c in byte_to_char().items()}
        special = {t.content for t in hf_tokenizer.get_added_tokens_decoder().values()}
        self._table = [_REPLACEMENT] * self.vocab_size
        for token, token_id in vocab.items():
            self._table[token_id] = token.encode("utf-8") if token in special else bytes(char_to_byte[c] for c in token)

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        encode = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)
        return [np.asarray(e.ids, np.int32) for e in encode(list(texts), add_special_tokens=False)]


def train_bpe(texts: Iterable[str], num_merges: int = BPE_MERGES) -> BpeTokenizer:
    """Trains the byte-level BPE; end-of-text is added after training, so it gets the last id (as a
    trainer special token it would get id 0). A small text may give fewer merges than `num_merges`."""
    from tokenizers import Tokenizer as HfTokenizer, decoders, models, pre_tokenizers, trainers

    hf = HfTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + num_merges, show_progress=False, special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer)
    hf.add_special_tokens([END_OF_TEXT])
    return BpeTokenizer(hf)


def build_char(texts: Iterable[str]) -> CharTokenizer:
    chars: set[str] = set()
    for text in texts:
        chars.update(text)
    if not chars:
        raise DataError("the training text is empty, so it has no characters; add text to the source")
    return CharTokenizer(chars)


def load(path: str | os.PathLike) -> Tokenizer:
    """Reads any `tokenizer.json` this module writes, a byte-level BPE one, or nanoGPT's meta.pkl."""
    if os.fspath(path).endswith(".pkl"):
        return read_nanogpt_meta(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        content = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"cannot read tokenizer {os.fspath(path)!r} ({error}); "
                        f"point data.tokenizer at a valid tokenizer.json") from None
    content = content if isinstance(content, dict) else {}  # a JSON list or number is no tokenizer either
    if content.get(_OWN_FORMAT_KEY) == "byte":
        return ByteTokenizer()
    if content.get(_OWN_FORMAT_KEY) == "char":
        return CharTokenizer(content["chars"], end_of_text=content.get("end_of_text") is not None)
    if (content.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise DataError(f"{os.fspath(path)!r} is not a byte-level BPE tokenizer.json; "
                        f"use one saved by this project or a GPT-2 style one")
    from tokenizers import Tokenizer as HfTokenizer

    return BpeTokenizer(HfTokenizer.from_str(text))


class _PlainValuesUnpickler(pickle.Unpickler):
    """Builds only what pickle spells without a global (dicts, strings, numbers, ...): a file that
    names any class or function, which is how a pickle runs code, is refused before anything is called."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, which a dict of strings and integers never needs")


def read_nanogpt_meta(path: str | os.PathLike) -> CharTokenizer:
    """nanoGPT's character vocabulary ({'vocab_size': n, 'itos': {i: c}, 'stoi': {c: i}}), globals refused."""
    def refuse(why: str) -> DataError:
        return DataError(f"{os.fspath(path)!r} is not nanoGPT's character vocabulary ({why}); only a plain "
                         f"dict of vocab_size, itos and stoi is read: pass the meta.pkl its prepare.py wrote")

    try:
        with open(path, "rb") as f:
            meta = _PlainValuesUnpickler(f).load()
    except Exception as error:  # missing, truncated, not a pickle, or naming a global: each its own type
        raise refuse(f"unreadable: {error}") from None
    meta = meta if isinstance(meta, dict) else {}
    itos, size = meta.get("itos"), meta.get("vocab_size")
    if not isinstance(itos, dict) or not isinstance(size, int) or len(itos) != size:
        raise refuse("no itos dict of vocab_size entries")
    chars = [itos.get(i) for i in range(size)]
    if not all(isinstance(c, str) and len(c) == 1 for c in chars) or chars != sorted(set(chars)):
        raise refuse("itos is not ids 0..vocab_size-1 to distinct characters in sorted order")
    if meta.get("stoi", {c: i for i, c in enumerate(chars)}) != {c: i for i, c in enumerate(chars)}:
        raise refuse("stoi is not the inverse of itos")
    return CharTokenizer(chars, end_of_text=False)
