"""A workdir on Cloud Storage (`gs://`), against a real GCS emulator the tests start (tests/gcs_emulator.py):
kill -9 and resume with an unbroken local run's losses, a second run refused by the lease, eval.py and the
plots on the bucket, the bucket failing mid-run, the start-up faults in one line, 2 processes each with
its own local cache like 1."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from andrea_jax import metrics
from andrea_jax.runtime import storage
from tests.gcs_emulator import Emulator
from tests.test_data_eras import DOCS
from tests.test_hf_stream import write_jsonl
from tests.test_multihost import free_port, train_args
from tests.test_resume import COMPARED, start_train, unbroken_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "bkt"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    """The emulator with a bucket, the unbroken local run (40 steps, checkpoints every 5), and the env that
    reaches the emulator."""
    root = tmp_path_factory.mktemp("cloud")
    emulator = Emulator(str(root / "objects"))
    emulator.make_bucket(BUCKET)
    run = unbroken_run(root)
    run["env"] = {key: value for key, value in run["env"].items() if key != "GOOGLE_APPLICATION_CREDENTIALS"}
    run["env"].update(emulator.env)
    yield emulator, run
    emulator.stop()


def logged(emulator, prefix):
    """metrics.jsonl of gs://bkt/<prefix> without the timing keys."""
    lines = emulator.read(BUCKET, f"{prefix}/metrics.jsonl").decode().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k == "step" or k in COMPARED} for line in lines]


def steps_saved(emulator, prefix):
    return sorted(int(name.split("/")[2]) for name in emulator.objects(BUCKET, f"{prefix}/checkpoints/")
                  if name.endswith("/commit_success.txt") and name.count("/") == 3)


