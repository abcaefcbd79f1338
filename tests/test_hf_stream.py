"""hf: sources, streamed through `datasets.load_dataset(..., streaming=True)` from local
JSON Lines and Parquet directories (the hub's path, offline), and the hub's failure offline."""

import contextlib
import glob
import http.server
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from andrea_jax import evaluate
from andrea_jax.config import base_config
from andrea_jax.data import DataError, hf_stream, pipeline, sources, token_cache
from andrea_jax.data.tokenizer import ByteTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [f"document {i}: " + "word " * (i % 5 + 3) for i in range(2000)]
FINEWEB = "hf:HuggingFaceFW/fineweb-edu/sample-10BT"


def write_jsonl(path, texts, field="text"):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({field: text, "id": i}) + "\n")
    return path.parent


def byte_tokens(texts):
    """What the byte tokenizer's cache holds for these documents: their bytes, 256 after each."""
    return [t for text in texts for t in [*text.encode("utf-8"), 256]]


def whole_train(prepared):
    """A training split of one era (data.order="random" on a stream: its budget), as its token file."""
    return token_cache.read(*prepared.train.paths(0), "")


def train_of(config, splits, workdir):
    """The budget of a stream as one era, built before the first step: data.order="random"'s training cache."""
    config.data.order = "random"
    cache = pipeline.train_cache(config, str(workdir), splits, ByteTokenizer())
    return token_cache.read(*cache.paths(0), "")


def make_config(tmp_path, source, **data):
    config = base_config()
    config.steps, config.batch_size, config.seq_len = 10, 4, 32  # the steps read 10 × 4 × 33 = 1320 tokens
    config.model.vocab_size = 0
    config.data.update(source=source, tokenizer="byte", cache_dir=str(tmp_path / "cache"),
                       stream_val_documents=20)
    config.data.update(data)
    return config


def test_source_names():
    assert hf_stream.load_arguments("HuggingFaceFW/fineweb-edu/sample-10BT") == {
        "path": "HuggingFaceFW/fineweb-edu", "name": "sample-10BT"}
    assert hf_stream.load_arguments("roneneldan/TinyStories") == {"path": "roneneldan/TinyStories"}
    for bad in ("fineweb", "a/b/c/d", "owner//name", "/no/such/directory"):
        with pytest.raises(DataError, match="neither a directory nor hf:OWNER/NAME"):
            hf_stream.load_arguments(bad)


