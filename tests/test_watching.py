"""Watching a run: its records mirrored to Weights & Biases (wandb_mirror.py) and a profiler trace (trace.py)."""

import glob
import importlib.util
import json
import os
import socket
import struct

import jax
import pytest

from andrea_jax import train_loop
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


def wandb_history(workdir):
    """{run id: [each logged row as a dict]} over the offline runs W&B wrote in the workdir, in order."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                rows = runs.setdefault(record.run.run_id, [])
                config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return runs, config


@needs_wandb
def test_an_offline_wandb_run_holds_the_logged_losses_and_a_resume_continues_it(tmp_path, monkeypatch, plain_run):
    monkeypatch.setenv("WANDB_MODE", "offline")
    workdir = str(tmp_path / "run")
    train_loop.train(loop_config(tmp_path, **{"wandb.project": "andrea-tests"}), workdir, devices=jax.devices()[:1])
    assert losses(workdir) == losses(plain_run[1])  # W&B changes nothing the run computes
    runs, config = wandb_history(workdir)
    (run_id, rows), = runs.items()
    assert json.load(open(os.path.join(workdir, "wandb.json"))) == {"id": run_id, "logged_through": 8}
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


def test_a_trace_of_steps_3_to_5_names_the_train_step_and_changes_no_loss(tmp_path, plain_run):
    workdir = str(tmp_path / "run")
    train_loop.train(loop_config(tmp_path, profile_steps="3:5"), workdir, devices=jax.devices()[:1])
    assert losses(workdir) == losses(plain_run[1]) and losses(workdir, "val_loss") == losses(plain_run[1], "val_loss")
    traces = glob.glob(os.path.join(workdir, "profile", "process_0", "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1
    with open(traces[0], "rb") as f:
        xplane = f.read()
    assert b"jit_train_step" in xplane
    assert glob.glob(os.path.join(os.path.dirname(traces[0]), "*.trace.json.gz"))  # Perfetto's


@pytest.mark.parametrize("span", ["5", "0:3", "4:2", "3:99", "a:b"])
def test_an_impossible_trace_span_is_one_line(span):
    from andrea_jax.config import ConfigError, base_config, validate
    config = base_config()
    config.steps, config.profile_steps = 20, span
    with pytest.raises(ConfigError, match=rf"^profile_steps='{span}' must be 'A:B' with 1 <= A <= B <= steps=20"):
        validate(config)
