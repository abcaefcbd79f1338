"""The workdir guards: a run's config and tokenizer, foreign directories, damaged checkpoints."""

import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import threading

import jax
import pytest

from andrea_jax import checkpoint, metrics, train_loop
from andrea_jax import run_dir
from andrea_jax.config import ConfigError, base_config
from andrea_jax.runtime.atomic import DiskFull
from andrea_jax.data import tokenizer as tokenizers
from tests.test_checkpoint import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snapshot(workdir):
    """Every file under the workdir with its content (tensorboard events aside: they name the host;
    the lock aside: it names its last holder)."""
    files = {}
    for root, _, names in os.walk(workdir):
        if "tensorboard" in root:
            continue
        for name in set(names) - {run_dir.LOCK_FILE}:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, workdir)] = f.read()
    return files


def test_new_empty_foreign_and_broken_directories(tmp_path):
    assert run_dir.load_saved_config(str(tmp_path / "new")) is None
    assert run_dir.load_saved_config(str(tmp_path)) is None  # empty
    (tmp_path / "notes.txt").write_text("someone else's")
    with pytest.raises(ConfigError, match="is not empty and holds no andrea-jax run .*pick an empty or new"):
        run_dir.load_saved_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"project": "other", "config": {}}))
    with pytest.raises(ConfigError, match="was not written by andrea-jax; use a new --workdir"):
        run_dir.load_saved_config(str(tmp_path))
    (tmp_path / "config.json").write_text('{"project": "andrea-jax", "con')
    with pytest.raises(ConfigError, match="config.json is unreadable .*restore it or use a new --workdir"):
        run_dir.load_saved_config(str(tmp_path))


def test_save_config_round_trip_and_compatibility(tmp_path):
    config = base_config()
    run_dir.save_config(str(tmp_path), config)
    assert os.listdir(tmp_path) == ["config.json"]  # the temporary file is renamed, not left
    saved = run_dir.load_saved_config(str(tmp_path))
    assert saved.to_dict() == json.loads(config.to_json())

    changed = base_config()
    changed.steps, changed.optimizer.learning_rate = 5, 1e-4  # not shapes: fine to change on resume
    run_dir.check_compatible(saved, changed, str(tmp_path))
    changed.model.d_model = 512
    with pytest.raises(ConfigError, match="model.d_model=768, which a resume cannot change to 512; pass "
                                          "--config.model.d_model=768 to resume it, or start a new --workdir"):
        run_dir.check_compatible(saved, changed, str(tmp_path))
    run_dir.check_compatible(saved, changed, str(tmp_path), only="optimizer.")  # evaluation checks the model alone


@pytest.mark.parametrize("key, value", [("seq_len", 512), ("batch_size", 4), ("seed", 1), ("data.order", "random"),
                                        ("data.era_windows", 8), ("data.source", "text:x"), ("model.dropout", 0.1),
                                        ("optimizer.weight_decay", 0.0), ("optimizer.name", "muon")])
def test_a_resume_refuses_every_key_outside_the_table_and_names_the_way_to_change_it(tmp_path, key, value):
    saved, changed = base_config(), base_config()
    changed.update_from_flattened_dict({key: value})
    old = repr(saved.to_dict()[key.split(".")[0]] if "." not in key else saved[key.split(".")[0]][key.split(".")[1]])
    with pytest.raises(ConfigError, match=re.escape(f"holds a run with {key}={old}, which a resume cannot change to "
                                                    f"{value!r}") + ".*--config.init_params_from="):
        run_dir.check_compatible(saved, changed, "w")


