"""train.py end to end on a small local corpus: metrics, meshes, stops and errors."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

from andrea_jax import train_loop
from andrea_jax.config import ConfigError, base_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_corpus(directory, num_files=12):
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "value", "index", "for", "in", "range", "if", "else", "print", "x", "y"]
    os.makedirs(directory, exist_ok=True)
    for i in range(num_files):
        lines = [" ".join(rng.choice(words, size=8)) for _ in range(60)]
        with open(os.path.join(directory, f"f{i:02d}.py"), "w") as f:
            f.write("\n".join(lines))
    return directory


def loop_config(tmp_path, **overrides):
    c = base_config()
    m = c.model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim, m.max_len, m.vocab_size = 2, 64, 4, 256, 32, 0
    c.update(dict(seq_len=32, batch_size=8, steps=8, log_every=2, eval_every=4, eval_batches=2,
                  checkpoint_every=4))
    c.optimizer.update(dict(learning_rate=3e-3, warmup_steps=2))
    c.data.update(dict(source="text:" + write_corpus(str(tmp_path / "corpus")), tokenizer="byte",
                       cache_dir=str(tmp_path / "cache"), val_fraction=0.2))
    c.update_from_flattened_dict(overrides)
    return c


def losses(workdir, key="loss"):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [(r["step"], r[key]) for r in map(json.loads, f) if key in r]


def test_metrics_records_and_falling_loss(tmp_path):
    workdir = str(tmp_path / "run")
    last = train_loop.train(loop_config(tmp_path, steps=12, diagnostics=True), workdir, devices=jax.devices()[:1])
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [2, 4, 6, 8, 10, 12]
    for r in train_records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_second"} <= r.keys()
        assert r["tokens_per_second"] > 0 and "mfu" not in r  # a CPU has no known peak
        # config.diagnostics: per-block figures for both blocks, stream norms at every depth
        assert {"diag/grad_norm/block_0", "diag/grad_norm/block_1", "diag/attn_delta_ratio/block_1",
                "diag/mlp_delta_ratio/block_0", "diag/stream_norm/depth_2"} <= r.keys()
        assert all(r[k] > 0 for k in r if k.startswith("diag/grad_norm"))
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8, 12]
    data = json.load(open(os.path.join(workdir, "data.json")))
    val = json.load(open(os.path.join(data["validation_directory"], "val.json")))
    for r in (r for r in records if "val_loss" in r):  # bits per byte over the split's measured bytes
        assert r["val_bits_per_byte"] == pytest.approx(
            r["val_loss"] * val["num_tokens"] / (val["num_bytes"] * np.log(2)), rel=1e-12)
    assert train_records[-1]["loss"] < train_records[0]["loss"] - 0.5
    assert last["val_loss"] == records[-1]["val_loss"]
    # Logged at step 4: the rate of the 4th update (index 3), one step into the 10-step cosine.
    assert train_records[1]["lr"] == pytest.approx(3e-4 + 2.7e-3 * 0.5 * (1 + np.cos(np.pi / 10)), rel=1e-5)
    assert os.path.isdir(os.path.join(workdir, "tensorboard"))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(os.path.join(workdir, "tensorboard")))
    saved = json.load(open(os.path.join(workdir, "config.json")))
    assert saved["project"] == "andrea-jax" and saved["config"]["model"]["vocab_size"] == 257
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["12", "4", "8"]


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
    """(its tmp_path, its workdir): loop_config's 8 steps on one device, the run several tests compare with."""
    root = tmp_path_factory.mktemp("one_device")
    workdir = str(root / "run")
    train_loop.train(loop_config(root), workdir, devices=jax.devices()[:1])
    return root, workdir


