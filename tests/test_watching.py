"""Watching a run: its records mirrored to Weights & Biases (wandb_mirror.py) and a profiler trace (trace.py)."""

import glob
import gzip
import importlib.util
import json
import os
import shutil
import socket
import struct

import jax
import pytest

from andrea_jax import run_dir, train_loop
from andrea_jax.runtime import stop
from tests.test_train_loop import loop_config, losses

needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                                 reason="wandb is not installed: pip install wandb")


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """(its tmp_path, its workdir): loop_config's 8 steps with neither W&B nor a trace."""
    root = tmp_path_factory.mktemp("plain")
    train_loop.train(loop_config(root), str(root / "run"), devices=jax.devices()[:1])
    return root, str(root / "run")


def wandb_records(path):
    """The protobuf records of a .wandb file: a W&B header, then LevelDB's log format (32 KiB blocks of
    7-byte-headed chunks: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(pending)


def wandb_sessions(workdir):
    """Each offline W&B run file in the workdir, in order: (its run id, the (run, step) it was rewound or
    forked to, or None, its config, [each logged row as a dict])."""
    sessions = []
    for path in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))):
        rows = []
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
                branch = (run.branch_point.run, run.branch_point.value) if run.HasField("branch_point") else None
                config = {item.key: json.loads(item.value_json) for item in run.config.update}
                sessions.append((run.run_id, branch, config, rows))
            elif kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return sessions


def wandb_history(workdir):
    """({run id: [each logged row as a dict]} over the offline runs W&B wrote in the workdir, in order, the last
    run's config)."""
    runs = {}
    for run_id, _, config, rows in wandb_sessions(workdir):
        runs.setdefault(run_id, []).extend(rows)
    return runs, config


def logged(rows, key="loss"):
    """(step, value) of the rows that hold `key`, as `losses` gives them from metrics.jsonl."""
    return [(row["_step"], row[key]) for row in rows if key in row]


@needs_wandb
def test_an_offline_wandb_run_holds_the_logged_losses_and_a_resume_continues_it(tmp_path, monkeypatch, plain_run):
    monkeypatch.setenv("WANDB_MODE", "offline")
    workdir = str(tmp_path / "run")
    train_loop.train(loop_config(tmp_path, **{"wandb.project": "andrea-tests"}), workdir, devices=jax.devices()[:1])
    assert losses(workdir) == losses(plain_run[1])  # W&B changes nothing the run computes
    runs, config = wandb_history(workdir)
    (run_id, rows), = runs.items()
    assert json.load(open(os.path.join(workdir, "wandb.json"))) == {
        "id": run_id, "sent": 8, "agreed": 8, "run": run_dir.identity(workdir), "project": "andrea-tests",
        "entity": None}
    assert config["seed"] == 0 and config["optimizer"]["learning_rate"] == 3e-3  # the run's config
    assert [(row["_step"], row["loss"]) for row in rows if "loss" in row] == [(s, pytest.approx(v, rel=1e-12))
                                                                              for s, v in losses(workdir)]
    assert [(row["_step"], row["val_loss"]) for row in rows if "val_loss" in row] == \
        [(s, pytest.approx(v, rel=1e-12)) for s, v in losses(workdir, "val_loss")]
    # Resumed with 4 steps more: the same W&B run, which gets steps 10 and 12 and nothing it had.
    train_loop.train(loop_config(tmp_path, steps=12, **{"wandb.project": "andrea-tests"}), workdir,
                     devices=jax.devices()[:1])
    runs, _ = wandb_history(workdir)
    assert list(runs) == [run_id]
    assert [row["_step"] for row in runs[run_id] if "loss" in row] == [2, 4, 6, 8, 10, 12]


@needs_wandb
def test_an_unreachable_wandb_is_one_warning_and_the_run_trains_as_without_it(tmp_path, monkeypatch, capfd, plain_run):
    with socket.socket() as unused:  # bound, never listening: every request is refused
        unused.bind(("127.0.0.1", 0))
        monkeypatch.setenv("WANDB_MODE", "online")
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{unused.getsockname()[1]}")
        workdir = str(tmp_path / "run")
        train_loop.train(loop_config(tmp_path, **{"wandb.project": "andrea-tests", "wandb.timeout_seconds": 2}),
                         workdir, devices=jax.devices()[:1])
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: W&B")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: W&B could not start"), err[-3000:]
    assert warnings[0].endswith("training goes on with its local logs (metrics.jsonl, tensorboard/)")
    assert losses(workdir) == losses(plain_run[1])
    assert losses(workdir, "val_loss") == losses(plain_run[1], "val_loss")