def test_training_takes_the_tokens_asked_for_and_reads_no_further(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus" / "train.jsonl", DOCS)
    # data.order="epochs" takes the 40 windows the steps read (their edge tokens shared); "random" a tenth
    # more than the 10 × 4 × 33 tokens it draws.
    assert pipeline.open_splits(make_config(tmp_path, f"hf:{corpus}")).train_tokens == 40 * 32 + 1
    splits = pipeline.open_splits(make_config(tmp_path, f"hf:{corpus}", order="random"))
    assert splits.train_tokens == 1452  # 1.1 × 1320
    given, open_texts = [], splits.train.open_texts

    def counted(texts):
        for text in texts:
            given.append(text)
            yield text

    splits.train.open_texts = lambda: counted(open_texts())
    train = token_cache.load_or_build(str(tmp_path / "c"), "train", splits.train, ByteTokenizer(), "train",
                                      splits.train_tokens)
    # Training starts after the 20 held-out documents and stops at exactly 1452 tokens,
    # inside the document that crosses them.
    assert train.tokens.tolist() == byte_tokens(DOCS[20:])[:1452]
    ends = np.cumsum([len(d) + 1 for d in DOCS[20:]])
    needed = int(np.searchsorted(ends, 1452)) + 1
    assert needed == 38
    cut = 1452 - int(ends[needed - 2])
    assert train.num_bytes == int(ends[needed - 2]) - (needed - 1) + cut  # the cut document counts its kept bytes
    # Of 1980 training documents the stream gave up only those (and a read-ahead of a few).
    assert needed <= len(given) <= needed + 4


def test_held_out_validation_is_the_stream_start_and_never_reaches_training(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus" / "train.jsonl", DOCS)
    splits = pipeline.open_splits(make_config(tmp_path, f"hf:{corpus}"))
    assert splits.val.read(0, 100) == DOCS[:20]
    assert splits.train.read(0, 3) == DOCS[20:23]
    sample = pipeline.training_sample(splits.train, 2000)  # the BPE's sample: training text only
    assert sample[0] == DOCS[20] and not set(sample) & set(DOCS[:20])
    prepared = pipeline.prepare(make_config(tmp_path, f"hf:{corpus}", order="random"), str(tmp_path / "run"))
    assert prepared.val.tokens.tolist() == byte_tokens(DOCS[:20])
    assert whole_train(prepared).tokens[:len(DOCS[20]) + 1].tolist() == byte_tokens(DOCS[20:21])


def test_the_dataset_own_validation_split_is_used(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus" / "train.jsonl", DOCS[:200])
    val_docs = [f"validation text {i}" for i in range(50)]
    write_jsonl(corpus / "validation.jsonl", val_docs)
    splits = pipeline.open_splits(make_config(tmp_path, f"hf:{corpus}"))
    assert splits.val.read(0, 100) == val_docs[:20]  # its first stream_val_documents
    assert splits.train.read(0, 3) == DOCS[:3]  # nothing of train is held out


def test_a_second_prepare_reuses_the_cache_without_reading_the_stream(tmp_path, monkeypatch):
    corpus = write_jsonl(tmp_path / "corpus" / "train.jsonl", DOCS)
    config = make_config(tmp_path, f"hf:{corpus}", tokenizer="bpe", tokenizer_train_bytes=20_000, order="random")
    workdir = str(tmp_path / "run")
    first = pipeline.prepare(config, workdir)
    assert whole_train(first).num_tokens == 1452
    modified = os.path.getmtime(whole_train(first).path)

    def no_reading(*args):
        raise AssertionError("the dataset was opened again")

    monkeypatch.setattr(hf_stream, "_load", no_reading)
    again = pipeline.prepare(config, workdir)
    assert (whole_train(again).path, again.val.path) == (whole_train(first).path, first.val.path)
    assert os.path.getmtime(whole_train(again).path) == modified
    np.testing.assert_array_equal(whole_train(again).tokens, whole_train(first).tokens)
    np.testing.assert_array_equal(again.val.tokens, first.val.tokens)
    assert evaluate.validation_split(config, first.tokenizer).path == first.val.path  # eval.py's, too

    # Another amount is another cache: the key holds how much was taken.
    monkeypatch.undo()
    config.data.stream_tokens = 1000
    fewer = pipeline.prepare(config, workdir)
    assert os.path.dirname(whole_train(fewer).path) != os.path.dirname(whole_train(first).path)
    np.testing.assert_array_equal(whole_train(fewer).tokens, whole_train(first).tokens[:1000])
    assert fewer.val.path == first.val.path  # validation holds the same documents: its key has no budget


def test_a_resume_with_more_steps_and_an_eval_at_another_length_keep_the_validation_cache(tmp_path, monkeypatch):
    corpus = write_jsonl(tmp_path / "corpus" / "train.jsonl", DOCS)
    config, workdir = make_config(tmp_path, f"hf:{corpus}", order="random"), str(tmp_path / "run")
    first = pipeline.prepare(config, workdir)
    built = os.path.getmtime(first.val.path)
    config.steps = 20  # a resume that trains on needs more training text, and only that
    longer = pipeline.prepare(config, workdir)
    assert whole_train(longer).num_tokens == 2 * whole_train(first).num_tokens == 2904  # 1.1 × 20 × 4 × 33
    assert longer.val.path == first.val.path and os.path.getmtime(longer.val.path) == built
    monkeypatch.setattr(hf_stream, "_load", lambda *args: pytest.fail("the dataset was opened again"))
    config.steps, config.seq_len = 30, 16  # eval.py --config.seq_len=16 on a run of other steps
    assert evaluate.validation_split(config, first.tokenizer).path == first.val.path


def no_data_left(tmp_path):
    return (not os.path.exists(tmp_path / "run" / "tokenizer.json")
            and glob.glob(str(tmp_path / "cache" / "**" / "*.bin*"), recursive=True) == [])


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_a_text_column_that_is_not_text_stops_before_anything_is_written(tmp_path, tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with open(corpus / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"text": [f"line {i}", "", "more"]}) + "\n" for i in range(100))
    with pytest.raises(DataError, match=r"^Hugging Face dataset .*corpus field 'text' holds list values, not "
                                        r"text; set data.text_field to a column of strings$"):
        pipeline.prepare(make_config(tmp_path, f"hf:{corpus}", tokenizer=tokenizer), str(tmp_path / "run"))
    assert no_data_left(tmp_path)
    # None stays an empty document, which adds nothing.
    write_jsonl(corpus / "train.jsonl", DOCS[:5] + [None] * 5 + DOCS[5:200])
    prepared = pipeline.prepare(make_config(tmp_path, f"hf:{corpus}", stream_val_documents=5, order="random"),
                                str(tmp_path / "ok"))
    assert whole_train(prepared).tokens[:len(DOCS[5]) + 1].tolist() == byte_tokens(DOCS[5:6])


@pytest.mark.parametrize("tokenizer, message", [
    ("bpe", r"has no text to train the tokenizer on; add text or check data.train_split \(a stream without "
            r"its own validation split gives its first data.stream_val_documents to validation\)$"),
    ("byte", r"the train split has no text \(0 tokens\); add text to the source, or hold out less of it .*"
             "data.stream_val_documents for hf:"),
])
def test_a_stream_that_validation_uses_up_leaves_no_tokenizer_behind(tmp_path, tokenizer, message):
    corpus = write_jsonl(tmp_path / "corpus" / "train.jsonl", DOCS[:15])  # fewer than the 20 held out
    with pytest.raises(DataError, match=message):
        pipeline.prepare(make_config(tmp_path, f"hf:{corpus}", tokenizer=tokenizer), str(tmp_path / "run"))
    assert no_data_left(tmp_path)


def test_a_hub_revision_is_passed_and_keys_the_caches(tmp_path):
    assert hf_stream.load_arguments("HuggingFaceFW/fineweb-edu/sample-10BT", "v1.2.0") == {
        "path": "HuggingFaceFW/fineweb-edu", "name": "sample-10BT", "revision": "v1.2.0"}
    corpus = write_jsonl(tmp_path / "corpus" / "train.jsonl", DOCS[:100])
    with pytest.raises(DataError, match="data.hf_revision='main' pins a hub dataset, .* leave data.hf_revision empty"):
        pipeline.open_splits(make_config(tmp_path, f"hf:{corpus}", hf_revision="main"))
    identity = lambda revision: pipeline.open_splits(make_config(tmp_path, FINEWEB, hf_revision=revision)).identity
    assert identity("v1.2.0")["dataset"]["revision"] == "v1.2.0" and "revision" not in identity("")["dataset"]


def test_the_text_field_is_configurable_on_parquet(tmp_path):
    corpus = tmp_path / "parquet"
    corpus.mkdir()
    pq.write_table(pa.table({"content": DOCS[:300], "id": list(range(300))}), corpus / "train.parquet")
    with pytest.raises(DataError, match=r"has no field 'text'; set data.text_field to one of \['content', 'id'\]"):
        pipeline.prepare(make_config(tmp_path, f"hf:{corpus}"), str(tmp_path / "run"))
    assert glob.glob(str(tmp_path / "cache" / "**" / "*.bin*"), recursive=True) == []
    prepared = pipeline.prepare(make_config(tmp_path, f"hf:{corpus}", text_field="content", order="random"),
                                str(tmp_path / "run"))
    assert prepared.val.tokens.tolist() == byte_tokens(DOCS[:20])
    assert whole_train(prepared).tokens.tolist() == byte_tokens(DOCS[20:])[:1452]


def assert_fails_fast_with_one_line(tmp_path, message):
    config = make_config(tmp_path, FINEWEB, tokenizer="bpe")
    started = time.perf_counter()
    with pytest.raises(DataError, match=message) as error:
        pipeline.prepare(config, str(tmp_path / "run"))
    assert time.perf_counter() - started < 5
    assert "\n" not in str(error.value) and "data.source" in str(error.value)
    assert not os.path.exists(tmp_path / "run" / "tokenizer.json") and not os.path.exists(tmp_path / "cache")


def test_a_hub_that_refuses_connections_fails_in_seconds(tmp_path, monkeypatch):
    with socket.socket() as unused:  # bound, never listening: connections to it are refused
        unused.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{unused.getsockname()[1]}")
        assert_fails_fast_with_one_line(tmp_path, "the Hugging Face hub is unreachable")


def test_hf_hub_offline_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_fails_fast_with_one_line(tmp_path, "HF_HUB_OFFLINE is set")


INSTEAD = "or use data.source='tfds:...', 'text:PATH' or 'stdlib'"


@pytest.mark.parametrize("variable", hf_stream.OFFLINE_VARIABLES)
def test_each_offline_switch_fails_at_once(tmp_path, monkeypatch, variable):
    for name in hf_stream.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "1")
    monkeypatch.setattr(hf_stream, "hub_reachable", lambda: pytest.fail("the hub was probed"))
    assert_fails_fast_with_one_line(tmp_path, f"^{variable} is set, and Hugging Face dataset HuggingFaceFW/"
                                              f"fineweb-edu/sample-10BT streams from the hub; unset it, "
                                              f"{re.escape(INSTEAD)}$")


def test_a_local_directory_streams_with_offline_mode_on(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    for name in hf_stream.OFFLINE_VARIABLES:
        monkeypatch.setenv(name, "1")
    # What the libraries read from those variables when they are imported.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    corpus = write_jsonl(tmp_path / "corpus" / "train.jsonl", DOCS[:300])
    prepared = pipeline.prepare(make_config(tmp_path, f"hf:{corpus}"), str(tmp_path / "run"))
    assert prepared.val.tokens.tolist() == byte_tokens(DOCS[:20])


@contextlib.contextmanager
def serving(server):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def hub_client(monkeypatch):
    """huggingface_hub's client made afresh from the environment the test sets (proxies are read at its start)."""
    from huggingface_hub import close_session

    for name in (*hf_stream.OFFLINE_VARIABLES, "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTPS_PROXY",
                 "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    delays = []
    monkeypatch.setattr(sources.time, "sleep", delays.append)
    close_session()
    yield delays
    close_session()


def assert_refused_at_once(tmp_path, delays, message):
    assert_fails_fast_with_one_line(tmp_path, f"^{message}, so Hugging Face dataset HuggingFaceFW/fineweb-edu/"
                                              f"sample-10BT cannot stream from the hub .*{re.escape(INSTEAD)}$")
    assert delays == []


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test's self-signed certificate")
def test_a_certificate_this_machine_does_not_trust_is_refused_at_once(tmp_path, monkeypatch, hub_client):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-keyout", tmp_path / "key.pem", "-out", tmp_path / "cert.pem"], check=True, capture_output=True)
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    with serving(server) as port:
        monkeypatch.setenv("HF_ENDPOINT", f"https://127.0.0.1:{port}")
        assert_refused_at_once(tmp_path, hub_client, r"^this machine does not trust the hub's TLS certificate")
        assert_fails_fast_with_one_line(
            tmp_path, r"\(\[SSL: CERTIFICATE_VERIFY_FAILED\] certificate verify failed: self-signed certificate .*"
                      r"\); set SSL_CERT_FILE to a CA bundle that holds the certificate of the proxy or hub that signs it")


class _ProxyAskingForCredentials(http.server.BaseHTTPRequestHandler):
    def do_CONNECT(self):
        self.send_response(407, "Proxy Authentication Required")
        self.send_header("Proxy-Authenticate", 'Basic realm="proxy"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_proxy_asking_for_credentials_is_refused_at_once(tmp_path, monkeypatch, hub_client):
    with serving(http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ProxyAskingForCredentials)) as port:
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("HF_ENDPOINT", f"https://127.0.0.1:{port}")  # listening: the direct probe passes
        assert_refused_at_once(tmp_path, hub_client, re.escape(
            "the proxy asks for credentials (407 Proxy Authentication Required)"))
        assert_fails_fast_with_one_line(tmp_path, re.escape(
            "(407 Proxy Authentication Required); put them in HTTPS_PROXY as http://USER:PASSWORD@HOST:PORT, "))


def test_offline_mode_met_in_the_hub_client_is_refused_at_once(tmp_path, monkeypatch, hub_client):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # set in code, not by a variable
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listening.getsockname()[1]}")
        assert_refused_at_once(tmp_path, hub_client, "offline mode is on")
        assert_fails_fast_with_one_line(tmp_path, "; unset HF_HUB_OFFLINE, HF_DATASETS_OFFLINE and "
                                                  "TRANSFORMERS_OFFLINE, or use")


def test_an_untrusted_certificate_met_while_reading_is_not_retried(tmp_path, monkeypatch):
    import httpx2

    corpus = write_jsonl(tmp_path / "corpus" / "train.jsonl", DOCS)
    config = make_config(tmp_path, f"hf:{corpus}", stream_tokens=30_000)
    splits = pipeline.open_splits(config)

    def records():
        yield {"text": DOCS[0]}
        try:
            raise ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
        except ssl.SSLError as error:  # as httpx raises it
            raise httpx2.ConnectError(str(error)) from error

    def opened(open_texts, state=None):
        texts = open_texts(state)
        texts.records = records()
        return texts

    splits.train.open_texts = lambda state=None, open_texts=splits.train.open_texts: opened(open_texts, state)
    delays = []
    monkeypatch.setattr(sources.time, "sleep", delays.append)
    with pytest.raises(DataError) as error:
        train_of(config, splits, tmp_path / "run")
    assert delays == []
    assert re.fullmatch(r"this machine does not trust the hub's TLS certificate, so Hugging Face dataset .*corpus "
                        r"cannot stream from the hub \(\[SSL: CERTIFICATE_VERIFY_FAILED\] certificate verify "
                        r"failed\); set SSL_CERT_FILE .*", str(error.value))
    assert glob.glob(str(tmp_path / "cache" / "**" / "*.bin"), recursive=True) == []


offline_only = pytest.mark.skipif(hf_stream.hub_reachable(), reason="the hub is reachable from here")


@offline_only
def test_offline_the_real_hub_fails_in_seconds(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert_fails_fast_with_one_line(tmp_path, "the Hugging Face hub is unreachable")


@offline_only
def test_offline_the_10b_recipe_stops_in_seconds_with_one_line(tmp_path, monkeypatch):
    from configs import andrea120m_fineweb10b

    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(token_cache.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 10 ** 12}))
    config = andrea120m_fineweb10b.get_config()
    config.data.cache_dir = str(tmp_path / "cache")
    started = time.perf_counter()
    with pytest.raises(DataError, match=r"^the Hugging Face hub is unreachable, and Hugging Face dataset "
                                        r"HuggingFaceFW/fineweb-edu/sample-10BT streams from it; run online") as error:
        pipeline.prepare(config, str(tmp_path / "run"))
    assert time.perf_counter() - started < 5 and "\n" not in str(error.value)
    assert no_data_left(tmp_path)


@offline_only
def test_offline_train_py_stops_with_one_line_and_writes_no_data(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_ENDPOINT", "HF_HUB_OFFLINE")}
    result = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/andrea120m.py", f"--config.data.source={FINEWEB}",
         "--workdir", str(tmp_path / "run"), f"--config.data.cache_dir={tmp_path / 'cache'}",
         "--config.hellaswag.every=0"],  # HellaSwag, unreachable too, would stop the run first
        capture_output=True, text=True, timeout=300, env=dict(env, JAX_PLATFORMS="cpu", XLA_FLAGS=""), cwd=ROOT)
    assert result.returncode == 2
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        line for line in result.stderr.splitlines() if line.strip()], result.stderr[-2000:]
    assert "the Hugging Face hub is unreachable" in result.stderr
    assert not os.path.exists(tmp_path / "run" / "tokenizer.json") and not os.path.exists(tmp_path / "cache")