def test_one_device_and_a_mixed_mesh_log_the_same_losses(tmp_path, one_device_run):
    _, one = one_device_run
    mesh = str(tmp_path / "mesh")
    train_loop.train(loop_config(tmp_path, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}), mesh)
    a, b = losses(one), losses(mesh)
    assert [s for s, _ in a] == [s for s, _ in b] == [2, 4, 6, 8]
    np.testing.assert_allclose([v for _, v in b], [v for _, v in a], rtol=1e-5)
    np.testing.assert_allclose([v for _, v in losses(mesh, "val_loss")], [v for _, v in losses(one, "val_loss")],
                               rtol=1e-5)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    workdir = str(tmp_path / "run")
    config = loop_config(tmp_path, steps=40, checkpoint_every=2, log_every=1)
    config.optimizer.update(dict(learning_rate=1e4, warmup_steps=0, grad_clip_norm=1e12, decay="constant"))
    with pytest.raises(train_loop.TrainingStopped, match="became non-finite at step (\\d+).*lower optimizer"):
        train_loop.train(config, workdir, devices=jax.devices()[:1])
    logged = [s for s, _ in losses(workdir)]
    saved = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")) if s.isdigit())
    assert saved and saved[-1] <= logged[-1] + 1 and saved[-1] < 40


