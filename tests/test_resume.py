"""Resuming a run: after a clean stop, a SIGTERM or a SIGKILL the logged numbers equal an unbroken run's."""

import os
import signal
import subprocess
import sys
import time

import pytest

from andrea_jax import metrics
from tests.test_checkpoint import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPARED = ("loss", "lr", "grad_norm", "val_loss")  # not tokens_per_second or mfu: those are timings


def logged(workdir):
    """metrics.jsonl without the timing keys, for exact comparison."""
    return [{k: v for k, v in record.items() if k == "step" or k in COMPARED} for record in metrics.read(workdir)]


def checkpoint_steps(workdir):
    directory = os.path.join(workdir, "checkpoints")
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit()) if os.path.isdir(directory) else []


STEPS = 40


def unbroken_run(tmp_path, **overrides):
    """A 40-step config file (dropout on) and the unbroken run's metrics.

    Every run here is a subprocess with one CPU device: runs compared bit for bit must compile the same
    programs, and the suite's compilation cache (tests/conftest.py) compiles them once for every module.
    """
    config = tiny_config(tmp_path, steps=STEPS, eval_every=10, **{"model.dropout": 0.1, "peak_flops": 1e12},
                         **overrides)
    config_file = tmp_path / "run_config.py"
    config_file.write_text("import json\nimport ml_collections\n\n\ndef get_config():\n"
                           f"    return ml_collections.ConfigDict(json.loads({config.to_json()!r}))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    paths = dict(root=tmp_path, config_file=config_file, env=env, unbroken=str(tmp_path / "unbroken"))
    process = start_train(paths, paths["unbroken"])
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output[-3000:]
    return paths


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return unbroken_run(tmp_path_factory.mktemp("resume"))


def start_train(run, workdir):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--config", str(run["config_file"]),
                             "--workdir", workdir], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=run["env"], cwd=ROOT)


def wait_for(condition, process, what, timeout=300):
    """Polls until condition() holds; fails if the process ends first or the time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"train.py exited (code {process.returncode}) before {what}:\n{process.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no {what} after {timeout} s")
        time.sleep(0.02)


def last_logged_step(workdir):
    try:
        records = metrics.read(workdir)
    except ValueError:  # a line being written
        return 0
    return max((r["step"] for r in records), default=0)


_STOP_AT_7 = """
import sys
sys.path.insert(0, sys.argv[1])
from absl import flags
from andrea_jax.runtime import stop
from ml_collections import config_flags
config = config_flags.DEFINE_config_file("config")
flags.FLAGS(["x", "--config", sys.argv[2]])
# What a SIGTERM during step 7 makes the loop do, without depending on timing.
stop.StopRequest.agreed = lambda self, done, waited_out=False: done == 7
from andrea_jax import train_loop
print(train_loop.train(config.value, sys.argv[3]))
"""


def test_a_stop_inside_a_log_interval_resumes_bit_for_bit(run):
    # The stop at 7 splits the log interval 6..9: the record at 9 must still average steps 7, 8 and 9.
    workdir = str(run["root"] / "stop_at_7")
    stopped = subprocess.run([sys.executable, "-c", _STOP_AT_7, ROOT, str(run["config_file"]), workdir],
                             capture_output=True, text=True, env=run["env"], timeout=600)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "'stopped_at': 7" in stopped.stdout and checkpoint_steps(workdir) == [5, 7]
    assert [r["step"] for r in metrics.read(workdir)] == [3, 6]  # nothing is logged at a stop
    process = start_train(run, workdir)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0 and "resumed from step 7 " in output, output[-3000:]
    expected = logged(run["unbroken"])
    assert [r["step"] for r in expected if "loss" in r] == list(range(3, STEPS, 3)) + [STEPS]
    assert logged(workdir) == expected


def test_sigterm_and_sigkill_lose_nothing_and_resume_exactly(run):
    workdir = str(run["root"] / "interrupted")

    # SIGTERM: the step in flight finishes, its checkpoint is written, exit code 0.
    process = start_train(run, workdir)
    wait_for(lambda: last_logged_step(workdir) >= 6, process, "step 6")
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output[-3000:]
    assert "SIGTERM received: saving step " in output
    stopped = int(output.split("stopped at step ")[1].split()[0])
    assert 6 <= stopped < STEPS, "the run ended before the signal; the test needs it to stop early"
    assert f"checkpoint saved in {workdir}/checkpoints; run the same command to resume" in output
    assert checkpoint_steps(workdir)[-1] == stopped

    # SIGKILL some steps after the next checkpoint: only the steps since that checkpoint are lost.
    process = start_train(run, workdir)
    next_checkpoint = (stopped // 5 + 1) * 5
    wait_for(lambda: next_checkpoint in checkpoint_steps(workdir) and last_logged_step(workdir) > next_checkpoint,
             process, f"checkpoint {next_checkpoint}")
    process.kill()
    output = process.communicate(timeout=60)[0]
    assert f"resumed from step {stopped} " in output
    killed_at = last_logged_step(workdir)
    saved = checkpoint_steps(workdir)
    assert killed_at < STEPS, "the run ended before the kill; the test needs it to die early"

    process = start_train(run, workdir)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output[-3000:]
    resumed_from = int(output.split("resumed from step ")[1].split()[0])
    assert resumed_from == saved[-1] >= next_checkpoint
    assert logged(workdir) == logged(run["unbroken"])  # every record, once, bit for bit
    assert checkpoint_steps(workdir) == checkpoint_steps(run["unbroken"]) == [30, 35, 40]


def test_muon_with_wsd_killed_resumes_bit_for_bit(tmp_path):
    muon = unbroken_run(tmp_path, **{"optimizer.name": "muon", "optimizer.decay": "wsd", "optimizer.cooldown_steps": 8})
    workdir = str(tmp_path / "killed")
    process = start_train(muon, workdir)
    wait_for(lambda: 10 in checkpoint_steps(workdir) and last_logged_step(workdir) > 10, process, "checkpoint 10")
    process.kill()
    process.communicate(timeout=60)
    assert last_logged_step(workdir) < STEPS, "the run ended before the kill; the test needs it to die early"
    process = start_train(muon, workdir)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0 and "resumed from step " in output, output[-3000:]
    assert logged(workdir) == logged(muon["unbroken"])  # every record, once, bit for bit