_KILLABLE_BUILD = """
import sys
from andrea_jax.config import base_config
from andrea_jax.data import pipeline
from andrea_jax.data.tokenizer import ByteTokenizer
config = base_config()
config.data.update(source="hf:" + sys.argv[1], tokenizer="byte", cache_dir=sys.argv[2], stream_val_documents=20,
                   stream_tokens=4_000_000, order="random")
print(pipeline.train_cache(config, sys.argv[3], pipeline.open_splits(config), ByteTokenizer()).planned_tokens,
      flush=True)
"""


def test_a_build_killed_while_it_writes_leaves_no_cache_and_the_next_ends_byte_identical(tmp_path):
    texts = [f"page {i}: " + "the quick brown fox jumps over the lazy dog. " * (20 + i % 40) for i in range(4_000)]
    corpus = write_jsonl(tmp_path / "corpus" / "train.jsonl", texts)
    cache = tmp_path / "cache"
    build = [sys.executable, "-c", _KILLABLE_BUILD, str(corpus), str(cache), str(tmp_path / "run")]
    process = subprocess.Popen(build, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    written = lambda: sum(os.path.getsize(path) for path in glob.glob(str(cache / "tokens" / "*" / "train.bin.tmp")))
    deadline = time.monotonic() + 120
    while written() < 1 << 20:  # a quarter of the way
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0][-2000:]
        time.sleep(0.005)
    process.kill()
    process.wait()
    assert glob.glob(str(cache / "tokens" / "*" / "train.json")) == []  # nothing that looks complete
    last = subprocess.run(build, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert last.returncode == 0 and last.stdout.split()[-1] == "4000000", last.stdout[-2000:]
    config = make_config(tmp_path, f"hf:{corpus}", stream_tokens=4_000_000, cache_dir=str(tmp_path / "whole"))
    whole = train_of(config, pipeline.open_splits(config), tmp_path / "other")
    resumed = glob.glob(str(cache / "tokens" / "*" / "train.bin"))
    assert [os.path.relpath(path, cache) for path in resumed] == [os.path.relpath(whole.path, tmp_path / "whole")]
    assert open(resumed[0], "rb").read() == open(whole.path, "rb").read()


def test_a_dropped_connection_is_retried_from_the_last_read_and_the_cache_is_unchanged(tmp_path, monkeypatch):
    corpus = write_jsonl(tmp_path / "corpus" / "train.jsonl", DOCS)
    config = make_config(tmp_path, f"hf:{corpus}", stream_tokens=30_000)
    reference = train_of(config, pipeline.open_splits(config), tmp_path / "run")
    yielded, failures, delays = [0], iter([300, 700]), []
    fail_at = next(failures)
    next_text = hf_stream._Texts.__next__

    def flaky(texts):  # the 300th and 700th records drop the connection once each
        nonlocal fail_at
        yielded[0] += 1
        if yielded[0] == fail_at:
            fail_at = next(failures, None)
            raise ConnectionResetError(104, "Connection reset by peer")
        return next_text(texts)

    monkeypatch.setattr(hf_stream._Texts, "__next__", flaky)
    monkeypatch.setattr(sources.time, "sleep", delays.append)
    config.data.cache_dir = str(tmp_path / "flaky")
    splits = pipeline.open_splits(config)
    opened, open_texts = [], splits.train.open_texts
    splits.train.open_texts = lambda state=None: opened.append(state) or open_texts(state)
    retried = train_of(config, splits, tmp_path / "run")
    assert delays == [2, 2] and opened[0] is None and all(state is not None for state in opened[1:])
    assert len(opened) == 3  # each retry goes on from the last read's state, not from the start
    assert yielded[0] < 2 * len(DOCS)
    assert open(retried.path, "rb").read() == open(reference.path, "rb").read()


def test_a_dropped_connection_while_an_era_reopens_its_stream_is_retried(tmp_path, monkeypatch):
    from tests.test_data_eras import encode_all, era_config, era_tokens_of, prepared_eras

    config = era_config(tmp_path)
    config.steps, config.data.era_windows = 30, 40  # 3 eras of about 18 documents: era 1 starts after a read that recorded its state
    prepared = prepared_eras(config, str(tmp_path / "run"))
    encode_all(config, prepared)
    reference = era_tokens_of(prepared.train)
    prepared.train.delete(1)
    delays, opened = [], []
    monkeypatch.setattr(sources.time, "sleep", delays.append)
    splits = pipeline.open_splits(config)
    open_texts = splits.train.open_texts

    def reopen(state=None):  # the first reopen meets a dropped connection
        opened.append(state)
        if len(opened) == 1:
            raise ConnectionResetError(104, "Connection reset by peer")
        return open_texts(state)

    splits.train.open_texts = reopen
    encode_all(config, prepared, documents=splits.train)
    assert delays == [2] and len(opened) == 2 and opened[0] is not None and opened[1] == opened[0]
    np.testing.assert_array_equal(era_tokens_of(prepared.train)[1], reference[1])


def test_a_stream_that_keeps_failing_stops_with_one_line(tmp_path, monkeypatch):
    corpus = write_jsonl(tmp_path / "corpus" / "train.jsonl", DOCS)
    config = make_config(tmp_path, f"hf:{corpus}", stream_tokens=30_000)
    monkeypatch.setattr(hf_stream._Texts, "__next__", lambda texts: (_ for _ in ()).throw(TimeoutError("read timed out")))
    delays = []
    monkeypatch.setattr(sources.time, "sleep", delays.append)
    with pytest.raises(DataError) as error:
        train_of(config, pipeline.open_splits(config), tmp_path / "run")
    assert delays == [2, 4, 8, 16, 32, 64]
    assert re.fullmatch(r"Hugging Face dataset .*corpus failed 7 times in a row \(read timed out\); run the same "
                        r"command again when it answers \(the eras encoded so far are kept\)", str(error.value))


def test_which_errors_are_retried():
    class Response:
        def __init__(self, status_code):
            self.status_code = status_code

    def answered(status):
        error = OSError(f"HTTP {status}")
        error.response = Response(status)
        return error

    ReadTimeout = type("ReadTimeout", (type("Timeout", (OSError,), {}),), {})  # as requests names them
    for error in (TimeoutError(), ConnectionResetError(), ReadTimeout(), answered(503), answered(429)):
        assert hf_stream.transient(error), error
    wrapped = RuntimeError("reading failed")
    wrapped.__cause__ = answered(502)
    assert hf_stream.transient(wrapped)
    for error in (ValueError("bad row"), answered(404), answered(401), DataError("no field"), KeyError("text")):
        assert not hf_stream.transient(error), error
    # Connection errors that no retry mends: what `datasets` wraps, a certificate, a proxy's 407.
    from huggingface_hub.errors import OfflineModeIsEnabled
    certificate = ConnectionResetError("cannot connect")
    certificate.__context__ = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify "
                                                              "failed: self-signed certificate")
    ProxyError = type("ProxyError", (type("TransportError", (Exception,), {}),), {})  # as httpx names it
    for error in (OfflineModeIsEnabled("Offline mode is enabled."),
                  ConnectionError("Couldn't reach 'owner/name' on the Hub (OfflineModeIsEnabled)"), certificate,
                  ProxyError("407 Proxy Authentication Required"), answered(407)):
        assert not hf_stream.transient(error) and hf_stream.refusal(error, "the stream"), error
    assert hf_stream.refusal(TimeoutError(), "the stream") is None


