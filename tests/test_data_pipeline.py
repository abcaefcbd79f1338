import json
import os
import re

import numpy as np
import pytest

from andrea_jax.config import ConfigError, base_config
from andrea_jax.data import DataError, batcher, pipeline, sources, token_cache
from andrea_jax.data import tokenizer as tokenizers

SHAKESPEARE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                           "tinyshakespeare.txt")


def whole_train(prepared):
    """A finite training split's one era, as its token file."""
    return token_cache.read(*prepared.train.paths(0), "")


def make_corpus(directory, num_files=120):
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(num_files):
        body = "".join(f"def function_{i}_{j}(x):\n    return x * {j} + {i}  # café ✓\n"
                       for j in range(30))
        (directory / f"module_{i:03d}.py").write_text(body)
    (directory / "notes.md").write_bytes(b"# notes\nlatin-1 byte: \xe9\n")
    return directory


def make_config(tmp_path, source, tokenizer="byte", vocab_size=0):
    config = base_config()
    config.batch_size, config.seq_len = 4, 32
    config.model.vocab_size = vocab_size
    config.data.source = source
    config.data.tokenizer = tokenizer
    config.data.cache_dir = str(tmp_path / "cache")
    config.data.tfds_data_dir = str(tmp_path / "tfds")
    config.data.val_fraction = 0.1
    return config


def test_local_directory_end_to_end_with_bpe_and_a_restart(tmp_path, capsys):
    corpus = make_corpus(tmp_path / "corpus")
    config = make_config(tmp_path, f"text:{corpus}", tokenizer="bpe")
    config.data.tokenizer_train_bytes = 50_000
    workdir = tmp_path / "run"
    first = pipeline.prepare(config, str(workdir))
    first_train = whole_train(first)
    # Each slow start-up stage says what it is doing before it starts.
    assert capsys.readouterr().out.splitlines() == [
        "training the BPE tokenizer (8192 merges) on up to 0.05 MB of the training split",
        f"encoding the train split into the token cache {first_train.path}",
        f"encoding the val split into the token cache {first.val.path}"]

    tokenizer = first.tokenizer
    assert tokenizer.kind == "bpe" and 257 < tokenizer.vocab_size <= 8449
    assert tokenizer.eot_id == tokenizer.vocab_size - 1
    saved = tokenizers.load(workdir / "tokenizer.json")
    assert saved.sha256 == tokenizer.sha256
    # 121 files: every 10th of them is validation.
    assert first_train.tokens.tolist().count(tokenizer.eot_id) == 109
    assert first.val.tokens.tolist().count(tokenizer.eot_id) == 12
    total_bytes = sum(os.path.getsize(p) for p in corpus.iterdir())
    assert first_train.num_bytes + first.val.num_bytes == total_bytes + 2  # the latin-1 byte reads as U+FFFD
    text = tokenizer.decode(first_train.tokens[:200])
    assert text.startswith("def function_0_0(x):\n")

    # A restart: same tokenizer (not retrained), same caches (not rebuilt), same batches.
    config.data.tokenizer_train_bytes = 10_000  # would train another tokenizer
    modified = os.path.getmtime(first_train.path)
    resumed = pipeline.prepare(config, str(workdir))
    assert capsys.readouterr().out == ""  # nothing to train or encode
    assert resumed.tokenizer.sha256 == tokenizer.sha256
    assert resumed.train == first.train
    assert os.path.getmtime(first_train.path) == modified
    for step in (0, 7, 123):
        np.testing.assert_array_equal(
            batcher.random_windows(whole_train(resumed).tokens, seed=0, step=step, batch_size=4, seq_len=32),
            batcher.random_windows(first_train.tokens, seed=0, step=step, batch_size=4, seq_len=32))
    with open(workdir / "data.json") as f:
        assert json.load(f)["tokenizer_sha256"] == tokenizer.sha256

    # A new workdir on the same source and sample reuses the BPE data.cache_dir keeps, and so its caches;
    # another sample size trains a tokenizer of its own, kept beside the first.
    config.data.tokenizer_train_bytes = 50_000
    kept = pipeline.kept_bpe_path(config, pipeline.open_splits(config), 8192)
    second = pipeline.prepare(config, str(tmp_path / "second"))
    assert capsys.readouterr().out.splitlines() == [  # nothing encoded
        f"reusing the BPE tokenizer trained on this source before: {kept}"]
    assert second.tokenizer.sha256 == tokenizer.sha256 and second.train.paths(0) == first.train.paths(0)
    assert tokenizers.load(tmp_path / "second" / "tokenizer.json").sha256 == tokenizer.sha256
    config.data.tokenizer_train_bytes = 10_000
    third = pipeline.prepare(config, str(tmp_path / "third"))
    assert capsys.readouterr().out.splitlines()[0] == (
        "training the BPE tokenizer (8192 merges) on up to 0.01 MB of the training split")
    assert third.tokenizer.sha256 != tokenizer.sha256
    assert len(os.listdir(tmp_path / "cache" / "tokenizers")) == 2