WANDB = {"wandb.project": "andrea-tests"}


def state(workdir):
    with open(os.path.join(workdir, "wandb.json")) as f:
        return json.load(f)


def as_logged(workdir, key="loss", after=0):
    """metrics.jsonl's (step, value) past `after`, as W&B's rows must hold them."""
    return [(step, pytest.approx(value, rel=1e-12)) for step, value in losses(workdir, key) if step > after]


@needs_wandb
def test_a_resume_from_an_earlier_checkpoint_rewinds_the_wandb_run_to_it(tmp_path, monkeypatch, capfd):
    """The fix for a divergence: the last good checkpoint taken again with a lower rate. W&B must hold the
    steps trained again, not the old ones."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    workdir = str(tmp_path / "run")
    train_loop.train(loop_config(tmp_path, **WANDB), workdir, devices=jax.devices()[:1])
    shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
    capfd.readouterr()
    train_loop.train(loop_config(tmp_path, **WANDB, **{"optimizer.learning_rate": 1e-3}), workdir,
                     devices=jax.devices()[:1])
    err = capfd.readouterr().err
    (run_id, first_branch, _, first), (again, branch, _, second) = wandb_sessions(workdir)
    assert again == run_id and first_branch is None and branch == (run_id, 4)
    assert logged(second) == as_logged(workdir, after=4) and [step for step, _ in logged(second)] == [6, 8]
    assert logged(second, "val_loss") == as_logged(workdir, "val_loss", after=4)
    assert logged(first)[2:] != logged(second)  # the lower rate's losses, which W&B had no other way to get
    assert (f"W&B: run {run_id} is rewound to step 4: its steps 5 to 8 are replaced by metrics.jsonl's and the "
            f"ones trained now") in err.splitlines()
    assert state(workdir)["sent"] == 8


@needs_wandb
def test_a_copied_workdir_gets_a_wandb_run_of_its_own_and_a_moved_one_keeps_its_run(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("WANDB_MODE", "offline")
    original = str(tmp_path / "run")
    train_loop.train(loop_config(tmp_path, **WANDB), original, devices=jax.devices()[:1])
    run_id = state(original)["id"]
    copy = str(tmp_path / "another_setting")
    shutil.copytree(original, copy)
    capfd.readouterr()
    train_loop.train(loop_config(tmp_path, steps=12, **WANDB), copy, devices=jax.devices()[:1])
    err = capfd.readouterr().err
    own = state(copy)["id"]
    assert own != run_id and state(copy)["sent"] == 12 and state(copy)["run"] == run_dir.identity(copy)
    assert run_dir.identity(copy) != run_dir.identity(original)
    (branch, rows), = [(branch, rows) for run, branch, _, rows in wandb_sessions(copy) if run == own]
    assert branch is None  # a new run, sent the whole of the copy's metrics.jsonl: no preview feature needed
    assert logged(rows) == as_logged(copy) and [step for step, _ in logged(rows)] == [2, 4, 6, 8, 10, 12]
    assert (f"W&B: run {run_id} mirrors another run (the workdir's run changed): the records go to a new W&B run, "
            f"{own}, sent the whole of metrics.jsonl") in err.splitlines()
    assert state(original)["id"] == run_id
    # Moved rather than copied (nothing holds the run where it was): the same W&B run goes on.
    moved = str(tmp_path / "moved")
    os.rename(original, moved)
    train_loop.train(loop_config(tmp_path, steps=12, **WANDB), moved, devices=jax.devices()[:1])
    assert [(run, branch) for run, branch, _, _ in wandb_sessions(moved)] == [(run_id, None), (run_id, None)]
    assert state(moved)["id"] == run_id and state(moved)["sent"] == 12


@needs_wandb
def test_steps_trained_while_wandb_was_unreachable_reach_it_on_resume(tmp_path, monkeypatch, capfd):
    workdir = str(tmp_path / "run")
    with socket.socket() as unused:  # bound, never listening: every request is refused
        unused.bind(("127.0.0.1", 0))
        monkeypatch.setenv("WANDB_MODE", "online")
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{unused.getsockname()[1]}")
        train_loop.train(loop_config(tmp_path, **WANDB, **{"wandb.timeout_seconds": 2}), workdir,
                         devices=jax.devices()[:1])
    monkeypatch.setenv("WANDB_MODE", "offline")
    capfd.readouterr()
    train_loop.train(loop_config(tmp_path, steps=12, **WANDB), workdir, devices=jax.devices()[:1])
    err = capfd.readouterr().err
    (run_id, rows), = wandb_history(workdir)[0].items()
    assert logged(rows) == as_logged(workdir) and [step for step, _ in logged(rows)] == [2, 4, 6, 8, 10, 12]
    assert logged(rows, "val_loss") == as_logged(workdir, "val_loss")
    assert f"W&B: sending steps 2 to 8 from metrics.jsonl, which run {run_id} lacks" in err.splitlines()


@needs_wandb
def test_a_timeline_discarded_while_wandb_was_off_is_rewound_when_it_is_on_again(tmp_path, monkeypatch, capfd):
    """Trained to 8 with W&B; resumed from 4 with W&B off and another rate; then a start with W&B on. W&B must
    hold the steps trained again, not the discarded ones."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    workdir = str(tmp_path / "run")
    train_loop.train(loop_config(tmp_path, **WANDB), workdir, devices=jax.devices()[:1])
    run_id = state(workdir)["id"]
    shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
    train_loop.train(loop_config(tmp_path, **{"optimizer.learning_rate": 1e-3}), workdir, devices=jax.devices()[:1])
    assert state(workdir)["agreed"] == 4 and state(workdir)["sent"] == 8
    capfd.readouterr()
    train_loop.train(loop_config(tmp_path, **WANDB, **{"optimizer.learning_rate": 1e-3}), workdir,
                     devices=jax.devices()[:1])  # nothing left to train: W&B is brought level
    (first_id, _, _, first), (again, branch, _, second) = wandb_sessions(workdir)
    assert again == first_id == run_id and branch == (run_id, 4)
    assert logged(second) == as_logged(workdir, after=4) and logged(first)[2:] != logged(second)
    assert state(workdir)["sent"] == state(workdir)["agreed"] == 8


