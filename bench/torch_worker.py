"""The PyTorch contenders of bench/bench_step.py, run in a process of their own.

PyTorch in the benchmark's own process changed what the JAX step measured: the
small shakespeare step took 41.8 ms with PyTorch's repetitions in between, 28.5 ms
without (bench/RESULTS.md, 2026-11-29 12:28); its allocations and threads share
the heap and the cores' caches. Here each contender lives in this child process
and the parent drives it over a pipe, one request at a time, so the rounds still
interleave.

Protocol: one JSON object a line on stdin, one JSON reply a line on stdout.
    {"op": "build", "label": L, "config": <ConfigDict JSON>, "compile": bool, "seed": n}
        -> {"first_s": seconds of the first step}
    {"op": "run", "label": L, "steps": k}  -> {"step_s": seconds a step}
Any failure replies {"error": "..."}; end of input ends the process.
"""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    # Before torch loads: the protocol gets its own copy of stdout, and file descriptor 1 then
    # points at stderr, so nothing else (prints, oneDNN's verbose mode, torch.compile's workers)
    # can write into it.
    PROTOCOL_OUT = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

import ml_collections
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from andrea_jax.runtime import host_memory  # noqa: E402 (imports no jax)
from bench import synthetic, torch_reference  # noqa: E402


class Contender:
    """One PyTorch train step with its batches; `run(k)` times k steps with one host sync at the end."""

    def __init__(self, config: ml_collections.ConfigDict, compile: bool, seed: int):
        self.step = torch_reference.TrainStep(config, compile=compile)
        self.batches = [torch.from_numpy(b.astype(np.int64)) for b in synthetic.random_batches(config, 4, seed)]
        self.next = 0

    def run(self, steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            loss = self.step(self.batches[self.next % len(self.batches)])
            self.next += 1
        loss.item()
        return (time.perf_counter() - started) / steps


def serve(lines, reply) -> None:
    contenders: dict[str, Contender] = {}
    for line in lines:
        request = json.loads(line)
        try:
            if request["op"] == "build":
                config = ml_collections.ConfigDict(json.loads(request["config"]))
                started = time.perf_counter()
                contender = Contender(config, request["compile"], request.get("seed", 0))
                contender.run(1)  # first step: allocations (and torch.compile's compilation)
                contenders[request["label"]] = contender
                reply({"first_s": time.perf_counter() - started})
            elif request["op"] == "run":
                reply({"step_s": contenders[request["label"]].run(int(request["steps"]))})
            else:
                reply({"error": f"unknown op {request['op']!r}"})
        except Exception as error:  # torch.compile may need a toolchain this machine lacks
            reply({"error": f"{type(error).__name__}: {str(error)[:300]}"})


def main() -> None:
    threads = int(os.environ.get("ANDREA_TORCH_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    host_memory.keep_freed_memory()  # the same allocator setting the JAX side runs with

    def reply(message: dict) -> None:
        PROTOCOL_OUT.write(json.dumps(message) + "\n")
        PROTOCOL_OUT.flush()

    serve(sys.stdin, reply)


if __name__ == "__main__":
    main()
