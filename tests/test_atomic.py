"""Writes that a kill or a full disk cannot half-do: each writer on a real, full file system.

The full disks are small tmpfs mounts made in a user namespace (`unshare -rm`), so no test needs
root; where the kernel does not allow that, the tests that need one skip.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from andrea_jax import metrics
from andrea_jax.runtime import atomic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


needs_small_disk = pytest.mark.skipif(not _can_mount_tmpfs(), reason="cannot mount a small tmpfs "
                                      "(unshare -rm: user namespaces not allowed here)")


def on_small_disk(tmp_path, size: str, script: str, timeout=300) -> dict:
    """Runs `script` (Python) with MOUNT, a fresh tmpfs of `size`, mounted; returns the dict it prints last."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(f"import json, os, subprocess, sys\nMOUNT = {str(mount)!r}\n"
                      f"subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size={size}', 'tmpfs', MOUNT], check=True)\n"
                      + FILL + textwrap.dedent(script))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=ROOT)
    result = subprocess.run(["unshare", "-rm", sys.executable, str(driver)], capture_output=True, text=True,
                            timeout=timeout, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


FILL = """
def fill(leave_bytes):
    free = os.statvfs(MOUNT).f_bavail * os.statvfs(MOUNT).f_frsize
    with open(os.path.join(MOUNT, "filler"), "wb") as f:
        f.write(b"x" * max(free - leave_bytes, 0))
"""


@needs_small_disk
def test_a_checkpoint_the_disk_cannot_hold_stops_in_one_line_and_the_last_one_resumes(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"f{i}.txt").write_text(" ".join(f"word{j % 37} value{j % 11}" for j in range(i, 900 + i)))
    result = on_small_disk(tmp_path, "16m", f"""
        train = [sys.executable, "train.py", "--config", "configs/tiny.py", "--workdir", MOUNT + "/run",
                 "--config.data.source=text:{corpus}", "--config.data.tokenizer=byte",
                 "--config.data.cache_dir={tmp_path / 'cache'}", "--config.model.vocab_size=0",
                 "--config.model.n_layer=1", "--config.model.d_model=64", "--config.model.mlp_dim=128",
                 "--config.model.max_len=16", "--config.seq_len=16", "--config.batch_size=4",
                 "--config.model.dtype=float32", "--config.eval_every=2", "--config.eval_batches=1",
                 "--config.checkpoint_every=2", "--config.log_every=1"]
        subprocess.run(train + ["--config.steps=2"], check=True, capture_output=True)
        fill(leave_bytes=200_000)  # less than one checkpoint
        full = subprocess.run(train + ["--config.steps=4"], capture_output=True, text=True)
        after_full = sorted(os.listdir(MOUNT + "/run/checkpoints"))
        os.remove(os.path.join(MOUNT, "filler"))
        resumed = subprocess.run(train + ["--config.steps=4"], capture_output=True, text=True)
        records = [json.loads(line) for line in open(MOUNT + "/run/metrics.jsonl")]
        steps = [record["step"] for record in records if "loss" in record]
        print(json.dumps(dict(code=full.returncode, stderr=full.stderr, after_full=after_full,
                              resumed_code=resumed.returncode, resumed_out=resumed.stdout, steps=steps,
                              after_resume=sorted(os.listdir(MOUNT + "/run/checkpoints")))))
    """)
    assert result["code"] == 2
    errors = [line for line in result["stderr"].splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1, result["stderr"][-3000:]
    assert "error: the disk is full: writing " + str(tmp_path / "mnt/run/checkpoints/4") in errors[0]
    assert "MiB free there" in errors[0] and "run the same command again" in errors[0]
    assert result["after_full"] == ["2"]  # nothing half-written beside the last good step
    assert result["resumed_code"] == 0 and "resumed from step 2" in result["resumed_out"]
    assert result["after_resume"] == ["2", "4"]
    assert result["steps"] == [1, 2, 3, 4]  # the records past step 2 of the failed run were replaced


@needs_small_disk
def test_the_token_cache_and_the_tokenizer_on_a_full_disk(tmp_path):
    result = on_small_disk(tmp_path, "64k", """
        from andrea_jax.runtime import atomic
        from andrea_jax.data import token_cache
        from andrea_jax.data.sources import ListDocuments
        from andrea_jax.data.tokenizer import ByteTokenizer, CharTokenizer
        outcome = {}
        cache = os.path.join(MOUNT, "cache")
        try:
            token_cache.load_or_build(cache, "train", ListDocuments(["a few words " * 4000]), ByteTokenizer(),
                                      "train")
        except atomic.DiskFull as error:
            outcome["cache_error"] = str(error)
        outcome["cache_left"] = os.listdir(cache)
        path = os.path.join(MOUNT, "tokenizer.json")
        CharTokenizer(list("abc")).save(path)
        before = open(path).read()
        fill(leave_bytes=0)
        try:
            CharTokenizer([chr(c) for c in range(0x400, 0x4ff)]).save(path)
        except atomic.DiskFull as error:
            outcome["tokenizer_error"] = str(error)
        outcome["tokenizer_kept"] = open(path).read() == before
        outcome["mount_left"] = sorted(os.listdir(MOUNT))
        print(json.dumps(outcome))
    """)
    assert result["cache_error"].startswith(f"the disk is full: writing {tmp_path}/mnt/cache/train.bin (")
    assert result["cache_left"] == ["train.lock"]  # no partial token file that could pass for a cache
    assert result["tokenizer_error"].startswith(f"the disk is full: writing {tmp_path}/mnt/tokenizer.json (0.0 MiB")
    assert result["tokenizer_kept"]
    assert result["mount_left"] == ["cache", "filler", "tokenizer.json"]  # no temporary file left


def test_a_full_disk_under_the_metrics_is_one_error_naming_the_file(tmp_path):
    writer = metrics.Writer(str(tmp_path), start_step=0)
    writer.write(1, {"loss": 2.5})
    writer._jsonl.close()
    writer._jsonl = open("/dev/full", "a")  # every write: ENOSPC
    with pytest.raises(atomic.DiskFull, match=f"writing {tmp_path}/metrics.jsonl \\("):
        writer.write(2, {"loss": 2.25})
    writer._jsonl = open(os.devnull, "a")
    writer.close()
    assert metrics.read(str(tmp_path)) == [{"step": 1, "loss": 2.5}]


def test_a_record_cut_short_is_dropped_on_resume(tmp_path):
    path = tmp_path / metrics.METRICS_FILE
    path.write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n" + '{"step": 2, "lo')
    assert metrics.read(str(tmp_path)) == [{"step": 1, "loss": 3.0}]
    metrics.truncate_after(str(tmp_path), 5)
    assert path.read_text() == json.dumps({"step": 1, "loss": 3.0}) + "\n"


def test_orbax_reports_of_a_full_disk_are_recognised(tmp_path):
    orbax_message = ('RESOURCE_EXHAUSTED: Error writing "params.block_0/0" in OCDBT database at local file '
                     f'"{tmp_path}/ckpt/8.orbax-checkpoint-tmp/": Failed writing: "{tmp_path}/ckpt/8.orbax-'
                     f'checkpoint-tmp/d/0a1b": Failed to write 28972 bytes to file 22: No space left on device '
                     "[os_error_code='28']")
    wrapped = RuntimeError("the checkpoint save failed")
    wrapped.__cause__ = ValueError(orbax_message)
    found = atomic.as_disk_full(wrapped)
    assert str(found).startswith(f"the disk is full: writing {tmp_path}/ckpt/8.orbax-checkpoint-tmp/d/0a1b (")
    assert atomic.as_disk_full(ValueError("RESOURCE_EXHAUSTED: out of memory allocating 8 GiB")) is None


def test_a_write_reaches_the_disk_before_the_rename_and_the_rename_after(tmp_path, monkeypatch):
    # Without the first fsync a crash can leave an empty file under the new name.
    path, synced, fsync = tmp_path / "record.json", [], os.fsync

    def recording_fsync(fd):  # which file, and whether the rename had happened
        synced.append((os.fstat(fd).st_ino, os.path.exists(path)))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    atomic.write(path, "{}")
    assert synced == [(os.stat(path).st_ino, False), (os.stat(tmp_path).st_ino, True)]