@needs_wandb
def test_a_refused_rewind_starts_a_new_run_with_all_of_metrics_jsonl_and_wandb_stays_on(tmp_path, monkeypatch,
                                                                                        capfd):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    workdir = str(tmp_path / "run")
    train_loop.train(loop_config(tmp_path, **WANDB), workdir, devices=jax.devices()[:1])
    run_id = state(workdir)["id"]
    shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
    init = wandb.init

    def refusing(**kwargs):
        if "resume_from" in kwargs:
            raise wandb.errors.CommError("cannot rewind a run that is not in a terminal state")
        return init(**kwargs)

    monkeypatch.setattr(wandb, "init", refusing)
    capfd.readouterr()
    train_loop.train(loop_config(tmp_path, **WANDB), workdir, devices=jax.devices()[:1])
    err = capfd.readouterr().err
    new_id = state(workdir)["id"]
    assert new_id != run_id and (f"W&B: W&B refused to rewind run {run_id} (CommError: cannot rewind a run that is not in a "
                                 f"terminal state): the records go to a new W&B run, {new_id}, sent the whole of "
                                 f"metrics.jsonl") in err.splitlines()
    (branch, rows), = [(branch, rows) for run, branch, _, rows in wandb_sessions(workdir) if run == new_id]
    assert branch is None and logged(rows) == as_logged(workdir)
    train_loop.train(loop_config(tmp_path, steps=10, **WANDB), workdir, devices=jax.devices()[:1])  # on, and goes on
    assert state(workdir)["id"] == new_id and state(workdir)["sent"] == 10


