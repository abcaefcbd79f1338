"""Checkpoint cost: Orbax async save of the train state, and how long the loop stalls for it.

    python bench/bench_checkpoint.py [--only mid,a120_f32] [--saves 3] [--emulator]

--emulator saves to a bucket (gs://bench) on a Cloud Storage emulator started on loopback
(tests/gcs_emulator.py, requirements-test.txt), for the cost of a gs:// workdir's checkpoints.

The state comes from the project's jitted step (as bench_step.py builds it) and
is saved through andrea_jax.checkpoint.Checkpointer, as the training loop saves
it: metrics drained, `save()` (the loop blocks only for this call), then steps
go on while Orbax writes. Measured per save:
- blocking: the `save()` call;
- write: from the call until Orbax reports the save finished;
- stall: blocking + the extra time of the steps that ran during the write
  (their time less as many baseline steps); what the loop loses to the save.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from andrea_jax import checkpoint  # noqa: E402
from bench import harness  # noqa: E402


def state_bytes(state) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state))


def bench_case(name: str, saves: int, directory: str) -> dict:
    config = harness.make_case(name)
    step = harness.JaxStep(config)
    step.compile()
    baseline = statistics.median(step.run(1) for _ in range(3))
    ckpt = checkpoint.Checkpointer(os.path.join(directory, name), keep=2)
    manager = ckpt._manager  # is_saving_in_progress: when the background write ends
    blocking, write, stall, steps_during = [], [], [], []
    try:
        for index in range(saves):
            jax.block_until_ready(step.state)  # the loop drains metrics before it saves
            # A real copy of what is saved: the steps after it donate (reuse) these buffers.
            saved_params = jax.tree.map(lambda x: np.array(x, copy=True), step.state["params"])
            started = time.perf_counter()
            ckpt.save(index + 1, step.state, {"data_step": index + 1})
            returned = time.perf_counter()
            ran, ran_s = 0, 0.0
            while manager.is_saving_in_progress():
                ran_s += step.run(1)
                ran += 1
                if ran >= 50:
                    break
            ckpt.wait()
            finished = time.perf_counter()
            blocking.append(returned - started)
            write.append(finished - started)
            steps_during.append(ran)
            # Steps that overlapped the write: their cost above baseline is stall too.
            stall.append(returned - started + max(0.0, ran_s - ran * baseline)
                         + max(0.0, finished - returned - ran_s))
        # The last save must hold the state of its step, though later steps reused the buffers.
        abstract = checkpoint.abstract_like({k: step.state[k] for k in ("params", "opt_state")},
                                            jax.tree.map(lambda x: x.sharding,
                                                         {k: step.state[k] for k in ("params", "opt_state")}))
        restore_started = time.perf_counter()
        restored, _ = ckpt.restore(abstract, step=saves)
        jax.block_until_ready(restored)
        restore_s = time.perf_counter() - restore_started
        exact = all(np.array_equal(a, np.asarray(b)) for a, b in
                    zip(jax.tree.leaves(saved_params), jax.tree.leaves(restored["params"])))
    finally:
        ckpt.close()
        step.close()
    return dict(case=name, exact=exact, mb=state_bytes(step.state) / 1e6, baseline_s=baseline,
                blocking_s=statistics.median(blocking), write_s=statistics.median(write),
                stall_s=statistics.median(stall), steps_during=statistics.median(steps_during),
                first_write_s=write[0], restore_s=restore_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="mid,a120_f32")
    parser.add_argument("--saves", type=int, default=3, help="saves per case (medians shown)")
    parser.add_argument("--dir", default="", help="where to write (default: a temporary directory)")
    parser.add_argument("--emulator", action="store_true", help="save to gs://bench on a Cloud Storage emulator")
    args = parser.parse_args()
    print(harness.header("python bench/bench_checkpoint.py " + " ".join(sys.argv[1:])), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir or None) as directory:
        emulator = None
        if args.emulator:
            from tests.gcs_emulator import Emulator

            emulator = Emulator(os.path.join(directory, "objects"))
            emulator.make_bucket("bench")
            os.environ.update(emulator.env)
        try:
            for name in args.only.split(","):
                rows.append(bench_case(name.strip(), args.saves, "gs://bench" if emulator else directory))
        finally:
            if emulator is not None:
                emulator.stop()
    print(f"\nload average at end {harness.load_average()}")
    print(harness.format_table(
        ["case", "state MB (params + Adam)", "step ms", "save() blocks ms", "write s (median)",
         "first write s", "steps during write", "loop stall ms", "restore s", "restore = saved step"],
        [[r["case"], f"{r['mb']:,.0f}", f"{r['baseline_s'] * 1e3:,.0f}", f"{r['blocking_s'] * 1e3:,.0f}",
          f"{r['write_s']:.2f}", f"{r['first_write_s']:.2f}", f"{r['steps_during']:.0f}",
          f"{r['stall_s'] * 1e3:,.0f}", f"{r['restore_s']:.2f}", "yes" if r["exact"] else "NO"] for r in rows]))


if __name__ == "__main__":
    main()
