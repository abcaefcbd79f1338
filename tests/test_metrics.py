"""metrics.Writer and truncate_after: metrics.jsonl records and TensorBoard events, across a resume."""

import os
import struct
import subprocess
import sys

from andrea_jax import event_files, metrics
from andrea_jax.event_files import masked_crc32c

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scalars(workdir):
    """(step, tag, value) of every scalar in the workdir's event files, file by file."""
    directory = os.path.join(workdir, metrics.TENSORBOARD_DIR)
    found = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            found += [(e.step, v.tag, v.simple_value) for _, e in event_files.records(f.read())
                      for v in e.summary.value]
    return found


def test_records_reach_jsonl_and_tensorboard(tmp_path):
    writer = metrics.Writer(str(tmp_path))
    writer.write(3, {"loss": 2.5, "finite": True, "note": "x"})
    writer.close()
    assert metrics.read(str(tmp_path)) == [{"step": 3, "loss": 2.5, "finite": True, "note": "x"}]
    assert scalars(str(tmp_path)) == [(3, "loss", 2.5)]  # booleans and strings stay out of TensorBoard


def test_a_resume_drops_the_earlier_runs_events_past_the_checkpoint(tmp_path):
    workdir = str(tmp_path)
    first = metrics.Writer(workdir)
    for step in (2, 4, 6, 8):  # the run logged 6 and 8, then died; its last checkpoint is step 5
        first.write(step, {"loss": float(step)})
    first.close()
    metrics.truncate_after(workdir, 5)
    resumed = metrics.Writer(workdir, start_step=5)  # within the same second: a second file all the same
    resumed.write(6, {"loss": 0.5})
    resumed.close()
    assert [r["step"] for r in metrics.read(workdir)] == [2, 4, 6]
    assert len(os.listdir(os.path.join(workdir, metrics.TENSORBOARD_DIR))) == 2
    assert sorted(scalars(workdir)) == [(2, "loss", 2.0), (4, "loss", 4.0), (6, "loss", 0.5)]


def test_a_restart_before_the_first_checkpoint_keeps_no_old_events(tmp_path):
    workdir = str(tmp_path)
    first = metrics.Writer(workdir)
    first.write(2, {"loss": 1.0})
    first.close()
    metrics.truncate_after(workdir, 0)
    assert scalars(workdir) == [] and metrics.read(workdir) == []


def test_a_record_cut_short_by_a_kill_is_dropped_and_the_whole_ones_kept(tmp_path):
    workdir = str(tmp_path)
    writer = metrics.Writer(workdir)
    writer.write(1, {"loss": 1.0})
    writer.close()
    directory = os.path.join(workdir, metrics.TENSORBOARD_DIR)
    (name,) = os.listdir(directory)
    with open(os.path.join(directory, name), "rb") as f:
        whole = f.read()
    length = struct.pack("<Q", 50)
    cut_short = [
        length + struct.pack("<I", masked_crc32c(length)) + bytes(20),  # a valid header, 20 of 50 bytes
        length + struct.pack("<I", masked_crc32c(length)),  # the header alone
        whole[-30:-5],  # bytes that are no record's start (the length's checksum fails)
    ]
    for tail in cut_short:
        with open(os.path.join(directory, name), "ab") as f:
            f.write(tail)
        event_files.drop_after(directory, 10)  # no whole event was past step 10: the tail alone goes
        with open(os.path.join(directory, name), "rb") as f:
            assert f.read() == whole
    open(os.path.join(directory, ".rewrite.12345"), "wb").close()  # left by a killed rewrite
    event_files.drop_after(directory, 10)
    assert os.listdir(directory) == [name]
    assert scalars(workdir) == [(1, "loss", 1.0)]


def test_importing_the_writer_leaves_torch_unimported_and_importable():
    """tensorboardX would import torch (seconds of every train.py start); it is imported with torch hidden."""
    check = ("import importlib.util, sys\n"
             "from andrea_jax import metrics\n"
             "assert 'torch' not in sys.modules, 'torch was imported'\n"
             "if importlib.util.find_spec('torch') is not None:\n"
             "    import torch\n"
             "    assert torch.zeros(2).sum().item() == 0\n"
             "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr[-2000:]
