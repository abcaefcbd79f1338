"""Several processes on one machine: JAX's distributed runtime over gloo, 2 processes × 2 CPU devices.

Against 1 process × 4 devices: the same losses; a killed process stops the other
within the stated timeout; the run resumes from its checkpoint and continues
exactly; eval.py on 2 processes reports the single-process figures.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.test_train_loop import write_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 10  # --distributed_timeout: how long a silent peer is waited for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(devices_per_process: int) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", JAX_NUM_CPU_DEVICES=str(devices_per_process),
                JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")


def train_args(tmp_path, workdir):
    corpus = write_corpus(str(tmp_path / "corpus"))
    return ["train.py", "--config", "configs/tiny.py", "--workdir", str(workdir),
            "--config.model.n_layer=2", "--config.model.d_model=64", "--config.model.n_head=4",
            "--config.model.mlp_dim=256", "--config.model.max_len=32", "--config.model.vocab_size=0",
            "--config.model.dtype=float32",
            "--config.seq_len=32", "--config.batch_size=8", "--config.steps=40", "--config.log_every=2",
            "--config.eval_every=20", "--config.eval_batches=2", "--config.checkpoint_every=4",
            "--config.optimizer.warmup_steps=2", "--config.peak_flops=1e11",
            f"--config.data.source=text:{corpus}", "--config.data.tokenizer=byte", "--config.data.val_fraction=0.2",
            f"--config.data.cache_dir={tmp_path / 'cache'}"]


def launch(args, processes: int, devices_per_process: int, log_prefix):
    """Starts `processes` copies of a script joined into one run; returns the Popen objects."""
    port = free_port()
    distributed = lambda rank: ([f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={processes}",
                                 f"--process_id={rank}", f"--distributed_timeout={TIMEOUT_S}"]
                                if processes > 1 else [])
    return [subprocess.Popen([sys.executable, *args, *distributed(rank)], cwd=ROOT, env=env(devices_per_process),
                             stdout=open(f"{log_prefix}{rank}.log", "w"), stderr=subprocess.STDOUT)
            for rank in range(processes)]


def wait_all(procs, timeout=400):
    """The exit codes; past the timeout all of them are killed (one hung in a collective ignores SIGTERM)."""
    deadline = time.time() + timeout
    try:
        return [p.wait(timeout=max(1, deadline - time.time())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def records(workdir, key):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [(r["step"], r[key]) for r in map(json.loads, f) if key in r]


def log_tail(path, lines=15):
    with open(path) as f:
        return "".join(f.readlines()[-lines:])


def test_two_processes_train_resume_and_evaluate_like_one(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    # 1 process × 4 devices: the reference.
    assert wait_all(launch(train_args(tmp_path, single), 1, 4, str(tmp_path / "single"))) == [0], \
        log_tail(tmp_path / "single0.log")

    # 2 processes × 2 devices, one killed once a checkpoint exists.
    procs = launch(train_args(tmp_path, multi), 2, 2, str(tmp_path / "multi"))
    checkpoint_4 = multi / "checkpoints" / "4"
    deadline = time.time() + 400
    while not checkpoint_4.is_dir() and time.time() < deadline and procs[0].poll() is None:
        time.sleep(0.2)
    assert checkpoint_4.is_dir(), log_tail(tmp_path / "multi0.log")
    # 36 steps, 9 checkpoints and 2 evaluations remain: far longer than this poll's 0.2 s.
    assert procs[1].poll() is None, "process 1 ended before it could be killed"
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    code = procs[0].wait(timeout=TIMEOUT_S * 6)
    stopped_after = time.time() - killed_at
    assert code != 0, "the surviving process should fail, not finish alone"
    assert stopped_after < TIMEOUT_S * 6
    assert not (multi / "checkpoints" / "40").exists()

    # Resume on 2 processes: the run continues exactly.
    assert wait_all(launch(train_args(tmp_path, multi), 2, 2, str(tmp_path / "resumed"))) == [0, 0], \
        log_tail(tmp_path / "resumed0.log")
    single_losses, multi_losses = records(single, "loss"), records(multi, "loss")
    assert [s for s, _ in multi_losses] == [s for s, _ in single_losses] == list(range(2, 41, 2))
    for (_, a), (_, b) in zip(single_losses, multi_losses):
        assert b == pytest.approx(a, rel=2e-6)
    assert [v for _, v in records(multi, "val_loss")] == pytest.approx([v for _, v in records(single, "val_loss")],
                                                                      rel=2e-6)

    # eval.py on 2 processes reports what one process reports.
    eval_args = ["eval.py", "--workdir", str(multi), "--batches", "0", "--prompt", "def ", "--max_new_tokens", "8",
                 "--temperature", "0"]
    assert wait_all(launch(eval_args, 1, 4, str(tmp_path / "eval_single"))) == [0]
    with open(multi / "eval_step40.json") as f:
        one = json.load(f)
    os.remove(multi / "eval_step40.json")
    assert wait_all(launch(eval_args, 2, 2, str(tmp_path / "eval_multi"))) == [0, 0], \
        log_tail(tmp_path / "eval_multi0.log")
    with open(multi / "eval_step40.json") as f:
        two = json.load(f)
    assert two["loss"] == pytest.approx(one["loss"], rel=2e-6)
    assert two["bits_per_byte"] == pytest.approx(one["bits_per_byte"], rel=2e-6)
    assert "data=4" in two["mesh"] and two["tokens"] == one["tokens"]
    sample = lambda name: log_tail(tmp_path / name, 2)
    assert sample("eval_multi0.log") == sample("eval_single0.log")


def test_a_coordinator_that_never_answers_fails_within_the_timeout(tmp_path):
    port = free_port()  # nobody listens here
    start = time.time()
    result = subprocess.run([sys.executable, *train_args(tmp_path, tmp_path / "w"),
                             f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", "--process_id=1",
                             "--distributed_timeout=5"], cwd=ROOT, env=env(2), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert time.time() - start < 60
    assert "error: could not join the distributed run at 127.0.0.1" in result.stderr


def test_a_process_id_out_of_range_is_refused(tmp_path):
    result = subprocess.run([sys.executable, *train_args(tmp_path, tmp_path / "w"),
                             "--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=2"],
                            cwd=ROOT, env=env(2), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "error: --process_id=2 must be in [0, 2)" in result.stderr


def test_a_data_error_on_the_leader_stops_every_process_with_one_line(tmp_path):
    """Only process 0 reads the source; the other learns of its failure at once, not at the timeout."""
    args = train_args(tmp_path, tmp_path / "run")
    args = [a if not a.startswith("--config.data.source=") else f"--config.data.source=text:{tmp_path / 'nope.txt'}"
            for a in args]
    started = time.time()
    codes = wait_all(launch(args, 2, 2, str(tmp_path / "bad")), timeout=120)
    assert codes == [2, 2], log_tail(tmp_path / "bad0.log") + log_tail(tmp_path / "bad1.log")
    assert "nope.txt" in log_tail(tmp_path / "bad0.log", 1)
    follower = log_tail(tmp_path / "bad1.log", 3)
    assert follower.strip().splitlines()[-1].endswith(
        "process 0 failed to prepare the data; its output has the error: fix that and rerun")
    assert "Traceback" not in follower
    assert time.time() - started < 60


def test_sigterm_to_one_process_stops_all_at_the_next_step_and_resumes(tmp_path):
    """A SIGTERM to process 1: both agree before the next step, save the last, exit 0; the run then finishes."""
    workdir = tmp_path / "run"
    args = train_args(tmp_path, workdir) + ["--config.log_every=20", "--config.steps=60"]
    procs = launch(args, 2, 2, str(tmp_path / "term"))
    deadline = time.time() + 400
    while not (workdir / "checkpoints" / "4").is_dir() and time.time() < deadline and procs[0].poll() is None:
        time.sleep(0.05)
    assert (workdir / "checkpoints" / "4").is_dir(), log_tail(tmp_path / "term0.log")
    procs[1].send_signal(signal.SIGTERM)
    assert wait_all(procs, timeout=120) == [0, 0], log_tail(tmp_path / "term0.log") + log_tail(tmp_path / "term1.log")
    last = log_tail(tmp_path / "term0.log", 1)
    assert "on a signal to another process; checkpoint saved" in last, last
    stopped = int(last.split("stopped at step ")[1].split()[0])
    assert 4 <= stopped < 60, stopped
    assert (workdir / "checkpoints" / str(stopped)).is_dir()
    assert wait_all(launch(args, 2, 2, str(tmp_path / "after"))) == [0, 0], log_tail(tmp_path / "after0.log")
    assert f"resumed from step {stopped} " in open(tmp_path / "after0.log").read()
    assert [s for s, _ in records(workdir, "loss")] == [20, 40, 60]


def test_a_sigterm_before_the_loop_ends_the_process_instead_of_being_swallowed(tmp_path):
    workdir = tmp_path / "run"
    procs = launch(train_args(tmp_path, workdir), 2, 2, str(tmp_path / "early"))
    deadline = time.time() + 120
    while not (workdir / "config.json").exists() and time.time() < deadline and procs[0].poll() is None:
        time.sleep(0.01)  # config.json: both processes have joined; neither is training yet
    assert (workdir / "config.json").exists(), log_tail(tmp_path / "early0.log")
    procs[1].send_signal(signal.SIGTERM)
    assert procs[1].wait(timeout=30) == 2  # at once, in one line: nothing trained yet
    assert procs[0].wait(timeout=TIMEOUT_S * 6) != 0  # its peer is gone: it stops at the heartbeat timeout
    assert not (workdir / "checkpoints" / "40").exists()


@pytest.mark.parametrize("signals, to", [(["SIGTERM"], 1), (["SIGINT", "SIGINT"], 0)])
def test_a_stop_while_both_processes_wait_for_an_era_stops_both_in_seconds(tmp_path, signals, to):
    """The encoder stalls once era 0 is built, so step 4 waits for era 1 on both processes. A stop sent to one
    process reaches the other inside its wait (the runtime's key-value store): both save step 3 and exit 0, each
    in its own words, with no traceback. With several processes a second Ctrl-C is only a note: a process gone
    at once would leave the other waiting in its next collective."""
    from tests.test_data_eras import stream_run

    run = stream_run(tmp_path)
    workdir, cache = tmp_path / "run", tmp_path / "cache"
    args = ["train.py", "--config", str(run["config_file"]), "--workdir", str(workdir),
            f"--config.data.cache_dir={cache}"]
    stalled = dict(run["env"], **{key: value for key, value in env(1).items() if key.startswith(("JAX_", "XLA_"))},
                   ANDREA_TEST_STALL_AFTER=str(cache / "tokens" / "*" / "train.era00000.json"))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *args, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                               f"--process_id={rank}", f"--distributed_timeout={TIMEOUT_S}"], cwd=ROOT, env=stalled,
                              stdout=open(tmp_path / f"wait{rank}.log", "w"), stderr=subprocess.STDOUT)
             for rank in range(2)]
    try:
        deadline = time.time() + 300
        while "step 4 waits for era 1" not in open(tmp_path / "wait0.log").read() and time.time() < deadline:
            assert procs[0].poll() is None, log_tail(tmp_path / "wait0.log")
            time.sleep(0.1)
        time.sleep(2)
        for name in signals:
            procs[to].send_signal(getattr(signal, name))
            time.sleep(0.3)
        codes = wait_all(procs, timeout=60)
    finally:
        for process in procs:
            process.kill()
    logs = [open(tmp_path / f"wait{rank}.log").read() for rank in range(2)]
    assert codes == [0, 0] and not any("Traceback" in log for log in logs), "".join(log[-3000:] for log in logs)
    reason = "a signal to another process" if to else signals[0]
    assert f"stopped at step 3 on {reason}" in log_tail(tmp_path / "wait0.log", 1)
    assert (workdir / "checkpoints" / "3").is_dir()