@pytest.mark.parametrize("left", [b"", b'{"pre_tokenizer": {"type": "ByteLevel"}}'])
def test_an_unreadable_kept_bpe_is_trained_again_and_replaced(tmp_path, capsys, left):
    # A crash can leave the kept tokenizer.json empty or cut short: it is the cache's, not the user's.
    config = make_config(tmp_path, f"text:{make_corpus(tmp_path / 'corpus', 20)}", tokenizer="bpe")
    config.data.tokenizer_train_bytes = 20_000
    kept = pipeline.kept_bpe_path(config, pipeline.open_splits(config), 8192)
    os.makedirs(os.path.dirname(kept))
    with open(kept, "wb") as f:
        f.write(left)
    prepared = pipeline.prepare(config, str(tmp_path / "run"))
    assert capsys.readouterr().out.splitlines()[:2] == [
        f"the BPE tokenizer kept at {kept} is unreadable; training it again, to keep in its place",
        "training the BPE tokenizer (8192 merges) on up to 0.02 MB of the training split"]
    assert tokenizers.load(kept).sha256 == prepared.tokenizer.sha256


def test_the_kept_bpe_is_keyed_by_the_recipe(tmp_path, monkeypatch):
    config = make_config(tmp_path, f"text:{make_corpus(tmp_path / 'corpus', 2)}", tokenizer="bpe")
    splits = pipeline.open_splits(config)
    before = pipeline.kept_bpe_path(config, splits, 8192)
    monkeypatch.setattr(tokenizers, "BPE_RECIPE_VERSION", tokenizers.BPE_RECIPE_VERSION + 1)
    assert pipeline.kept_bpe_path(config, splits, 8192) != before


def test_stdlib_source_with_byte_tokens(tmp_path):
    prepared = pipeline.prepare(make_config(tmp_path, "stdlib"), str(tmp_path / "run"))
    assert prepared.tokenizer.vocab_size == 257
    train = whole_train(prepared)
    # Byte tokens: one per byte plus one end-of-text per document.
    assert train.num_tokens == train.num_bytes + train.tokens.tolist().count(256)
    assert train.num_bytes > 2_000_000
    assert json.load(open(tmp_path / "run" / "data.json"))["source"]["val_rule"] == "every 10th document"
    assert train.tokens.max() == 256 and train.tokens.dtype == np.uint16