def test_a_run_ends_naming_its_last_checkpoint_and_a_resume_names_a_changed_schedule(tmp_path, capsys):
    from andrea_jax import flops
    from andrea_jax import run_dir
    workdir, devices = str(tmp_path / "run"), jax.devices()[:1]
    train_loop.train(loop_config(tmp_path, peak_flops=1e12), workdir, devices=devices)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"finished step 8; the last checkpoint is {workdir}/checkpoints/8"
    assert not any("schedule" in line for line in out)
    # With config.peak_flops a CPU run has an MFU: the logged rate of model FLOPs over that peak.
    flops_per_token = flops.flops_per_token(run_dir.load_saved_config(workdir).model, 32)
    records = [r for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl"))) if "loss" in r]
    assert records and all(r["mfu"] == pytest.approx(r["tokens_per_second"] * flops_per_token / 1e12, rel=1e-9)
                           for r in records)
    # Two steps more on the finished run: the cosine is recomputed over 10 steps, and the rate rises again.
    train_loop.train(loop_config(tmp_path, steps=10), workdir, devices=devices)
    out = capsys.readouterr().out.strip().splitlines()
    assert ("the learning-rate schedule changes on resume (steps 8 → 10): step 9 trains at 0.000695, "
            "where the run's own schedule gave 0.0003") in out
    assert out[-1] == f"finished step 10; the last checkpoint is {workdir}/checkpoints/10"
    assert losses(workdir, "lr")[-1] == (10, pytest.approx(3e-4 + 2.7e-3 * 0.5 * (1 + np.cos(np.pi * 7 / 8)),
                                                           rel=1e-5))  # above the floor of 3e-4 again
    # The same command again: nothing left to train, nothing changed.
    train_loop.train(loop_config(tmp_path, steps=10), workdir, devices=devices)
    out = capsys.readouterr().out.strip().splitlines()
    assert not any("schedule" in line for line in out)
    assert out[-1] == f"finished step 10; the last checkpoint is {workdir}/checkpoints/10"


def run_train(*args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.parametrize("override, message", [
    ("--config.model.n_head=5", "n_head=5 does not divide model.d_model=256"),
    ("--config.mesh.data=3", "needs 3 devices but 1 are present"),
    ("--config.optimizer.learning_rate=nan", "optimizer.learning_rate=nan must be a finite number in (0, inf)"),
    ("--config.optimizer.name=lion", "optimizer.name='lion' is not one of 'adamw', 'muon'"),
])
def test_train_py_rejects_bad_configs_with_one_line(tmp_path, override, message):
    result = run_train("--config", "configs/tiny.py", "--workdir", str(tmp_path / "w"), override,
                       f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.data.source=text:" +
                       write_corpus(str(tmp_path / "corpus"), 2), "--config.data.tokenizer=byte",
                       "--config.model.vocab_size=0", "--config.steps=2")
    assert result.returncode == 2
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not os.path.exists(tmp_path / "w")


def test_a_new_run_that_stops_before_its_first_step_leaves_no_workdir(tmp_path):
    from andrea_jax.data import DataError
    with socket.socket() as unused:  # bound, never listening: the download is refused
        unused.bind(("127.0.0.1", 0))
        config = loop_config(tmp_path, **{"data.source": f"url:http://127.0.0.1:{unused.getsockname()[1]}/a.txt"})
        with pytest.raises(DataError, match="cannot download"):
            train_loop.train(config, str(tmp_path / "new"), devices=jax.devices()[:1])
        assert not os.path.exists(tmp_path / "new")
        # A run that took steps keeps its workdir whatever stops it later.
        workdir = str(tmp_path / "kept")
        train_loop.train(loop_config(tmp_path, steps=2, checkpoint_every=2), workdir, devices=jax.devices()[:1])
        with pytest.raises(ConfigError, match="data.source=.* which a resume cannot change"):
            train_loop.train(config, workdir, devices=jax.devices()[:1])
    assert {"checkpoints", "config.json", "metrics.jsonl"} <= set(os.listdir(workdir))
    # A run that cannot take a new workdir's lock (another run holds it) leaves that run's files alone.
    from andrea_jax import run_dir
    busy = str(tmp_path / "busy")
    held = run_dir.hold(busy)
    try:
        with pytest.raises(ConfigError, match="is in use by a training run"):
            train_loop.train(config, busy, devices=jax.devices()[:1])
        assert os.listdir(busy) == ["run.lock"]
    finally:
        held()


@pytest.mark.parametrize("arguments, message", [
    (["--config", "configs/tiny.py", "--config.stepz=5"], 'no key \'stepz\'; Did you mean "steps"'),
    (["--config", "configs/tiny.py", "--config.optimzer.learning_rate=1e-3"],
     'no key \'optimzer\'; Did you mean "optimizer" instead of "optimzer"?; every key is in andrea_jax/config.py'),
    (["--config", "configs/nope.py"], "the --config file could not be loaded ([Errno 2] No such file"),
    (["--config", "configs/tiny.py", "--config.steps=abc"], "flag --config.steps=abc: invalid literal"),
    (["--config", "configs/tiny.py", "--stepz=5"], "Unknown command line flag 'stepz'"),
    ([], "Flag --config must have a value"),
    (["--config", "configs/tiny.py", "--workdir", "FILE"], "is a file, not a directory; pick a new or empty"),
])
def test_command_line_mistakes_are_one_line_before_any_work(tmp_path, arguments, message):
    (tmp_path / "file").write_text("not a directory")
    result = run_train(*[str(tmp_path / "file") if a == "FILE" else a for a in arguments], timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [line for line in result.stderr.splitlines()
                                                  if line.startswith("error:")], result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "file").read_text() == "not a directory"


def test_auto_dtype_is_recorded_and_kept_on_resume(tmp_path, monkeypatch):
    from andrea_jax import precision
    with_bf16, without = "flags\t: fpu avx512f avx512_bf16\n", "flags\t: fpu avx2\n"
    saved_dtype = lambda workdir: json.load(open(os.path.join(workdir, "config.json")))["config"]["model"]["dtype"]
    workdir = str(tmp_path / "run")
    monkeypatch.setattr(precision, "_read_cpuinfo", lambda: with_bf16)
    train_loop.train(loop_config(tmp_path, steps=2, **{"model.dtype": "auto", "model.attention": "auto"}), workdir,
                     devices=jax.devices()[:1])
    assert saved_dtype(workdir) == "bfloat16"
    # "auto" attention is recorded as what ran too: the einsum path on a CPU.
    assert json.load(open(os.path.join(workdir, "config.json")))["config"]["model"]["attention"] == "xla"
    # Resumed on a CPU without bf16: the run keeps the dtype it has been computing in.
    monkeypatch.setattr(precision, "_read_cpuinfo", lambda: without)
    train_loop.train(loop_config(tmp_path, steps=4, **{"model.dtype": "auto"}), workdir, devices=jax.devices()[:1])
    assert saved_dtype(workdir) == "bfloat16"
    assert [step for step, _ in losses(workdir)] == [2, 4]
    # A new run there computes in float32.
    fresh = str(tmp_path / "fresh")
    train_loop.train(loop_config(tmp_path, steps=2, **{"model.dtype": "auto"}), fresh, devices=jax.devices()[:1])
    assert saved_dtype(fresh) == "float32"


def test_a_resume_whose_own_micro_batches_do_not_split_over_the_devices_stops_with_one_line(tmp_path):
    workdir = str(tmp_path / "run")
    train_loop.train(loop_config(tmp_path, steps=2, microbatches=2), workdir, devices=jax.devices()[:1])
    # Resumed with microbatches=0 (auto), the run keeps its 2; batch_size 8 does not split over 2 × 8 devices.
    with pytest.raises(ConfigError, match="does not split over microbatches × mesh.data × mesh.fsdp = 2 × 8 × 1"):
        train_loop.train(loop_config(tmp_path, steps=4, microbatches=0), workdir, devices=jax.devices())
    assert [step for step, _ in losses(workdir)] == [2]


def test_a_workdir_copied_to_another_file_system_resumes_exactly(one_device_run):
    """As on Colab: the run's directory copied elsewhere (a Drive, another mount) resumes there, exactly."""
    root, unbroken = one_device_run
    other_mount = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    if other_mount is None or os.stat(other_mount).st_dev == os.stat(root).st_dev:
        pytest.skip("no writable second file system (/dev/shm) here")
    copied = tempfile.mkdtemp(dir=other_mount, prefix="andrea_copied_")
    try:
        # The run as if the runtime had gone after step 4: copied without the checkpoint of step 8.
        shutil.copytree(unbroken, copied, dirs_exist_ok=True,
                        ignore=lambda directory, names: ["8"] if directory.endswith("checkpoints") else [])
        train_loop.train(loop_config(root), copied, devices=jax.devices()[:1])
        assert losses(copied) == losses(unbroken)
        assert losses(copied, "val_loss") == losses(unbroken, "val_loss")
        assert sorted(os.listdir(os.path.join(copied, "checkpoints"))) == ["4", "8"]
    finally:
        shutil.rmtree(copied)


def test_a_run_killed_before_it_knew_its_tokenizer_resumes(tmp_path):
    """Killed during data preparation: config.json is there, still with model.vocab_size=0."""
    from andrea_jax import run_dir
    workdir = str(tmp_path / "run")
    config = loop_config(tmp_path, steps=2)
    run_dir.save_config(workdir, config)
    train_loop.train(config, workdir, devices=jax.devices()[:1])
    assert [step for step, _ in losses(workdir)] == [2]
    assert run_dir.load_saved_config(workdir).model.vocab_size == 257


MUON_WSD = {"optimizer.name": "muon", "optimizer.decay": "wsd", "optimizer.cooldown_steps": 2}


@pytest.fixture(scope="module")
def muon_one_device_run(tmp_path_factory):
    """(its tmp_path, its workdir): loop_config's 8 steps with Muon and WSD (cooling from step 6) on one device."""
    root = tmp_path_factory.mktemp("muon_one_device")
    workdir = str(root / "run")
    train_loop.train(loop_config(root, **MUON_WSD), workdir, devices=jax.devices()[:1])
    return root, workdir


@pytest.mark.parametrize("mesh", [dict(data=8), dict(data=2, fsdp=2, tensor=2)], ids=["data8", "data2_fsdp2_tensor2"])
def test_muon_with_wsd_logs_the_same_losses_on_one_device_and_on_eight(tmp_path, muon_one_device_run, mesh):
    _, one = muon_one_device_run
    workdir = str(tmp_path / "mesh")
    train_loop.train(loop_config(tmp_path, **MUON_WSD, **{f"mesh.{axis}": size for axis, size in mesh.items()}),
                     workdir)
    a, b = losses(one), losses(workdir)
    assert [s for s, _ in a] == [s for s, _ in b] == [2, 4, 6, 8]
    np.testing.assert_allclose([v for _, v in b], [v for _, v in a], rtol=1e-5)
    np.testing.assert_allclose([v for _, v in losses(workdir, "val_loss")], [v for _, v in losses(one, "val_loss")],
                               rtol=1e-5)


def test_a_wsd_run_resumed_with_more_steps_at_its_peak_moves_its_cooldown(tmp_path, muon_one_device_run, capsys):
    root, unbroken = muon_one_device_run
    workdir = str(tmp_path / "moved")
    shutil.copytree(unbroken, workdir, ignore=lambda directory, names: ["8"] if directory.endswith("checkpoints") else [])
    train_loop.train(loop_config(root, **{**MUON_WSD, "steps": 12}), workdir, devices=jax.devices()[:1])
    out = capsys.readouterr().out
    assert ("the learning-rate schedule changes on resume (steps 8 → 12): step 5 trains at 0.003 as before; "
            "the cooldown now starts at step 10") in out
    before, after = dict(losses(unbroken, "lr")), dict(losses(workdir, "lr"))
    assert [after[s] for s in (2, 4, 6)] == [before[s] for s in (2, 4, 6)]
    assert before[8] == pytest.approx(3e-4 + 2.7e-3 / 2) and after[8] == pytest.approx(3e-3)  # cooling, and not yet
    assert after[12] == pytest.approx(3e-4 + 2.7e-3 / 2)
    assert losses(workdir)[:2] == losses(unbroken)[:2]


def test_a_run_resumed_with_another_optimizer_stops_with_one_line_and_loses_nothing(tmp_path, muon_one_device_run):
    root, trained = muon_one_device_run
    workdir = str(tmp_path / "copy")
    shutil.copytree(trained, workdir)
    before = {path: os.path.getmtime(os.path.join(directory, path)) for directory, _, files in os.walk(workdir)
              for path in files}
    with pytest.raises(ConfigError, match="holds a run with optimizer.name='muon', which a resume cannot change to "
                                          "'adamw'; pass --config.optimizer.name='muon' to resume it"):
        train_loop.train(loop_config(root, steps=12), workdir, devices=jax.devices()[:1])
    assert {path: os.path.getmtime(os.path.join(directory, path)) for directory, _, files in os.walk(workdir)
            for path in files} == before


def test_the_first_hellaswag_score_at_gpt2_s_is_one_line_and_one_record(tmp_path, monkeypatch, capsys):
    from andrea_jax.tools import hellaswag
    from tests.test_hellaswag import write_jsonl
    # GPT-2's 0.2955 is out of a tiny model's reach: any score reaches a target of 0.
    monkeypatch.setattr(hellaswag, "GPT2_124M_HELLASWAG", 0.0)
    workdir = str(tmp_path / "run")
    config = loop_config(tmp_path, **{"hellaswag.every": 4, "hellaswag.source": write_jsonl(tmp_path / "val.jsonl")})
    train_loop.train(config, workdir, devices=jax.devices()[:1])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "for the first time" in line]
    assert len(lines) == 1 and lines[0].startswith(
        "step 4: HellaSwag acc_norm reached GPT-2 124M's 0.0 for the first time, after 1,024 tokens and 0.0")
    targets = [r for r in metrics_records(workdir) if train_loop.TARGET_KEY in r]
    assert [(r["step"], r["target/tokens"]) for r in targets] == [(4, 1024)] and 0 < targets[0]["target/hours"] < 0.1
    assert [r["step"] for r in metrics_records(workdir) if "hellaswag/acc_norm" in r] == [4, 8]
    train_loop.train(loop_config(tmp_path, steps=12, **{"hellaswag.every": 4, "hellaswag.source": config.hellaswag.source}),
                     workdir, devices=jax.devices()[:1])  # a resume: reached already, said once
    assert "for the first time" not in capsys.readouterr().out
    assert [r["step"] for r in metrics_records(workdir) if train_loop.TARGET_KEY in r] == [4]


def metrics_records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_ctrl_c_while_the_step_compiles_stops_at_once_in_one_line_and_removes_the_new_workdir(tmp_path):
    workdir = tmp_path / "w"
    with open(tmp_path / "stderr", "w+") as stderr:
        process = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "train.py"), "--config", "configs/tiny.py", "--workdir", str(workdir),
             f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.data.source=text:" +
             write_corpus(str(tmp_path / "corpus")), "--config.data.tokenizer=byte", "--config.model.vocab_size=0",
             "--config.steps=5", "--config.batch_size=2", "--config.seq_len=64"],
            stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT,
            # Compiled here, not taken from the suite's cache: the compile is the window the Ctrl-C must land in.
            env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONUNBUFFERED="1",
                     JAX_ENABLE_COMPILATION_CACHE="false"))
        try:
            out = ""
            for line in process.stdout:  # the mesh line comes just before the step compiles
                out += line
                if line.startswith("mesh "):
                    break
            process.send_signal(signal.SIGINT)
            out += process.communicate(timeout=120)[0]
        finally:
            process.kill()
        stderr.seek(0)
        err = stderr.read()
    assert process.returncode == 2, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: stopped by Ctrl-C before the first step"), err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "mesh " in out and "step 1" not in out and not workdir.exists()