def test_a_trace_of_steps_3_to_5_names_the_train_step_and_changes_no_loss(tmp_path, plain_run):
    workdir = str(tmp_path / "run")
    train_loop.train(loop_config(tmp_path, profile_steps="3:5"), workdir, devices=jax.devices()[:1])
    assert losses(workdir) == losses(plain_run[1]) and losses(workdir, "val_loss") == losses(plain_run[1], "val_loss")
    traces = glob.glob(os.path.join(workdir, "profile", "process_0", "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1
    with open(traces[0], "rb") as f:
        xplane = f.read()
    assert b"jit_train_step" in xplane and train_step_runs(traces[0]) == 3
    assert glob.glob(os.path.join(os.path.dirname(traces[0]), "*.trace.json.gz"))  # Perfetto's


def train_step_runs(xplane):
    """How many runs of the train step the trace beside `xplane` holds: each run's device ops share a run_id."""
    (path,) = glob.glob(os.path.join(os.path.dirname(xplane), "*.trace.json.gz"))
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    return len({event["args"]["run_id"] for event in events
                if event.get("args", {}).get("hlo_module") == "jit_train_step"})


def test_a_trace_cut_by_a_stop_says_what_it_holds_and_the_resume_traces_the_rest(tmp_path, monkeypatch, capsys,
                                                                                  plain_run):
    workdir = str(tmp_path / "run")
    directory = os.path.join(workdir, "profile", "process_0")
    agreed = stop.StopRequest.agreed
    monkeypatch.setattr(stop.StopRequest, "agreed", lambda self, done, waited_out=False: done == 4)  # SIGTERM in 4
    assert train_loop.train(loop_config(tmp_path, profile_steps="3:6"), workdir,
                            devices=jax.devices()[:1])["stopped_at"] == 4
    assert (f"the trace of steps 3 to 6 stopped with the run after step 4: {directory} holds steps 3 to 4; a resume "
            f"traces the steps after its checkpoint up to 6") in capsys.readouterr().out.splitlines()
    first = glob.glob(os.path.join(directory, "plugins", "profile", "*", "*.xplane.pb"))
    assert len(first) == 1
    monkeypatch.setattr(stop.StopRequest, "agreed", agreed)
    train_loop.train(loop_config(tmp_path, profile_steps="3:6"), workdir, devices=jax.devices()[:1])
    assert (f"traced steps 5 to 6 into {directory}; steps 3 to 4 ran before the resume, their trace in a directory "
            f"of its own (README, \"Watching a run\", says how to read it)") in capsys.readouterr().out.splitlines()
    traces = glob.glob(os.path.join(directory, "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 2 and first[0] in traces
    for path in traces:
        assert train_step_runs(path) == 2
    assert losses(workdir) == losses(plain_run[1]) and losses(workdir, "val_loss") == losses(plain_run[1], "val_loss")


@pytest.mark.parametrize("span", ["5", "0:3", "4:2", "3:99", "a:b"])
def test_an_impossible_trace_span_is_one_line(span):
    from andrea_jax.config import ConfigError, base_config, validate
    config = base_config()
    config.steps, config.profile_steps = 20, span
    with pytest.raises(ConfigError, match=rf"^profile_steps='{span}' must be 'A:B' with 1 <= A <= B <= steps=20"):
        validate(config)
