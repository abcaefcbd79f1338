"""metrics.Writer: metrics.jsonl records, TensorBoard scalars, and the purge marker of a resumed run."""

import json
import os
import struct

from tensorboardX.proto import event_pb2

from andrea_jax import metrics


def read_events(workdir):
    """Every Event of every TensorBoard file in the workdir (the TFRecord framing, read by hand)."""
    directory = os.path.join(workdir, "tensorboard")
    events = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[offset + 12:offset + 12 + length])  # past length and its CRC
            events.append((name, event))
            offset += 12 + length + 4  # the record and its CRC
    return events


def session_starts(events):
    return [e.step for _, e in events if e.HasField("session_log") and e.session_log.status == event_pb2.SessionLog.START]


def test_records_reach_jsonl_and_tensorboard(tmp_path):
    writer = metrics.Writer(str(tmp_path))
    writer.write(3, {"loss": 2.5, "finite": True, "note": "x"})
    writer.close()
    assert metrics.read(str(tmp_path)) == [{"step": 3, "loss": 2.5, "finite": True, "note": "x"}]
    scalars = [(e.step, v.tag, v.simple_value) for _, e in read_events(str(tmp_path)) for v in e.summary.value]
    assert scalars == [(3, "loss", 2.5)]  # booleans and strings stay out of TensorBoard
    assert session_starts(read_events(str(tmp_path))) == []  # a fresh run purges nothing


def test_a_resumed_run_marks_where_tensorboard_drops_the_older_events(tmp_path):
    workdir = str(tmp_path)
    first = metrics.Writer(workdir)
    for step in (2, 4, 6, 8):  # the run logged 6 and 8, then died; its last checkpoint is step 5
        first.write(step, {"loss": float(step)})
    first.close()
    metrics.truncate_after(workdir, 5)
    resumed = metrics.Writer(workdir, start_step=5)
    resumed.write(6, {"loss": 0.5})
    resumed.close()
    assert [r["step"] for r in metrics.read(workdir)] == [2, 4, 6]
    events = read_events(workdir)
    files = sorted({name for name, _ in events})
    assert len(files) == 2
    # TensorBoard drops the older files' events at steps >= 6 when it reads this marker.
    assert [(name, step) for name, step in ((n, e.step) for n, e in events if e.HasField("session_log")
                                              and e.session_log.status == event_pb2.SessionLog.START)] == [
        (files[1], 6)]
    assert json.dumps(session_starts(events)) == "[6]"
