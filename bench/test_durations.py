"""The test suite's time by cause, from the output of `python -m pytest -q --durations=0`.

    python -m pytest -q --durations=0 > before.txt   # on one commit, then on another
    python bench/test_durations.py before.txt after.txt

Prints, for each file given, the seconds of every cause (each test's setup, call and teardown
summed; a test counts under the first cause whose pattern its id matches) and the wall time
pytest reported, side by side. The causes are this suite's: where its seconds go.
"""

from __future__ import annotations

import re
import sys

# (cause, pattern of the test ids it holds), first match wins.
CAUSES = [
    ("full-size TPU compiles (v5e-1, v6e-1, the 10B recipe's v6e-1, v5e-16)",
     r"test_compile_check\.py::test_(andrea120m_as_typed_fits_one_colab_tpu|the_fineweb10b_recipe|a_multi_host_slice"
     r"|one_microbatch_forced)"),
    ("full-size GPU compiles", r"test_compile_check\.py::test_(andrea120m_as_typed_fits_each_colab_gpu|cudnn)"),
    ("several processes (jax.distributed)", r"test_multihost\.py"),
    ("the notebook", r"test_notebook\.py"),
    ("train.py/eval.py in subprocesses (kill, signals, CLI)",
     r"test_(resume|atomic|cli|plotting|bench_step|eval|hellaswag\.py::test_eval_py|run_dir\.py::test_a_second"
     r"|train_loop\.py::test_(train_py|command_line)|compile_check\.py::test_the_command|hf_stream\.py::test_offline)"),
    ("training runs in-process", r"test_(train_loop|fit|loss_scale|hellaswag|diagnostics|run_dir|huggingface)\.py"),
    ("steps and models compiled on the CPU", r"test_(train_step|model|precision|attention|ablations|compile_check"
                                             r"|sampling|interop|optimizer|bench_reference)\.py"),
    ("data, tokenizers, the rest", r""),
]
LINE = re.compile(r"^([0-9.]+)s (?:setup|call|teardown)\s+(\S+)")
TOTAL = re.compile(r"in ([0-9.]+)s")


def by_cause(path: str) -> tuple[dict[str, float], float]:
    seconds = {cause: 0.0 for cause, _ in CAUSES}
    wall = float("nan")
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if match := LINE.match(line):
                test = match.group(2)
                cause = next(cause for cause, pattern in CAUSES if re.search(pattern, test))
                seconds[cause] += float(match.group(1))
            elif (" passed" in line or " failed" in line) and (total := TOTAL.search(line)):
                wall = float(total.group(1))
    return seconds, wall


def main(paths: list[str]) -> None:
    results = [by_cause(path) for path in paths]
    print("| cause | " + " | ".join(paths) + " |")
    print("| --- |" + " ---: |" * len(paths))
    for cause, _ in CAUSES:
        print(f"| {cause} | " + " | ".join(f"{seconds[cause]:.0f} s" for seconds, _ in results) + " |")
    print("| **wall time, as pytest reports it** | " + " | ".join(f"**{wall:.0f} s**" for _, wall in results) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
