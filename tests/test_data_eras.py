"""A streamed training split in eras: built beside training, read in the epoch order, resumed from the workdir."""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from andrea_jax import metrics
from andrea_jax.data import eras, pipeline, token_cache
from andrea_jax.run_dir import save_config
from andrea_jax.config import ConfigError
from tests.test_data_pipeline import unusable_cache_dir
from tests.test_hf_stream import byte_tokens, make_config, write_jsonl
from tests.test_resume import checkpoint_steps, logged, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [f"doc {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(i % 23 + 5)) for i in range(3000)]


def era_config(tmp_path, documents=DOCS, **data):
    """10 steps of 4 windows of 33 tokens, eras of 6 windows: 7 eras (the last of 4 windows) of a byte stream."""
    return make_config(tmp_path, f"hf:{write_jsonl(tmp_path / 'corpus' / 'train.jsonl', documents)}",
                       era_windows=6, **data)


def prepared_eras(config, workdir, first_step=0):
    save_config(workdir, config)
    return pipeline.prepare(config, workdir, first_step=first_step)


def encode_all(config, prepared, first_step=0, keep_eras=0, alive=lambda: True, log=lambda line: None,
               documents=None):
    cache = prepared.train
    eras.encode(cache, documents or pipeline.open_splits(config).train, prepared.tokenizer,
                lambda: cache.layout(config.seed, config.seq_len), config.batch_size, first_step,
                config.steps - 1, keep_eras, alive, log)


def era_tokens_of(cache):
    return [np.array(cache.verified(era)) for era in range(-(-cache.total_tokens() // cache.era_tokens))]


def test_eras_hold_the_stream_cut_where_the_budget_says(tmp_path):
    config = era_config(tmp_path)
    prepared = prepared_eras(config, str(tmp_path / "run"))
    cache = prepared.train
    assert isinstance(cache, eras.EraCache) and cache.era_tokens == 6 * 32 + 1
    assert cache.planned_tokens == 6 * (6 * 32 + 1) + 4 * 32 + 1  # exactly the 40 windows the steps read
    encode_all(config, prepared)
    built = era_tokens_of(cache)
    assert [len(tokens) for tokens in built] == [193] * 6 + [129]
    # The eras, end to end, are the training stream: validation's 20 documents skipped, documents cut
    # across eras where a budget falls, and each era resumed from its recorded start.
    assert np.concatenate(built).tolist() == byte_tokens(DOCS[20:])[:cache.planned_tokens]
    record = cache.record()
    assert sorted(map(int, record["starts"])) == list(range(8))
    cut = record["starts"]["3"]
    # Era 3 starts at token 3 × 193 of the stream: document `document` of training (after validation's 20)
    # at token `token`.
    assert byte_tokens(DOCS[20:])[3 * 193:3 * 193 + 5] == byte_tokens([DOCS[20 + cut["document"]]])[
        cut["token"]:cut["token"] + 5]
    # Every window the steps read is a slice of its era, and they are all different.
    reader = eras.Reader(cache, config.seed, config.seq_len, keep_eras=0, delete_passed=False)
    rows = np.concatenate([reader.batch(step, config.batch_size) for step in range(config.steps)])
    assert len({tuple(row) for row in rows.tolist()}) == 40


def prebuilt_batches(config, tmp_path) -> list:
    """Every step's batch of `config`'s run with all its eras encoded first: what a run must read."""
    built_first = prepared_eras(config, str(tmp_path / "built_first"))
    encode_all(config, built_first)
    return [eras.Reader(built_first.train, config.seed, config.seq_len, 0, False).batch(step, 4)
            for step in range(config.steps)]


def test_steps_train_from_the_first_era_while_the_rest_encode(tmp_path):
    config = era_config(tmp_path)
    expected = prebuilt_batches(config, tmp_path)

    config.data.cache_dir = str(tmp_path / "growing")
    prepared = prepared_eras(config, str(tmp_path / "run"))
    splits = pipeline.open_splits(config)
    read = splits.train.read

    def slow_read(start, stop):  # a stream that brings a document a tenth of a second: an era in about 0.3 s
        texts = read(start, min(stop, start + 1))
        time.sleep(0.1)
        return texts

    splits.train.read = slow_read
    encoder = threading.Thread(target=encode_all, args=(config, prepared), kwargs=dict(documents=splits.train))
    lines = []
    reader = eras.Reader(prepared.train, config.seed, config.seq_len, 0, False, log=lines.append)
    encoder.start()
    batches = [reader.batch(0, 4)]
    on_disk_at_first_step = len(prepared.train.on_disk())
    batches += [reader.batch(step, 4) for step in range(1, config.steps)]
    encoder.join()
    assert on_disk_at_first_step < 7 / 4  # the first step needed era 0 alone
    for got, want in zip(batches, expected):
        np.testing.assert_array_equal(got, want)
    waits = [line for line in lines if "waited" in line]
    assert waits and all(re.fullmatch(r"step \d+ waited \d+\.\d s for era \d", line) for line in waits)
    assert reader.wait_seconds > 0


def test_a_fresh_cache_builds_only_the_eras_from_the_resumed_step_on(tmp_path):
    config = era_config(tmp_path)
    prepared = prepared_eras(config, str(tmp_path / "run"))
    encode_all(config, prepared)
    whole = era_tokens_of(prepared.train)
    shutil.rmtree(prepared.train.directory)  # a new machine: the workdir, and no cache
    lines = []
    encode_all(config, prepared, first_step=6, log=lines.append)  # step 6 reads windows 24..27: era 4
    assert [int(line.split()[1]) for line in lines] == [4, 5, 6]
    for era in (4, 5, 6):
        np.testing.assert_array_equal(prepared.train.verified(era), whole[era])
    assert prepared.train.verified(3) is None


@pytest.mark.parametrize("batch_size, most_eras_a_step", [(4, 2), (12, 3)])
def test_keep_eras_bounds_the_eras_on_disk(tmp_path, batch_size, most_eras_a_step):
    config = era_config(tmp_path)
    config.batch_size = batch_size  # 12: a step reads more eras than are kept, and still never waits for ever
    prepared = prepared_eras(config, str(tmp_path / "run"))
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(len(glob.glob(os.path.join(prepared.train.directory, "train.era*.bin*"))))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    encoder = threading.Thread(target=encode_all, args=(config, prepared), kwargs=dict(keep_eras=2))
    encoder.start()
    reader = eras.Reader(prepared.train, config.seed, config.seq_len, keep_eras=2, delete_passed=True)
    for step in range(config.steps):
        reader.batch(step, batch_size)
    encoder.join(timeout=60)
    stop.set()
    watcher.join()
    assert not encoder.is_alive()
    # The kept eras (or those one step reads, where more) and the one being built.
    assert max(seen) <= max(2, most_eras_a_step) + 1 and len(prepared.train.on_disk()) <= max(2, most_eras_a_step)


@pytest.mark.parametrize("deleted", ["files", "manifest"])
def test_an_era_deleted_before_training_reads_it_is_encoded_again(tmp_path, deleted):
    """The encoder, held back by keep_eras, has built era 1 ahead and waits; era 1 goes (a tmp cleaner, a user
    freeing disk): the encoder builds it again, and the steps read what they would have."""
    config = era_config(tmp_path)
    expected = prebuilt_batches(config, tmp_path)

    config.data.cache_dir = str(tmp_path / "deleted")
    prepared = prepared_eras(config, str(tmp_path / "run"))
    cache, lines, ended = prepared.train, [], threading.Event()
    encoder = threading.Thread(target=encode_all, args=(config, prepared), daemon=True,
                               kwargs=dict(keep_eras=2, alive=lambda: not ended.is_set(), log=lines.append))
    reader = eras.Reader(cache, config.seed, config.seq_len, keep_eras=2, delete_passed=True)
    encoder.start()
    batches = [reader.batch(0, 4)]  # era 0 alone; the encoder builds era 1 and waits for training to move on
    deadline = time.monotonic() + 60
    while not cache.built(1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cache.built(1) and not cache.built(2)
    if deleted == "files":
        cache.delete(1)
    else:
        os.remove(cache.paths(1)[1])
    reading = threading.Thread(target=lambda: batches.extend(reader.batch(step, 4) for step in range(1, config.steps)),
                               daemon=True)
    reading.start()
    reading.join(timeout=60)  # step 1 reads era 1: a regression waits for ever
    ended.set()
    assert not reading.is_alive(), "a step waited for ever for the deleted era"
    assert [line.split(":")[0] for line in lines][:4] == [
        "era 0 encoded", "era 1 encoded", "era 1 was deleted before training read it; it is encoded again",
        "era 1 encoded"]
    for got, want in zip(batches, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_stream_shorter_than_its_budget_ends_the_epoch_sooner(tmp_path):
    config = era_config(tmp_path, DOCS[:300], stream_tokens=50_000)  # more than the 280 documents hold
    config.steps, config.data.era_windows = 300, 60
    prepared = prepared_eras(config, str(tmp_path / "run"))
    encode_all(config, prepared)
    total = len(byte_tokens(DOCS[20:300]))
    assert prepared.train.total_tokens() == total < 50_000
    layout = prepared.train.layout(config.seed, config.seq_len)
    assert layout.num_eras == -(-total // 1921)
    steps = layout.windows_in_epoch(0) // 4
    _, era_of, offset_of = layout.locate(np.arange(steps * 4))
    assert len(set(zip(era_of.tolist(), offset_of.tolist()))) == steps * 4  # each window once
    reader = eras.Reader(prepared.train, config.seed, config.seq_len, 0, False)
    rows = np.concatenate([reader.batch(step, 4) for step in range(steps)])
    stream = np.array(byte_tokens(DOCS[20:300]))
    starts = era_of * 1921 + offset_of
    np.testing.assert_array_equal(rows, stream[starts[:, None] + np.arange(33)])


# ---- train.py with the encoder process, killed and resumed ----

SLOW_READS = '''
import glob, importlib.abc, importlib.util, os, sys, time
DELAY = float(os.environ["ANDREA_TEST_READ_DELAY_S"])
STALL_AFTER = os.environ.get("ANDREA_TEST_STALL_AFTER")  # a pattern: once a file matches it, the encoder stalls


class SlowReads(importlib.abc.MetaPathFinder):  # every process's stream reads a document per DELAY seconds
    def find_spec(self, name, path, target=None):
        if name != "andrea_jax.data.sources":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            read = module.StreamedDocuments.read

            def slow(self, start, stop):
                if STALL_AFTER and sys.argv[0].endswith("encoder.py") and glob.glob(STALL_AFTER):
                    time.sleep(600)
                texts = read(self, start, min(stop, start + 2))
                time.sleep(DELAY * len(texts))
                return texts

            module.StreamedDocuments.read = slow

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, SlowReads())
'''


def stream_run(tmp_path):
    """A config file for train.py over a stream of 16 eras, and the environment it runs in (SLOW_READS)."""
    config = era_config(tmp_path)
    config.model.update(dict(n_layer=1, d_model=32, n_head=2, mlp_dim=64, max_len=32))
    config.update(dict(steps=48, batch_size=4, seq_len=32, log_every=2, eval_every=24, eval_batches=1,
                       checkpoint_every=8, keep_checkpoints=2, peak_flops=1e12))
    config.data.update(era_windows=12, keep_eras=3, stream_val_documents=20)
    config_file = tmp_path / "run_config.py"
    config_file.write_text("import json\nimport ml_collections\n\n\ndef get_config():\n"
                           f"    return ml_collections.ConfigDict(json.loads({config.to_json()!r}))\n")
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "sitecustomize.py").write_text(SLOW_READS)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=str(tmp_path / "slow"), ANDREA_TEST_READ_DELAY_S="0.01")
    return dict(root=tmp_path, config=config, config_file=config_file, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`stream_run`, and the metrics of the run whose eras were built first."""
    tmp_path = tmp_path_factory.mktemp("eras")
    paths = stream_run(tmp_path)
    config = paths["config"]
    built_first = str(tmp_path / "built_first")  # its eras built before train.py starts, with no waiting
    prepared = prepared_eras(config, built_first)
    encode_all(config, prepared)
    process = train(paths, built_first, "--config.data.keep_eras=0")
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0 and "waits for era" not in output, output[-3000:]
    paths["expected"] = logged(built_first)
    return paths


def train(runs, workdir, *flags, delay="0.01", **env):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--config", str(runs["config_file"]),
                             "--workdir", workdir, "--config.data.keep_eras=3", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=dict(runs["env"], ANDREA_TEST_READ_DELAY_S=delay, **env), cwd=ROOT)


def test_a_run_trains_while_its_eras_encode_and_logs_what_a_prebuilt_one_does(runs):
    workdir, cache = str(runs["root"] / "growing"), runs["root"] / "growing_cache"
    process = train(runs, workdir, f"--config.data.cache_dir={cache}", "--config.data.keep_eras=0", delay="0.05")
    eras_at_first_log = []
    wait_for(lambda: metrics.read(workdir) if os.path.exists(os.path.join(workdir, "metrics.jsonl")) else False,
             process, "the first log record")
    eras_at_first_log.append(len(glob.glob(str(cache / "tokens" / "*" / "train.era*.json"))))
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output[-3000:]
    # Steps came while eras were still being encoded (how many were ready by the first log depends on how long
    # this machine took to compile: the in-process test above times the first step against the encode).
    assert eras_at_first_log[0] < 16, output[-3000:]
    assert "waits for era" in output and "data_wait_seconds" in metrics.read(workdir)[0]
    assert logged(workdir) == runs["expected"]


@pytest.mark.parametrize("signals", [["SIGTERM"], ["SIGINT", "SIGINT"]])
def test_a_stop_while_a_step_waits_for_its_era_saves_the_last_finished_step_at_once(tmp_path, signals):
    """The encoder stalls once era 0 is built, so step 4 waits for era 1 for minutes: a SIGTERM (a preemption's grace
    is often 10 s) or Ctrl-C, even twice, saves step 3 and stops in seconds."""
    run = stream_run(tmp_path)
    workdir, cache = str(tmp_path / "run"), tmp_path / "cache"
    process = train(run, workdir, f"--config.data.cache_dir={cache}",
                    ANDREA_TEST_STALL_AFTER=str(cache / "tokens" / "*" / "train.era00000.json"))
    output = ""
    try:
        for line in process.stdout:
            output += line
            if "step 4 waits for era 1 of the training split (being encoded)" in line:
                break
        time.sleep(3)  # steps 1 to 3 are done (each takes milliseconds), and step 4 waits
        stopped_at = time.monotonic()
        for name in signals:
            process.send_signal(getattr(signal, name))
            time.sleep(0.05)
        output += process.communicate(timeout=120)[0]
        seconds_to_stop = time.monotonic() - stopped_at
    finally:
        process.kill()
    assert "Traceback" not in output, output[-3000:]
    assert f"{signals[0]} received: saving step 3, then stopping" in output, output[-3000:]
    stopped = f"stopped at step 3 on {signals[0]}; checkpoint saved in"
    # A second Ctrl-C is noted while the step waits or its checkpoint is written; after that, it stops the
    # run at once, in one line, the checkpoint written.
    at_once = "error: stopped at once by Ctrl-C; the newest checkpoint is step 3; run the same command"
    assert (process.returncode == 0 and stopped in output) or (
        len(signals) == 2 and process.returncode == 2 and at_once in output), output[-3000:]
    assert seconds_to_stop < 5, output[-3000:]
    assert checkpoint_steps(workdir) == [3]


def kill_when(process, condition, what):
    wait_for(condition, process, what)
    process.kill()
    return process.communicate(timeout=60)[0]


def test_kill_9_at_any_moment_and_a_fresh_cache_resume_exactly(runs):
    workdir, cache = str(runs["root"] / "killed"), runs["root"] / "killed_cache"
    train_killed = lambda: train(runs, workdir, f"--config.data.cache_dir={cache}")
    era_files = lambda suffix: glob.glob(str(cache / "tokens" / "*" / f"train.era*{suffix}"))
    most_on_disk = [0]

    def watching(condition):
        def check():
            most_on_disk[0] = max(most_on_disk[0], len(era_files(".bin*")))
            return condition()
        return check

    # During era 0's encoding; then while the encoder runs ahead of training; then right after an era is done.
    kill_when(train_killed(), watching(lambda: era_files(".bin.tmp")), "era 0 being encoded")
    assert checkpoint_steps(workdir) == []
    kill_when(train_killed(), watching(lambda: os.path.isdir(os.path.join(workdir, "checkpoints", "8"))), "step 8")
    with open(os.path.join(workdir, eras.RECORD_FILE)) as f:
        assert len(json.load(f)["starts"]) < 17  # the encoder was still at work (keep_eras holds it back)
    copied = str(runs["root"] / "copied")  # the workdir alone, onto a machine with no cache
    shutil.copytree(workdir, copied)
    # Era 9 done: the start of era 10 is recorded with it, and stays (its files go once training passes them).
    starts = lambda: json.load(open(os.path.join(workdir, eras.RECORD_FILE)))["starts"]
    assert "10" not in starts()
    kill_when(train_killed(), watching(lambda: "10" in starts()), "era 9 done")
    output = train_killed().communicate(timeout=600)[0]
    assert "resumed from step" in output, output[-3000:]
    assert logged(workdir) == runs["expected"]
    assert most_on_disk[0] <= 3 + 1  # keep_eras and the one being built

    fresh = runs["root"] / "fresh_cache"
    output = train(runs, copied, f"--config.data.cache_dir={fresh}").communicate(timeout=600)[0]
    resumed = int(output.split("resumed from step ")[1].split()[0])
    first_era = (resumed * 4) // 12  # the era of the resumed step's first window
    built = [int(era) for era in re.findall(r"era (\d+) encoded", output)]
    assert built[0] == first_era > 0 and built == sorted(built), output[-3000:]
    assert logged(copied) == runs["expected"]


def test_a_run_recorded_before_data_order_resumes_with_random_windows(tmp_path):
    config = era_config(tmp_path)
    workdir = str(tmp_path / "old")
    save_config(workdir, config)
    with open(os.path.join(workdir, "config.json")) as f:
        saved = json.load(f)
    del saved["config"]["data"]["order"]  # as a run started before data.order wrote it
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(saved, f)
    from andrea_jax import run_dir
    assert run_dir.load_saved_config(workdir).data.order == "random"


def test_a_relative_cache_dir_that_does_not_exist_is_checked_without_hanging(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(token_cache.atomic.DiskFull, match=r"^the token cache needs 1000000.00 GB more in not/yet "):
        token_cache.require_space("not/yet", 10**15)


@pytest.mark.parametrize("kind", ["file", "read-only"])
def test_a_streamed_run_whose_cache_dir_cannot_be_used_stops_in_one_line(tmp_path, kind):
    config = era_config(tmp_path)
    with pytest.raises(ConfigError, match=unusable_cache_dir(tmp_path, config, kind)):
        prepared_eras(config, str(tmp_path / "run"))


def test_a_hub_dataset_that_moved_since_its_cache_began_is_refused(tmp_path, monkeypatch):
    from andrea_jax.data import DataError, hf_stream

    commit = ["c0ffee"]
    monkeypatch.setattr(hf_stream, "dataset_revision", lambda arguments, local: commit[0])
    config = era_config(tmp_path)
    prepared = prepared_eras(config, str(tmp_path / "run"))
    encode_all(config, prepared, first_step=0)
    assert prepared.train.record()["dataset_revision"] == "c0ffee"
    prepared.train.delete(5)
    commit[0] = "decade"  # the hub's newest commit, since
    with pytest.raises(DataError, match=r"^Hugging Face dataset .*corpus moved from commit c0ffee to decade since "
                                        r"this cache began; its eras in this run are of the old one: train the "
                                        r"new one in a new workdir$"):
        encode_all(config, prepared, first_step=7)
    assert prepared.train.verified(5) is None



def test_a_resume_that_would_plan_other_eras_says_so_once(tmp_path, capsys):
    """The leader's preparation says it; the encoder process, which opens the same cache, does not again."""
    config, workdir = era_config(tmp_path), str(tmp_path / "run")
    prepared_eras(config, workdir)
    assert "budget" not in capsys.readouterr().out
    config.steps = 12  # a resume with more steps (data.stream_tokens=0): eras for their 8 windows follow the 40
    prepared = prepared_eras(config, workdir, first_step=10)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "stream budget rises from 1,287 to 1,545 tokens" in out, out
    assert prepared.train.layout(config.seed, config.seq_len).windows_in_epoch(0) == 48
    splits = pipeline.open_splits(config)
    pipeline.train_cache(config, workdir, splits, prepared.tokenizer, preparing=False)  # as the encoder process
    prepared_eras(config, workdir, first_step=10)  # the same command again: nothing changes
    assert capsys.readouterr().out == ""
    config.steps = 8
    prepared = prepared_eras(config, workdir, first_step=8)
    assert prepared.train.planned_tokens == 1545 and capsys.readouterr().out == ""  # fewer steps read less


def test_eras_that_cannot_be_deleted_stop_the_run_in_one_line(tmp_path, monkeypatch):
    """A directory that turned read-only (as root, only a monkeypatched delete can show it): one DataError that
    names the fix, every era still there."""
    config = era_config(tmp_path)
    prepared = prepared_eras(config, str(tmp_path / "run"))
    encode_all(config, prepared)
    on_disk = prepared.train.on_disk()

    def refused(cache, era):
        raise PermissionError(13, "Permission denied", cache.paths(era)[1])

    monkeypatch.setattr(eras.EraCache, "delete", refused)
    reader = eras.Reader(prepared.train, config.seed, config.seq_len, keep_eras=2, delete_passed=True)
    with pytest.raises(eras.DataError, match=r"^the passed eras in .* cannot be deleted \(Permission denied\), so "
                                             r"keep_eras=2 cannot bound them; make the directory writable .* run the "
                                             r"same command to resume from the last checkpoint$"):
        for step in range(config.steps):
            reader.batch(step, config.batch_size)
    assert prepared.train.on_disk() == on_disk


@pytest.mark.parametrize("damage, found", [
    (lambda path: os.truncate(path, os.path.getsize(path) - 2), r"\(384 bytes of tokens where its manifest says 386\)"),
    (lambda path: open(path, "r+b").write(b"\x07\x00"), r"\(tokens that are not those its manifest's checksum describes\)"),
])
def test_an_era_changed_after_it_was_encoded_stops_in_one_line_and_is_encoded_again_once_its_manifest_goes(
        tmp_path, damage, found):
    config = era_config(tmp_path)
    prepared = prepared_eras(config, str(tmp_path / "run"))
    encode_all(config, prepared)
    cache = prepared.train
    whole = era_tokens_of(cache)
    tokens_path, manifest_path = cache.paths(0)
    damage(tokens_path)
    ended = subprocess.Popen([sys.executable, "-c", ""])  # an encoder that is gone: a reader that waits fails
    ended.wait()
    reader = eras.Reader(cache, config.seed, config.seq_len, keep_eras=0, delete_passed=False, encoder=ended)
    with pytest.raises(eras.DataError, match=rf"^era 0 of the training split in .* was changed after it was encoded "
                                             rf"{found}; delete train\.era0+\.json there and run the same command to "
                                             rf"resume: the era is encoded again$"):
        for step in range(config.steps):
            reader.batch(step, config.batch_size)
    # What the message says to do: the encoder builds the era again, as it was.
    os.remove(manifest_path)
    encode_all(config, prepared)
    assert [tokens.tolist() for tokens in era_tokens_of(cache)] == [tokens.tolist() for tokens in whole]


def test_a_workdir_copied_from_a_running_one_takes_eras_of_its_own_and_reads_what_the_original_does(tmp_path):
    """The copy's eras.json names the original's eras: were both to read them, each would delete what the other
    reads, and a raised budget would put one's eras where the other's layout has others."""
    from andrea_jax import run_dir, train_loop
    from andrea_jax.data import sources

    config = era_config(tmp_path, keep_eras=2)
    config.model.update(dict(n_layer=1, d_model=32, n_head=2, mlp_dim=64, max_len=32))
    original, copy = str(tmp_path / "original"), str(tmp_path / "copy")
    prepared_eras(config, original)
    shutil.copytree(original, copy)
    running = run_dir.claim_identity(original, sources.cache_dir_of(config.data))[1]  # the original, running
    train_loop.train(config, copy, devices=jax.devices()[:1])
    os.close(running)
    own = [json.load(open(os.path.join(workdir, eras.RECORD_FILE)))["run"] for workdir in (original, copy)]
    assert own[0] != own[1] and own == [run_dir.identity(original), run_dir.identity(copy)]
    train_loop.train(config, original, devices=jax.devices()[:1])
    assert metrics.read(copy) and [(r["step"], r.get("loss")) for r in metrics.read(copy)] == \
        [(r["step"], r.get("loss")) for r in metrics.read(original)]


@pytest.mark.parametrize("interrupted_in", [
    "fit",  # Ctrl-C while the step compiles
    "batch",  # Ctrl-C while the first step waits for era 0, its checkpoints, metrics and TensorBoard opened
])
def test_a_new_streamed_run_that_stops_before_its_first_step_leaves_neither_workdir_nor_eras(tmp_path, monkeypatch,
                                                                                            interrupted_in):
    from andrea_jax import train_loop

    config = era_config(tmp_path)
    config.model.update(dict(n_layer=1, d_model=32, n_head=2, mlp_dim=64, max_len=32))
    workdir = str(tmp_path / "run")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_loop.fit if interrupted_in == "fit" else eras.Reader, interrupted_in, interrupted)
    with pytest.raises(train_loop.StoppedAtOnce, match="before the first step"):
        train_loop.train(config, workdir, devices=jax.devices()[:1])
    assert not os.path.exists(workdir)
    assert glob.glob(str(tmp_path / "cache" / "tokens" / "*" / "val.bin"))  # the shared validation cache stays
    assert not glob.glob(str(tmp_path / "cache" / "tokens" / "*" / "train*"))  # the run's own eras go


def windows_in_the_stream(cache, config, steps):
    """(the first token in the training stream of each window steps 0..steps-1 read, their rows)."""
    layout = cache.layout(config.seed, config.seq_len)
    reader = eras.Reader(cache, config.seed, config.seq_len, 0, False)
    _, era_of, offset_of = layout.locate(np.arange(steps * config.batch_size))
    starts = np.array([layout.era_start(era) for era in era_of.tolist()]) + offset_of
    return starts, np.concatenate([reader.batch(step, config.batch_size) for step in range(steps)])


def test_a_resume_that_raises_stream_tokens_goes_on_encoding_the_stream_where_it_stopped(tmp_path, capsys):
    budget = 6 * 193 + 149  # 6 eras of 193 tokens and a last of 149 (4 windows and 20 tokens no window reaches)
    config = era_config(tmp_path, stream_tokens=budget)
    workdir = str(tmp_path / "run")
    prepared = prepared_eras(config, workdir)
    encode_all(config, prepared)
    before, rows_before = windows_in_the_stream(prepared.train, config, 10)

    config.steps, config.data.stream_tokens = 20, budget + 6 * 193 + 129 + 7  # 40 windows more, and 7 tokens
    prepared = prepared_eras(config, workdir, first_step=10)
    assert capsys.readouterr().out.count("stream budget rises from 1,307 to 2,601 tokens") == 1
    encode_all(config, prepared, first_step=10)
    cache = prepared.train
    layout = cache.layout(config.seed, config.seq_len)
    assert [layout.era_length(era) for era in range(layout.num_eras)] == [193] * 6 + [149] + [193] * 6 + [136]
    # The eras, end to end, are the stream's first 2,601 training tokens: it went on where the budget ended.
    stream = byte_tokens(DOCS[20:])
    assert np.concatenate([np.array(cache.verified(era)) for era in range(layout.num_eras)]).tolist() == \
        stream[:2601]
    starts, rows = windows_in_the_stream(cache, config, 20)
    # The steps trained read what they read; the new ones read windows none read before, and no token twice
    # (neighbours share only their edge token).
    np.testing.assert_array_equal(starts[:40], before)
    np.testing.assert_array_equal(rows[:40], rows_before)
    assert np.all(np.diff(np.sort(starts)) >= 32) and starts[40:].min() >= budget
    np.testing.assert_array_equal(rows, np.array(stream)[starts[:, None] + np.arange(33)])


def test_a_larger_budget_after_the_steps_began_a_second_epoch_keeps_the_old_one_and_says_so(tmp_path, capsys):
    config = era_config(tmp_path)  # 40 windows: steps 0..9
    workdir = str(tmp_path / "run")
    prepared_eras(config, workdir)
    capsys.readouterr()
    config.steps, config.data.stream_tokens = 30, 10_000
    prepared = prepared_eras(config, workdir, first_step=12)  # steps 10 and 11 read epoch 1: keep what they read
    assert capsys.readouterr().out == (
        "the run's eras were planned for 1,287 tokens of the stream and its steps read them again from step 11: it "
        "keeps them (these steps would plan 10,000; steps past them read them again, in another epoch); a new "
        "workdir reads 10,000 once\n")
    assert prepared.train.planned_tokens == 1287 and prepared.train.layout(config.seed, config.seq_len).num_eras == 7


def test_a_run_given_more_tokens_goes_on_in_the_stream_and_a_kill_9_there_resumes_exactly(tmp_path):
    """24 steps on a budget of 100 windows (8 eras of 12 and one of 4); then --config.steps=48 with a budget of 193
    windows: the new eras follow the 9, and a run killed in them resumes to the numbers of one that was not."""
    from andrea_jax.tools.batches import RunWindows

    run = stream_run(tmp_path)
    first, more = ("--config.steps=24", "--config.data.stream_tokens=3209"), \
        ("--config.steps=48", "--config.data.stream_tokens=6200")
    whole, killed, killed_cache = str(tmp_path / "whole"), str(tmp_path / "killed"), tmp_path / "killed_cache"
    process = train(run, whole, *first)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output[-3000:]
    shutil.copytree(whole, killed)
    shutil.copytree(tmp_path / "cache", killed_cache)
    read_before = [RunWindows(whole).windows(step) for step in range(1, 25)]

    process = train(run, whole, *more)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output[-3000:]
    assert output.count("stream budget rises from 3,209 to 6,200 tokens") == 1, output[-3000:]
    read = [RunWindows(whole).windows(step) for step in range(1, 49)]
    assert read[:24] == read_before  # the steps trained keep their windows
    starts = sorted(offset for windows in read for _, offset in windows)
    # 192 windows of the stream, none read twice (neighbours share only their edge token).
    assert len(starts) == 192 and np.all(np.diff(starts) >= 32)
    assert {era for windows in read[24:] for era, _ in windows} >= set(range(9, 17))

    killed_run = lambda: train(run, killed, f"--config.data.cache_dir={killed_cache}", *more)
    kill_when(killed_run(), lambda: os.path.isdir(os.path.join(killed, "checkpoints", "32")), "step 32")
    assert max(checkpoint_steps(killed)) < 48  # killed in the new eras, before the run's end
    output = killed_run().communicate(timeout=600)[0]
    assert "resumed from step" in output and "stream budget rises" not in output, output[-3000:]
    assert logged(killed) == logged(whole)