def test_a_resume_may_change_what_the_table_allows():
    saved, changed = base_config(), base_config()
    changed.update_from_flattened_dict({
        "steps": 7, "optimizer.learning_rate": 1e-3, "optimizer.decay": "wsd", "log_every": 1, "eval_every": 2,
        "checkpoint_every": 3, "keep_checkpoints": 9, "wandb.project": "p", "profile_steps": "1:2",
        "microbatches": 4, "model.dtype": "bfloat16", "model.attention": "auto", "data.stream_tokens": 10**9,
        "data.cache_dir": "/elsewhere", "mesh.data": 2, "hellaswag.every": 5, "model.vocab_size": 0})
    run_dir.check_compatible(saved, changed, "w")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run on one device; checkpoints at steps 5 and 10."""
    tmp_path = tmp_path_factory.mktemp("workdir")
    config = tiny_config(tmp_path, steps=10, eval_every=5, peak_flops=1e12)
    workdir = str(tmp_path / "run")
    train_loop.train(config, workdir, devices=jax.devices()[:1])
    return config, workdir


@pytest.fixture
def copy_of(trained, tmp_path):
    config, workdir = trained
    copy = str(tmp_path / "run")
    shutil.copytree(workdir, copy)
    return config.copy_and_resolve_references(), copy


@pytest.mark.parametrize("override, error, message", [
    ({"model.d_model": 32}, ConfigError, "holds a run with model.d_model=64, which a resume cannot change to 32; "
                                         "pass --config.model.d_model=64"),
    ({"model.n_layer": 3}, ConfigError, "model.n_layer=2, which a resume cannot change to 3"),
    ({"seq_len": 16}, ConfigError, "seq_len=32, which a resume cannot change to 16"),
    ({"data.tokenizer": "byte"}, ConfigError, "data.tokenizer='char', which a resume cannot change to 'byte'"),
])
def test_a_changed_model_or_tokenizer_is_refused_and_nothing_is_touched(copy_of, override, error, message):
    config, workdir = copy_of
    config.update_from_flattened_dict(override)
    before = snapshot(workdir)
    with pytest.raises(error, match=message):
        train_loop.train(config, workdir, devices=jax.devices()[:1])
    assert snapshot(workdir) == before


def test_a_swapped_tokenizer_is_refused(copy_of):
    # (A tokenizer of the same size but other ids is refused by the checkpoints' tokenizer
    # hash: see test_checkpoint; a char tokenizer that still encodes the corpus differs in size.)
    config, workdir = copy_of
    path = os.path.join(workdir, "tokenizer.json")
    original = tokenizers.load(path)
    tokenizers.CharTokenizer(original.chars + ["\u00e9"]).save(path)
    before = {name: content for name, content in snapshot(workdir).items() if name != "data.json"}
    with pytest.raises(ConfigError, match=f"holds a run with model.vocab_size={original.vocab_size}, which a resume "
                                          f"cannot change to {original.vocab_size + 1}"):
        train_loop.train(config, workdir, devices=jax.devices()[:1])
    after = {name: content for name, content in snapshot(workdir).items() if name != "data.json"}
    assert after == before  # config.json, metrics and checkpoints as they were


def test_a_directory_of_another_project_is_refused(tmp_path):
    workdir = tmp_path / "theirs"
    workdir.mkdir()
    (workdir / "config.json").write_text(json.dumps({"project": "nanogpt", "config": {}}))
    with pytest.raises(ConfigError, match="was not written by andrea-jax"):
        train_loop.train(tiny_config(tmp_path), str(workdir), devices=jax.devices()[:1])
    assert os.listdir(workdir) == ["config.json"]


def test_a_corrupted_newest_checkpoint_falls_back_and_retrains_the_same_steps(copy_of, trained, capsys):
    config, workdir = copy_of
    step_10 = os.path.join(workdir, "checkpoints", "10")
    for root, _, names in os.walk(os.path.join(step_10, "opt_state")):
        for name in names:
            if os.sep + "d" in root:
                os.truncate(os.path.join(root, name), 3)
    train_loop.train(config, workdir, devices=jax.devices()[:1])
    out = capsys.readouterr().out
    assert "checkpoint step 10 in" in out and "is unreadable" in out and "falling back to step 5" in out
    assert "resumed from step 5 of" in out
    assert os.path.isdir(os.path.join(workdir, checkpoint.UNREADABLE_DIR, "10"))  # kept, not deleted
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "5"]
    timing = ("tokens_per_second", "mfu")
    strip = lambda records: [{k: v for k, v in r.items() if k not in timing} for r in records]
    assert strip(metrics.read(workdir)) == strip(metrics.read(trained[1]))  # steps 6..10 again, identical


def test_a_saved_config_gains_keys_added_since_with_their_defaults(tmp_path):
    config = base_config()
    config.model.d_model = 128
    saved = json.loads(config.to_json())
    del saved["model"]["dropout"]  # as if written before the key existed
    (tmp_path / "config.json").write_text(json.dumps({"project": "andrea-jax", "config": saved}))
    loaded = run_dir.load_saved_config(str(tmp_path))
    assert loaded.model.d_model == 128 and loaded.model.dropout == base_config().model.dropout


def test_a_second_run_on_a_workdir_in_use_stops_with_the_holder(tmp_path):
    from tests.test_train_loop import loop_config

    workdir = str(tmp_path / "run")
    held = run_dir.hold(workdir)  # as a run in progress does
    try:
        with pytest.raises(ConfigError, match=rf"--workdir {workdir} is in use by a training run \(pid {os.getpid()} on "):
            train_loop.train(loop_config(tmp_path, steps=2), workdir, devices=jax.devices()[:1])
        assert os.listdir(workdir) == [run_dir.LOCK_FILE]  # nothing written
    finally:
        held()
    train_loop.train(loop_config(tmp_path, steps=2), workdir, devices=jax.devices()[:1])  # free again: it runs
    assert os.path.exists(os.path.join(workdir, "checkpoints", "2"))


def test_a_holder_that_died_does_not_block_the_next_run(tmp_path):
    workdir = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from andrea_jax import run_dir; "
                               "run_dir.hold(sys.argv[1]); print('held', flush=True); time.sleep(600)", workdir],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ConfigError, match=f"pid {holder.pid} on"):
        run_dir.hold(workdir)
    holder.kill()  # kill -9: no chance to clean up
    holder.wait()
    run_dir.hold(workdir)()


def test_a_workdir_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("a file, not a directory")
    with pytest.raises(ConfigError, match=r"^--workdir .*notes.txt/run cannot be made \(Not a directory\); every "
                                          r"directory on its path must be one that can hold it; use another --workdir$"):
        run_dir.hold(str(tmp_path / "notes.txt" / "run"))
    assert (tmp_path / "notes.txt").read_text() == "a file, not a directory"


def test_a_full_disk_under_a_new_workdir_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    def no_space(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(run_dir.os, "pwrite", no_space)  # the lock file is made; the line in it is not
    workdir = tmp_path / "new" / "run"
    with pytest.raises(DiskFull, match=rf"^the disk is full: writing {re.escape(str(workdir / run_dir.LOCK_FILE))} "
                                       r"\([\d.]+ MiB free there\); free some space"):
        run_dir.hold(str(workdir))
    assert os.listdir(workdir) == [run_dir.LOCK_FILE] and os.path.getsize(workdir / run_dir.LOCK_FILE) == 0


def test_a_run_refused_at_the_lock_leaves_the_holder_s_lock_and_directory(tmp_path):
    """Two runs start at once on a new workdir: both make the directory and run.lock, one gets the lock. The one
    refused must remove neither, or a third run would get a lock of its own beside the holder."""
    workdir = str(tmp_path / "new")
    held = run_dir.hold(workdir)
    try:
        with pytest.raises(ConfigError, match="is in use by a training run"):
            run_dir.hold(workdir)
        with pytest.raises(ConfigError, match="is in use by a training run"):  # a third: still refused
            run_dir.hold(workdir)
        assert os.listdir(workdir) == [run_dir.LOCK_FILE]
    finally:
        held()


def claimed(workdir, cache):
    """The id a start claims, its hold let go (the run ended)."""
    run_id, descriptor = run_dir.claim_identity(workdir, cache)
    if descriptor is not None:
        os.close(descriptor)
    return run_id


def test_a_copied_workdir_takes_an_identity_of_its_own_and_a_moved_one_keeps_its(tmp_path, capsys):
    cache = str(tmp_path / "cache")
    original, copy, moved = (str(tmp_path / name) for name in ("original", "copy", "moved"))
    os.makedirs(original)
    first = claimed(original, cache)
    assert claimed(original, cache) == first  # the same workdir again: the same run
    shutil.copytree(original, copy)
    # While the original runs, a copy started beside it is another run.
    running = run_dir.claim_identity(original, cache)[1]
    concurrent = claimed(copy, cache)
    os.close(running)
    assert concurrent != first and "it becomes run" in capsys.readouterr().out
    # Copied while stopped: the copy's first start tells it by its directory, the original keeps its id.
    shutil.rmtree(copy)
    shutil.copytree(original, copy)
    copied = claimed(copy, cache)
    assert copied not in (first, concurrent) and "claimed by another workdir" in capsys.readouterr().out
    os.rename(original, moved)  # a rename keeps the directory: the same run
    assert claimed(moved, cache) == first and run_dir.identity(moved) == first and run_dir.identity(copy) == copied
    # Another machine's cache (none here) knows no claim: the workdir is the run it was.
    assert claimed(copy, str(tmp_path / "another_cache")) == copied


def test_a_workdir_whose_token_another_start_replaced_takes_a_new_identity(tmp_path):
    """The original of a copy that started first (on this host, by token; elsewhere the token alone tells)."""
    cache, workdir = str(tmp_path / "cache"), str(tmp_path / "w")
    os.makedirs(workdir)
    first = claimed(workdir, cache)
    kept = open(os.path.join(workdir, run_dir.IDENTITY_FILE)).read()
    claimed(workdir, cache)  # two starts the workdir then forgets (as a copy's would be)
    claimed(workdir, cache)
    with open(os.path.join(workdir, run_dir.IDENTITY_FILE), "w") as f:
        f.write(kept)
    assert claimed(workdir, cache) != first


def test_a_start_with_nothing_to_train_leaves_config_json_as_it_was(copy_of):
    config, workdir = copy_of
    path = os.path.join(workdir, run_dir.CONFIG_FILE)
    before = (open(path).read(), os.stat(path).st_ino)
    train_loop.train(config, workdir, devices=jax.devices()[:1])  # finished: no step trains
    assert (open(path).read(), os.stat(path).st_ino) == before  # not even rewritten alike


def test_init_params_from_starts_a_new_workdir_with_another_seq_len_from_the_checkpoint(trained, tmp_path, capsys):
    config, workdir = trained
    changed = config.copy_and_resolve_references()
    changed.update(dict(seq_len=16, steps=1, log_every=1, init_params_from=workdir))
    changed.data.tokenizer = os.path.join(workdir, "tokenizer.json")  # the checkpoint's tokenizer
    fresh = changed.copy_and_resolve_references()
    fresh.init_params_from = ""
    started = train_loop.train(changed, str(tmp_path / "from_checkpoint"), devices=jax.devices()[:1])["loss"]
    assert "the parameters start from step 10 of " in capsys.readouterr().out
    anew = train_loop.train(fresh, str(tmp_path / "anew"), devices=jax.devices()[:1])["loss"]
    assert started < anew - 0.2  # the trained parameters' first step, against an initialisation's


def test_a_refusal_between_the_holders_lock_and_its_text_still_names_the_holder(tmp_path):
    """Two starts at once: the second may find the lock taken and its text not yet written."""
    path = str(tmp_path / run_dir.LOCK_FILE)
    holder = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked; the holder writes itself in 0.2 s later
    threading.Timer(0.2, os.pwrite, (holder, b"pid 123 on host, started now", 0)).start()
    try:
        with pytest.raises(run_dir.Held, match="^pid 123 on host, started now$"):
            run_dir.lock(os.open(path, os.O_RDWR))
    finally:
        os.close(holder)