def test_other_processes_read_what_the_leader_wrote(tmp_path):
    config = make_config(tmp_path, f"text:{make_corpus(tmp_path / 'corpus')}")
    with pytest.raises(DataError, match="the leading process must prepare the data first"):
        pipeline.prepare(config, str(tmp_path / "run"), is_leader=False)
    leader = pipeline.prepare(config, str(tmp_path / "run"), is_leader=True)
    follower = pipeline.prepare(config, str(tmp_path / "run"), is_leader=False)
    assert follower.tokenizer.sha256 == leader.tokenizer.sha256
    np.testing.assert_array_equal(follower.val.tokens, leader.val.tokens)
    assert follower.train == leader.train
    os.remove(leader.train.paths(0)[1])  # a cache_dir this process does not share with the leader
    with pytest.raises(DataError, match=r"^the training token cache in .* is missing; put data.cache_dir on a "
                                        r"filesystem all processes share$"):
        pipeline.prepare(config, str(tmp_path / "run"), is_leader=False)


def test_vocabulary_size_must_match_the_model(tmp_path):
    config = make_config(tmp_path, f"text:{make_corpus(tmp_path / 'corpus')}", vocab_size=8449)
    with pytest.raises(DataError, match="has 257 entries but model.vocab_size=8449; "
                                        "set model.vocab_size=257"):
        pipeline.prepare(config, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "tokenizer.json").exists()


def test_resuming_with_another_tokenizer_kind_is_refused(tmp_path):
    config = make_config(tmp_path, f"text:{make_corpus(tmp_path / 'corpus')}")
    pipeline.prepare(config, str(tmp_path / "run"))
    config.data.tokenizer = "char"
    with pytest.raises(DataError, match="is a byte tokenizer but data.tokenizer='char'"):
        pipeline.prepare(config, str(tmp_path / "run"))


def test_tokenizer_file_from_the_config_is_copied_into_the_workdir(tmp_path):
    path = tmp_path / "mine.json"
    tokenizers.build_char(["abcdefghijklmnopqrstuvwxyz _(),:-\n+*#0123456789éäç✓\ufffd"]).save(path)
    corpus = make_corpus(tmp_path / "corpus")
    config = make_config(tmp_path, f"text:{corpus}", tokenizer=str(path))
    prepared = pipeline.prepare(config, str(tmp_path / "run"))
    assert prepared.tokenizer.kind == "char"
    assert tokenizers.load(tmp_path / "run" / "tokenizer.json").sha256 == \
        tokenizers.load(path).sha256
    config.data.tokenizer = "missing.json"
    with pytest.raises(DataError, match="is not 'bpe', 'byte', 'char' or an existing"):
        pipeline.prepare(config, str(tmp_path / "other_run"))


def test_truncated_cache_is_rebuilt_on_the_next_run(tmp_path, capsys):
    config = make_config(tmp_path, f"text:{make_corpus(tmp_path / 'corpus')}")
    first = pipeline.prepare(config, str(tmp_path / "run"))
    expected = np.array(whole_train(first).tokens)
    with open(whole_train(first).path, "r+b") as f:
        f.truncate(100)
    again = pipeline.prepare(config, str(tmp_path / "run"))
    np.testing.assert_array_equal(whole_train(again).tokens, expected)
    assert "was changed after it was encoded (100 bytes of tokens where its manifest says" in capsys.readouterr().out


def test_a_start_checks_the_shared_caches_by_their_size_without_reading_them_whole(tmp_path, monkeypatch):
    config = make_config(tmp_path, f"text:{make_corpus(tmp_path / 'corpus')}")
    workdir = str(tmp_path / "run")
    first = pipeline.prepare(config, workdir)
    summed = []
    monkeypatch.setattr(token_cache, "crc32", lambda tokens, *chunk: summed.append(tokens.size) or 0)
    for is_leader in (True, False):
        again = pipeline.prepare(config, workdir, is_leader=is_leader)
        assert again.train.verified(0) is not None  # the loop opens the one era
    assert summed == []
    with open(first.val.path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match=r"val\.bin was changed after it was encoded \(100 bytes of tokens where its "
                                        r"manifest says [\d,]+\); put data.cache_dir on a filesystem all processes"):
        pipeline.prepare(config, workdir, is_leader=False)


