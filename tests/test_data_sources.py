import logging
import time

import ml_collections
import pytest
import tensorflow_datasets as tfds

from andrea_jax.config import base_config
from andrea_jax.data import DataError, pipeline, sources

TRAIN_DOCS = [f"train document {i}" for i in range(120)]
VAL_DOCS = ["validation one", "validation two"]


class TwoSplitTexts(tfds.core.GeneratorBasedBuilder):
    """A dataset with its own validation split and a text field named 'content'."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self, features=tfds.features.FeaturesDict({"content": tfds.features.Text()}),
            disable_shuffling=True)

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(TRAIN_DOCS),
                "validation": self._generate_examples(VAL_DOCS)}

    def _generate_examples(self, docs):
        for i, doc in enumerate(docs):
            yield i, {"content": doc}


# The test builder downloads nothing, so "online" costs nothing here.
def data_config(tmp_path, **overrides) -> ml_collections.ConfigDict:
    data = base_config().data
    data.cache_dir = str(tmp_path / "cache")
    data.tfds_data_dir = str(tmp_path / "tfds")
    data.update(overrides)
    return data


def read_all(documents):
    return documents.read(0, len(documents))


def test_dataset_with_its_own_validation_split(tmp_path):
    data = data_config(tmp_path, text_field="content")
    splits = sources.open_tfds("two_split_texts", data, network_check=lambda: True)  # TwoSplitTexts
    assert read_all(splits.train) == TRAIN_DOCS
    assert read_all(splits.val) == VAL_DOCS
    assert splits.identity["val_rule"] == "split validation"


def test_dataset_without_the_validation_split_holds_out_every_kth_document(tmp_path):
    data = data_config(tmp_path, text_field="content", val_split="test", val_fraction=0.1)
    splits = sources.open_tfds("two_split_texts", data, network_check=lambda: True)
    assert read_all(splits.val) == TRAIN_DOCS[9::10]
    assert read_all(splits.train) == [d for i, d in enumerate(TRAIN_DOCS) if i % 10 != 9]
    assert splits.identity["val_rule"] == "every 10th document"


def test_missing_field_and_split_name_the_fix(tmp_path):
    with pytest.raises(DataError, match=r"no field 'text'; set data.text_field to one of \['content'\]"):
        sources.open_tfds("two_split_texts", data_config(tmp_path), network_check=lambda: True)
    with pytest.raises(DataError, match="no split 'training'"):
        sources.open_tfds("two_split_texts", data_config(tmp_path, text_field="content", train_split="training"),
                          network_check=lambda: True)


def test_unprepared_dataset_offline_fails_in_seconds(tmp_path):
    started = time.perf_counter()
    with pytest.raises(DataError, match="not prepared .* no network"):
        sources.open_tfds("two_split_texts", data_config(tmp_path, text_field="content"),
                          network_check=lambda: False)
    assert time.perf_counter() - started < 5
    assert not TwoSplitTexts(data_dir=str(tmp_path / "tfds"), file_format="array_record").is_prepared()


def test_asking_tfds_whether_a_dataset_is_prepared_shows_its_errors_and_not_its_warnings(caplog):
    from absl import logging as absl_logging

    class Builder:
        def is_prepared(self):
            absl_logging.warning("Variant folder /data/x/1.0.0 has no dataset_info.json")
            absl_logging.error("a real failure")
            return False

    level = logging.getLogger("absl").level
    assert sources._is_prepared(Builder()) is False
    assert [(record.levelname, record.getMessage()) for record in caplog.records if record.name == "absl"] == \
        [("ERROR", "a real failure")]
    assert logging.getLogger("absl").level == level


def test_network_probe_answers_quickly():
    started = time.perf_counter()
    assert isinstance(sources.network_available(timeout_s=1.0), bool)
    assert time.perf_counter() - started < 3


def test_unknown_tfds_name_and_bad_source_string(tmp_path):
    with pytest.raises(DataError, match="TFDS has no dataset 'no_such_dataset_xyz'"):
        sources.open_tfds("no_such_dataset_xyz", data_config(tmp_path))
    with pytest.raises(DataError, match="is not 'tfds:NAME"):
        pipeline.open_source(data_config(tmp_path, source="hub:thing"))


def test_streamed_documents_read_in_order_and_start_again_for_an_earlier_read():
    opened = []

    def open_texts():
        opened.append(len(opened))
        return iter(f"t{i}" for i in range(10))

    documents = sources.StreamedDocuments(open_texts, limit=8)
    assert len(documents) == 8 and opened == []  # nothing is opened before a read
    assert documents.read(0, 3) == ["t0", "t1", "t2"] and documents.read(3, 5) == ["t3", "t4"]
    assert opened == [0]
    assert documents.read(1, 2) == ["t1"] and opened == [0, 1]
    assert documents.read(6, 20) == ["t6", "t7"]  # reads on to the start, stops at the limit
    unbounded = sources.StreamedDocuments(lambda: iter(["a", "b"]))
    assert unbounded.read(0, 5) == ["a", "b"] and unbounded.read(2, 4) == []  # a short read: the end


def test_local_directory_splits_by_document(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"doc{i:02d}.txt").write_text(f"text of document {i}\n")
    data = data_config(tmp_path, source=f"text:{corpus}", val_fraction=0.25)
    splits = pipeline.open_source(data)
    assert len(splits.train) == 30 and len(splits.val) == 10
    assert read_all(splits.val) == [f"text of document {i}\n" for i in range(3, 40, 4)]
    assert splits.identity["source"] == f"text:{corpus}" and splits.identity["num_files"] == 40


def test_single_file_holds_out_the_last_fraction_of_its_text(tmp_path):
    text = "".join(f"line {i} é\n" for i in range(1000))
    (tmp_path / "one.txt").write_text(text)
    data = data_config(tmp_path, source=f"text:{tmp_path / 'one.txt'}", val_fraction=0.1)
    splits = pipeline.open_source(data)
    cut = int(len(text) * 0.9)  # nanoGPT's split of shakespeare_char
    assert read_all(splits.train) == [text[:cut]]
    assert read_all(splits.val) == [text[cut:]]


def test_few_documents_split_by_text_across_document_boundaries():
    documents = sources.ListDocuments(["aaaa", "bbbb", "cccc", "dddd", "eeee"])  # too few to stride: only read
    train, val, rule = sources.hold_out(documents, 0.3)
    assert read_all(train) == ["aaaa", "bbbb", "cccc", "dd"]  # 70% of 20 characters
    assert read_all(val) == ["dd", "eeee"]
    assert rule.startswith("last 0.3")


def test_undecodable_bytes_read_as_replacement_characters(tmp_path):
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\r\n" * 50)
    data = data_config(tmp_path, source=f"text:{tmp_path / 'latin1.txt'}", val_fraction=0.1)
    splits = pipeline.open_source(data)
    assert "".join(read_all(splits.train) + read_all(splits.val)) == "caf\ufffd\r\n" * 50


# Written to its own module: the check reads the builder's module source, and this
# test module's other builders must not look as if they needed TensorFlow.
NEEDS_TENSORFLOW = '''
import tensorflow_datasets as tfds
from tensorflow_datasets.core.utils.lazy_imports_utils import TENSORFLOW as tf
'''.replace("TENSORFLOW", "tensor" + "flow") + '''


class ReadsThroughTensorflow(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        raise AssertionError("preparation must not start")

    def _generate_examples(self):
        yield 0, {"text": tf.io.gfile.GFile("x").read()}
'''


def test_builder_needing_a_missing_module_fails_before_any_download(tmp_path, monkeypatch):
    import importlib
    import importlib.util
    import sys

    (tmp_path / "needs_tensorflow_builder.py").write_text(NEEDS_TENSORFLOW)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("needs_tensorflow_builder")
    builder = module.ReadsThroughTensorflow(data_dir=str(tmp_path / "tfds"), file_format="array_record")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorflow" else real_find_spec(name, *a))
    with pytest.raises(DataError, match="needs tensorflow, which is not installed; pip install tensorflow"):
        sources.ensure_prepared(builder, network_check=lambda: True)
    sys.modules.pop("needs_tensorflow_builder", None)


def test_the_default_corpus_says_it_needs_tensorflow_where_it_is_missing(monkeypatch):
    """configs/andrea120m.py's lm1b reads its download through TensorFlow, which Colab's TPU
    runtimes lack: the notebook asks this (no data, no network) and installs it first."""
    import importlib.util

    from configs import andrea120m

    source = andrea120m.get_config().data.source
    assert source == "tfds:lm1b"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorflow" else real_find_spec(name, *a))
    assert sources.missing_to_prepare(source) == "tensorflow"
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)
    assert sources.missing_to_prepare(source) == (None if real_find_spec("tensorflow") else "tensorflow")
    assert sources.missing_to_prepare("stdlib") is None and sources.missing_to_prepare("text:/tmp") is None
