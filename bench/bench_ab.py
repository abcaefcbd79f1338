"""Two checkouts' train steps side by side: the same case, one process each, repetitions in lockstep.

    python bench/bench_ab.py BASE_DIR NEW_DIR [--cases shakespeare,mid] [--dtypes bfloat16,float32] [--pairs 15]

Each checkout (a `git worktree` of the commit to compare) runs `bench/harness.py`'s jitted step in a
process of its own; the two take turns, one repetition each, in alternating order, so that other
work on a shared machine slows both alike. Prints each case's medians and the median of the
per-pair ratios (base seconds / new seconds: above 1 means the new checkout is faster).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

WORKER = """
import sys
sys.path.insert(0, ".")
from bench import harness
step = harness.JaxStep(harness.make_case(sys.argv[1], dtype=sys.argv[2]))
step.compile()
steps = harness.steps_per_rep(step.run(2))
print("ready", flush=True)
for _ in sys.stdin:
    print(step.run(steps), flush=True)
"""


def worker(directory: str, case: str, dtype: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", WORKER, case, dtype], cwd=directory, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    if process.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the step of {directory} did not start")
    return process


def repetition(process: subprocess.Popen) -> float:
    process.stdin.write("run\n")
    process.stdin.flush()
    return float(process.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--cases", default="shakespeare,mid")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--pairs", type=int, default=15)
    args = parser.parse_args()
    print("| case | dtype | base ms (median) | new ms (median) | base / new (median of pairs) |")
    print("| --- | --- | --- | --- | --- |")
    for case in args.cases.split(","):
        for dtype in args.dtypes.split(","):
            base, new = worker(args.base, case, dtype), worker(args.new, case, dtype)
            times = {"base": [], "new": []}
            for pair in range(args.pairs):
                order = [("base", base), ("new", new)][:: 1 if pair % 2 == 0 else -1]
                for name, process in order:
                    times[name].append(repetition(process))
            for process in (base, new):
                process.stdin.close()
                process.wait()
            ratios = [b / n for b, n in zip(times["base"], times["new"])]
            print(f"| {case} | {dtype} | {1e3 * statistics.median(times['base']):.1f} | "
                  f"{1e3 * statistics.median(times['new']):.1f} | {statistics.median(ratios):.3f} |", flush=True)


if __name__ == "__main__":
    main()