def test_validation_split_smaller_than_one_batch_is_refused(tmp_path):
    config = make_config(tmp_path, f"text:{make_corpus(tmp_path / 'corpus')}")
    config.batch_size, config.seq_len = 64, 1024
    with pytest.raises(DataError, match="less than one batch"):
        pipeline.prepare(config, str(tmp_path / "run"))


def test_empty_corpus_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(DataError, match="empty corpus"):
        pipeline.prepare(make_config(tmp_path, f"text:{tmp_path / 'empty'}"), str(tmp_path / "run"))


def test_training_sample_is_bounded_and_spread_out():
    from andrea_jax.data.sources import ListDocuments

    documents = ListDocuments([f"{i:04d}" * 100 for i in range(1000)])  # 400 characters each
    sample = pipeline.training_sample(documents, 64 * 800)
    assert sum(map(len, sample)) == 64 * 800
    starts = [int(text[:4]) for text in sample]
    assert starts[0] == 0 and max(starts) >= 984  # reaches the last stretch
    assert pipeline.training_sample(ListDocuments(["ab", "cd"]), 1_000_000) == ["ab", "cd"]


def test_training_sample_of_a_stream_is_its_start_and_stops_at_its_end():
    stream = sources.StreamedDocuments(lambda: iter(["ab" * 10, "cd" * 10, "ef" * 10]))
    assert pipeline.training_sample(stream, 30) == ["ab" * 10, "cd" * 5]
    assert pipeline.training_sample(sources.StreamedDocuments(lambda: iter(["x", "y"])), 1000) == ["x", "y"]


def test_shakespeare_char_recipe_runs_offline_from_a_local_copy(tmp_path):
    """configs/shakespeare_char.py with --config.data.source=text:PATH, as the README gives it for offline use."""
    from tests.test_config import CONFIGS, load
    config = load(next(p for p in CONFIGS if p.stem == "shakespeare_char"))
    text = "".join(f"ROMEO {i}:\nBut soft, what light through yonder window breaks?\n" for i in range(150))
    (tmp_path / "input.txt").write_text(text)
    config.data.source, config.data.cache_dir = f"text:{tmp_path / 'input.txt'}", str(tmp_path / "cache")
    prepared = pipeline.prepare(config, str(tmp_path / "run"))
    assert prepared.tokenizer.kind == "char" and prepared.tokenizer.vocab_size == len(set(text)) + 1
    cut = int(len(text) * 0.9)  # nanoGPT's 90/10 split by position; + end-of-text each
    assert (prepared.train.total_tokens(), prepared.val.num_tokens) == (cut + 1, len(text) - cut + 1)
    assert prepared.tokenizer.decode(prepared.val.tokens[:-1]) == text[cut:]


def test_shakespeare_char_matches_nanogpt_split(tmp_path):
    if not os.path.exists(SHAKESPEARE):
        pytest.skip(f"{SHAKESPEARE} is not on this machine")
    config = make_config(tmp_path, f"text:{os.path.abspath(SHAKESPEARE)}", tokenizer="char")
    prepared = pipeline.prepare(config, str(tmp_path / "run"))
    assert prepared.tokenizer.vocab_size == 66
    # nanoGPT: 1,003,854 train and 111,540 val characters; + end-of-text each.
    assert (prepared.train.total_tokens(), prepared.val.num_tokens) == (1_003_855, 111_541)


def test_a_process_reading_the_leaders_cache_never_builds_one(tmp_path):
    config = make_config(tmp_path, f"text:{make_corpus(tmp_path / 'corpus', num_files=20)}")
    splits, tokenizer = pipeline.open_splits(config), tokenizers.ByteTokenizer()
    with pytest.raises(DataError, match=r"^the validation token cache in .* is missing; put data.cache_dir "
                                        r"on a filesystem all processes share$"):
        pipeline.validation_split(config, splits, tokenizer, build=False)
    assert not os.path.exists(tmp_path / "cache" / "tokens")
    built = pipeline.validation_split(config, splits, tokenizer)
    read = pipeline.validation_split(config, splits, tokenizer, build=False)
    assert read.path == built.path and read.num_tokens == built.num_tokens > 0