def wait_until(condition, process, what, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"train.py exited ({process.returncode}) before {what}:\n{process.stdout.read()[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


_HOLD = """
import sys, time
from andrea_jax.runtime import storage
storage.Lease(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_refused_killed_and_resumed_on_a_bucket_as_on_a_local_disk(cloud):
    emulator, run = cloud
    workdir = f"gs://{BUCKET}/killed"
    # A run holding the workdir's lease (kept alive for the test: a tiny run ends in seconds).
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, workdir], env=run["env"], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE)
    assert holder.stdout.readline() == "held\n"
    second = subprocess.run([sys.executable, "train.py", "--config", str(run["config_file"]), "--workdir", workdir],
                            capture_output=True, text=True, env=run["env"], cwd=ROOT, timeout=300)
    assert second.returncode == 2, second.stderr[-2000:]
    error = second.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: --workdir {workdir} is in use by a training run (pid {holder.pid} on ")
    assert f"lock ends {storage.LEASE_S} s after" in error
    assert emulator.objects(BUCKET, "killed/") == ["killed/run.lock"]  # the refused run wrote and removed nothing

    # kill -9: the lease stays on the bucket, and the next start on this host sees that its holder is gone.
    holder.kill()
    holder.wait()
    first = start_train(run, workdir)
    wait_until(lambda: 10 in steps_saved(emulator, "killed"), first, "checkpoint 10")
    first.kill()
    first.communicate(timeout=60)
    assert emulator.objects(BUCKET, "killed/run.lock") == ["killed/run.lock"]
    assert 40 not in steps_saved(emulator, "killed"), "the run ended before the kill; the test needs it to die early"
    resumed = start_train(run, workdir)
    output = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, output[-3000:]
    resumed_from = int(output.split("resumed from step ")[1].split()[0])
    assert resumed_from >= 10 and f"of {workdir}/checkpoints" in output
    assert logged(emulator, "killed") == [
        {k: v for k, v in r.items() if k == "step" or k in COMPARED} for r in metrics.read(run["unbroken"])]
    assert steps_saved(emulator, "killed") == [30, 35, 40]
    assert emulator.objects(BUCKET, "killed/run.lock") == []  # released at the end

    # eval.py reads the run from the bucket and writes its report there; the plots too.
    evaluated = subprocess.run([sys.executable, "eval.py", "--workdir", workdir, "--plot"], capture_output=True,
                               text=True, env=run["env"], cwd=ROOT, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert f"wrote {workdir}/eval_step40.json" in evaluated.stdout
    assert f"wrote {workdir}/metrics.png" in evaluated.stdout
    report = json.loads(emulator.read(BUCKET, "killed/eval_step40.json"))
    assert report["step"] == 40 and report["loss"] == pytest.approx(logged(emulator, "killed")[-1]["val_loss"],
                                                                     rel=1e-5)
    assert emulator.read(BUCKET, "killed/metrics.png").startswith(b"\x89PNG")


def test_the_bucket_failing_mid_run_costs_nothing(cloud):
    """The emulator stopped for seconds while the run trains and saves: training goes on and the writes are retried.
    A write the outage cut in the middle (the emulator, unlike Cloud Storage, forgets an upload begun before it
    stopped) ends the run in one line naming the newest checkpoint kept; either way the run ends, resumed if it
    stopped, with every checkpoint and the unbroken run's losses."""
    emulator, run = cloud
    process = start_train(run, f"gs://{BUCKET}/outage")
    wait_until(lambda: 5 in steps_saved(emulator, "outage"), process, "checkpoint 5")
    emulator.stop()
    assert process.poll() is None, "the run ended before the outage; the test needs it to train through one"
    time.sleep(4)
    emulator.start()
    output = process.communicate(timeout=600)[0]
    if process.returncode == 2:
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(
            f"error: a checkpoint could not be written to gs://{BUCKET}/outage/checkpoints ("), output[-3000:]
        assert "the newest one kept is step " in errors[0]
        process = start_train(run, f"gs://{BUCKET}/outage")
        output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output[-3000:]
    assert steps_saved(emulator, "outage") == [30, 35, 40]
    assert logged(emulator, "outage") == [
        {k: v for k, v in r.items() if k == "step" or k in COMPARED} for r in metrics.read(run["unbroken"])]


@pytest.mark.parametrize("fault", ["missing bucket", "unreachable", "no credentials"])
def test_a_bucket_that_cannot_be_used_stops_the_start_in_seconds_with_one_line(cloud, tmp_path, fault):
    emulator, run = cloud
    env, workdir = dict(run["env"]), f"gs://{BUCKET}/faults"
    if fault == "missing bucket":
        workdir, expected = "gs://no-such-bucket/run", "the bucket gs://no-such-bucket does not exist"
    elif fault == "unreachable":
        env.update(STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{free_port()}")
        expected = f"{workdir} cannot be reached"
    else:  # no emulator, no credential file, no gcloud configuration, no metadata server
        env = {key: value for key, value in env.items() if key not in ("STORAGE_EMULATOR_HOST",)}
        env.update(HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"))
        expected = "no Google Cloud credentials for"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "train.py", "--config", str(run["config_file"]), "--workdir", workdir],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == \
        [result.stderr.strip().splitlines()[-1]]
    assert expected in result.stderr.splitlines()[-1]
    if fault == "no credentials":
        assert "gcloud auth application-default login" in result.stderr and "auth.authenticate_user()" in result.stderr
    assert took < 60, f"{fault}: {took:.0f} s"
    assert emulator.objects(BUCKET, "faults/") == []


def test_permission_denied_names_the_role_to_grant():
    from google.api_core import exceptions

    with pytest.raises(storage.StorageError, match=r"^permission denied on gs://b/run \(Forbidden: 403 .*\); give "
                                                   r"the account roles/storage.objectAdmin on gs://b"):
        with storage._explained("gs://b/run"):
            raise exceptions.Forbidden("no storage.objects.create")


def test_a_lease_not_renewed_is_taken_over_and_its_holder_stops(cloud, monkeypatch):
    emulator, _ = cloud
    for key, value in emulator.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(storage, "LEASE_S", 1)
    workdir = f"gs://{BUCKET}/lease"
    holder = storage.Lease(workdir).acquire()
    holder._stopped.set()  # a run that can no longer renew (a lost network), not one that ended
    monkeypatch.setattr(storage.socket, "gethostname", lambda: "another-host")  # its pid tells nothing here
    with pytest.raises(storage.StorageError, match="is in use by a training run"):
        storage.Lease(workdir).acquire()
    time.sleep(2.5)
    taker = storage.Lease(workdir).acquire()
    holder._stopped.clear()
    holder._renew_once()
    with pytest.raises(storage.StorageError, match=r"was taken over by another run \(pid \d+ on another-host"):
        holder.check()
    taker.release()
    assert emulator.objects(BUCKET, "lease/") == []


def test_two_processes_with_their_own_caches_log_what_one_logs(cloud, tmp_path):
    """No disk shared: each process of a gs:// run prepares the data in its own data.cache_dir (its own HOME)."""
    emulator, run = cloud
    # A stream read in eras: each process runs an era encoder of its own.
    stream = write_jsonl(tmp_path / "stream" / "train.jsonl", DOCS[:1200])
    args = [arg for arg in train_args(tmp_path, "WORKDIR") if not arg.startswith(("--config.data.cache_dir",
                                                                                   "--config.data.source"))]
    args += [f"--config.data.source=hf:{stream}", "--config.data.era_windows=24",
             "--config.data.stream_val_documents=40"]
    env = lambda rank, devices: dict(run["env"], HOME=str(tmp_path / f"home{rank}"), XLA_FLAGS="",
                                     JAX_NUM_CPU_DEVICES=str(devices), JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    with_workdir = lambda workdir: [workdir if arg == "WORKDIR" else arg for arg in args]
    one = subprocess.run([sys.executable, *with_workdir(str(tmp_path / "one"))], cwd=ROOT, env=env(0, 4),
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *with_workdir(f"gs://{BUCKET}/two"),
                               f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={rank}",
                               "--distributed_timeout=30"], cwd=ROOT, env=env(rank, 2), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    # Each encoded the eras itself, in its own cache, to the same tokens (passed ones are deleted: the last).
    last_eras = [glob.glob(str(tmp_path / f"home{rank}" / ".cache" / "andrea_jax" / "tokens" / "*" / "train.era*.bin"))
                 for rank in range(2)]
    assert all(last_eras) and {os.path.basename(max(found)) for found in last_eras} == {"train.era00013.bin"}
    with open(max(last_eras[0]), "rb") as zero, open(max(last_eras[1]), "rb") as one:
        assert zero.read() == one.read()
    expected = [(r["step"], r["loss"]) for r in metrics.read(str(tmp_path / "one")) if "loss" in r]
    got = [(r["step"], r["loss"]) for r in map(json.loads, emulator.read(BUCKET, "two/metrics.jsonl").splitlines())
           if "loss" in r]
    assert [step for step, _ in got] == [step for step, _ in expected] == list(range(2, 41, 2))
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in expected], rel=2e-6)


def test_a_checkpoint_the_storage_cannot_take_is_one_line_naming_the_newest_kept(tmp_path, monkeypatch):
    """What Orbax raises once its writes' retries are spent (a bucket down for longer) reaches the user as one line."""
    from andrea_jax import checkpoint

    ckpt = checkpoint.Checkpointer(str(tmp_path))

    def retries_spent():
        raise ValueError('ABORTED: Error writing "w0/0" in OCDBT database at gs://bkt/run/checkpoints/10/params/: '
                         "All 32 retry attempts failed\nmore lines")

    monkeypatch.setattr(ckpt._manager, "wait_until_finished", retries_spent)
    monkeypatch.setattr(ckpt._manager, "all_steps", lambda: [5, 10])
    with pytest.raises(checkpoint.CheckpointError, match=r"^a checkpoint could not be written to .*/checkpoints "
                                                         r"\(ValueError: ABORTED: Error writing .*\); the newest one "
                                                         r"kept is step 10: run the same command to resume from it "
                                                         r"once the storage answers$"):
        ckpt.wait()