def test_a_cache_the_disk_cannot_hold_stops_before_the_tokenizer_streams(tmp_path, monkeypatch):
    # keep_eras=0 keeps every era: the whole cache at once.
    config = make_config(tmp_path, FINEWEB, tokenizer="bpe", stream_tokens=10_000_000_000, keep_eras=0)
    monkeypatch.setattr(hf_stream, "_load", lambda *args: pytest.fail("the dataset was opened"))
    monkeypatch.setattr(token_cache.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 5_300_000_000}))
    with pytest.raises(token_cache.atomic.DiskFull) as refused:
        pipeline.prepare(config, str(tmp_path / "run"))
    assert str(refused.value) == (f"the token cache needs 20.00 GB more in {tmp_path / 'cache'} and 5.30 GB is free "
                                  f"there; point data.cache_dir at a larger disk, free space, or lower "
                                  f"data.stream_tokens")
    assert no_data_left(tmp_path)


def test_the_hub_commit_lookup_is_retried_as_a_read(monkeypatch, capsys):
    """dataset_revision asks the hub, which may drop the connection as a stream's read may: the same retries."""
    answers = iter([ConnectionResetError(104, "Connection reset by peer"), TimeoutError("read timed out"), "c0ffee"])

    def lookup():
        answer = next(answers)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    delays = []
    monkeypatch.setattr(sources.time, "sleep", delays.append)
    documents = sources.StreamedDocuments(lambda: iter([]), transient=hf_stream.transient, described="the hub",
                                          revision=lookup)
    assert documents.revision() == "c0ffee" and delays == [2, 4]
    assert capsys.readouterr().out.count("the hub failed (") == 2
    refused = sources.StreamedDocuments(lambda: iter([]), transient=hf_stream.transient,
                                        revision=lambda: (_ for _ in ()).throw(ValueError("not a network error")))
    with pytest.raises(ValueError, match="not a network error"):  # what no retry mends is not retried
        refused.revision()