def test_a_cache_an_older_commit_wrote_is_read_as_it_is(tmp_path, capsys):
    """Before eras, a finite training split's train.bin had a manifest without a checksum: a resume reads it."""
    config = make_config(tmp_path, f"text:{make_corpus(tmp_path / 'corpus', num_files=20)}")
    first = pipeline.prepare(config, str(tmp_path / "run"))
    train = whole_train(first)
    older = {"format_version": 1, "split": "train", "source": {}, "num_tokens": train.num_tokens,
             "num_bytes": train.num_bytes, "num_documents": 18, "max_tokens": 0}
    with open(first.train.paths(0)[1], "w") as f:
        json.dump(older, f)
    capsys.readouterr()
    again = pipeline.prepare(config, str(tmp_path / "run"))
    assert capsys.readouterr().out == ""  # nothing encoded again
    assert again.train == first.train and again.train.manifest(0) == older
    np.testing.assert_array_equal(whole_train(again).tokens, train.tokens)


def test_a_changed_cache_in_a_directory_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    config = make_config(tmp_path, f"text:{make_corpus(tmp_path / 'corpus', num_files=20)}")
    first = pipeline.prepare(config, str(tmp_path / "run"))
    with open(first.train.paths(0)[0], "r+b") as f:
        f.truncate(100)
    monkeypatch.setattr(token_cache.os, "access", lambda path, mode: False)  # as a read-only mount, even for root
    with pytest.raises(DataError, match=r"^.*train\.bin was changed after it was encoded \(100 bytes of tokens where "
                                        r"its manifest says [\d,]+\), in a directory this process cannot write; make "
                                        r".* writable or point data.cache_dir elsewhere$"):
        pipeline.prepare(config, str(tmp_path / "run"))
    assert os.path.exists(first.train.paths(0)[1])  # nothing deleted


def unusable_cache_dir(tmp_path, config, kind: str) -> str:
    """Points data.cache_dir through a file, or at a read-only directory; returns the line that refuses it."""
    if kind == "file":
        (tmp_path / "notes.txt").write_text("a file, not a directory")
        config.data.cache_dir = str(tmp_path / "notes.txt")
        why = r"cannot be made \(Not a directory\); every directory on its path must be one that can hold it;"
    else:
        os.makedirs(config.data.cache_dir)
        os.chmod(config.data.cache_dir, 0o555)
        if os.access(config.data.cache_dir, os.W_OK):
            pytest.skip("this user writes in a read-only directory (root)")
        why = r"cannot be written to \(Permission denied\); make it \(or the directory it goes in\) writable, or"
    return rf"^data.cache_dir {re.escape(config.data.cache_dir)} {why} point data.cache_dir at another directory$"


@pytest.mark.parametrize("kind", ["file", "read-only"])
def test_a_cache_dir_that_cannot_be_used_is_one_line(tmp_path, kind):
    config = make_config(tmp_path, f"text:{make_corpus(tmp_path / 'corpus', num_files=20)}")
    with pytest.raises(ConfigError, match=unusable_cache_dir(tmp_path, config, kind)):
        pipeline.prepare(config, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run" / "tokenizer.json")  # a refused run leaves no tokenizer to reuse


def test_a_complete_cache_in_a_read_only_directory_is_read(tmp_path):
    config = make_config(tmp_path, f"text:{make_corpus(tmp_path / 'corpus', num_files=20)}")
    first = pipeline.prepare(config, str(tmp_path / "run"))
    for directory, _, _ in os.walk(config.data.cache_dir):
        os.chmod(directory, 0o555)
    again = pipeline.prepare(config, str(tmp_path / "again"))  # another run of the same source
    assert (again.train.directory, again.train.planned_tokens) == (first.train.directory, first.train.planned_tokens)
    assert again.val.path == first.val.path and again.val.num_tokens == first.val.num_tokens
