"""Where a train step's time goes on the device: a profiler trace of a few steps, its kernels summed.

    python bench/trace_step.py [--case gpu120m] [--optimizers adamw,muon] [--steps 5] [--out DIR]

Each optimizer's step (bench/harness.py's JaxStep, jitted as the training loop jits it) is
compiled and warmed, then `--steps` steps run under `jax.profiler`. The trace's
`<host>.trace.json.gz` is read back: the device's kernels are summed by kind (matrix products,
attention, other fusions, copies, collectives) and by name, and set against the steps' wall time,
so that the time the device sat idle (launches, the host) shows too, beside the compile check's estimate of
the same program by kind (`andrea_jax/compile/kernel_time.py`) where gpu_targets/ describes the GPU. The
traces stay under `--out` for TensorBoard's profile plugin or Perfetto.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# The first pattern a kernel's name matches names its kind; the order matters (a cuDNN attention
# kernel's name holds "gemm" too).
KINDS = [
    ("attention", re.compile(r"cudnn|fmha|flash|attention|splash", re.I)),
    ("collective", re.compile(r"nccl|all-reduce|all_reduce|all-gather|reduce-scatter|collective", re.I)),
    # cuBLAS's kernels: nvjet_* (cuBLASLt's own), *xmma_gemm*; XLA's Triton ones: gemm_fusion_dot_*.
    ("matrix product", re.compile(r"gemm|nvjet|xmma|cublas|cutlass|matmul|dot|convolution", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|transpose", re.I)),
    ("other fusion", re.compile(r"")),
]


def kind_of(kernel: str) -> str:
    return next(kind for kind, pattern in KINDS if pattern.search(kernel))


def device_kernel_seconds(trace_path: str) -> dict[str, float]:
    """Seconds of each kernel name on the trace's device lines, summed over a GPU's streams.

    A GPU's process holds its kernels once on each stream's line and again, grouped, on the derived
    "XLA Ops" and "XLA Modules" lines: the streams alone are counted, or "XLA Ops" where a device has
    no streams (a TPU, XLA's CPU device)."""
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    metadata = [e for e in events if e.get("ph") == "M"]
    device_pids = {e["pid"] for e in metadata
                   if e.get("name") == "process_name" and "/device:" in e.get("args", {}).get("name", "")}
    lines = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in metadata
             if e.get("name") == "thread_name" and e["pid"] in device_pids}
    counted = {line for line, name in lines.items() if name.startswith("Stream")} or {
        line for line, name in lines.items() if name == "XLA Ops"}
    if not counted:
        raise SystemExit(f"{trace_path} holds no device kernels (lines: {sorted(set(lines.values()))}); "
                         "XLA's CPU backend traces none: run this on an accelerator")
    print(f"counted the lines {', '.join(sorted({lines[line] for line in counted}))}", flush=True)
    seconds = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in counted:
            seconds[e["name"]] += e.get("dur", 0) / 1e6
    return seconds


# The estimate's kinds (`kernel_time.KINDS` and its launches) as this trace names them.
ESTIMATE_KINDS = {"matrix products": "matrix product", "attention": "attention", "other fusions": "other fusion",
                  "copies": "copy", "launches": "the device idle"}


def beside_the_estimate(traced_ms: dict[str, float], idle_ms: float, estimated_ms: dict[str, float]) -> list[list]:
    """Rows of kind, traced ms, estimated ms and their ratio; the idle time set against the estimate's launches."""
    traced = dict(traced_ms, **{"the device idle": idle_ms})
    rows = []
    for kind, name in ESTIMATE_KINDS.items():
        measured, estimated = traced.get(name, 0.0), estimated_ms.get(kind, 0.0)
        ratio = f"{estimated / measured:.2f}" if measured else "—"
        rows.append([name, f"{measured:.2f}", f"{estimated:.2f}", ratio])
    return rows


def estimate_of(jax_step) -> dict[str, float] | None:
    """The compile check's estimate by kind (ms) of the program `jax_step` runs, or None where gpu_targets/
    has no rates for its device."""
    from andrea_jax.compile import kernel_time, targets
    device = jax.devices()[0]
    name = targets.gpu_for(device.device_kind)
    if name is None:
        print(f"no rates for {device.device_kind} in andrea_jax/compile/gpu_targets/: no estimate beside the trace")
        return None
    hlo = jax_step.step_fn.lower(jax_step.state, jax_step.batches[0]).compile().as_text()
    estimate = kernel_time.estimate(hlo, targets.gpu_kernel_rates(name))
    return {kind: 1e3 * seconds for kind, seconds in estimate.seconds_by_kind.items()}


def trace_contender(config, steps: int, out: str) -> tuple[float, dict[str, float], dict[str, float] | None]:
    """(wall seconds of `steps` traced steps, kernel seconds by name, the estimate by kind in ms)."""
    jax_step = harness.JaxStep(config)
    jax_step.compile()
    jax_step.run(3)  # warm: autotuning and the allocator settle outside the trace
    jax.profiler.start_trace(out)
    started = time.perf_counter()
    jax_step.run(steps)  # blocks on the last step
    wall = time.perf_counter() - started
    jax.profiler.stop_trace()
    estimated = estimate_of(jax_step)
    jax_step.close()
    traces = sorted(glob.glob(os.path.join(out, "plugins", "profile", "*", "*.trace.json.gz")))
    if not traces:
        raise SystemExit(f"jax.profiler wrote no *.trace.json.gz under {out}")
    return wall, device_kernel_seconds(traces[-1]), estimated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="gpu120m", help="a bench/harness.py case (default gpu120m)")
    parser.add_argument("--optimizers", default="adamw,muon", help="comma-separated (default adamw,muon)")
    parser.add_argument("--steps", type=int, default=5, help="steps traced for each optimizer")
    parser.add_argument("--top", type=int, default=12, help="kernels listed by name for each optimizer")
    parser.add_argument("--out", default="runs/trace_step", help="where the traces are written")
    args = parser.parse_args()
    global jax, harness
    import jax
    from bench import harness
    print(harness.header("python bench/trace_step.py " + " ".join(sys.argv[1:])), flush=True)

    for optimizer_name in args.optimizers.split(","):
        config = harness.make_case(args.case)
        config.optimizer.name = optimizer_name
        wall, kernels, estimated = trace_contender(config, args.steps, os.path.join(args.out, optimizer_name))
        step_ms = 1e3 * wall / args.steps
        busy_ms = 1e3 * sum(kernels.values()) / args.steps
        by_kind = collections.Counter()
        for name, seconds in kernels.items():
            by_kind[kind_of(name)] += seconds
        print(f"\n{args.case}, {optimizer_name}: {step_ms:.1f} ms a step (wall, {args.steps} traced); kernels "
              f"{busy_ms:.1f} ms a step, the device idle {max(0.0, step_ms - busy_ms):.1f} ms")
        rows = [[kind, f"{1e3 * s / args.steps:.2f}", f"{100 * s / wall:.0f}%"] for kind, s in by_kind.most_common()]
        print(harness.format_table(["kind", "ms a step", "of the wall time"], rows))
        if estimated:
            traced_ms = {kind: 1e3 * s / args.steps for kind, s in by_kind.items()}
            rows = beside_the_estimate(traced_ms, max(0.0, step_ms - busy_ms), estimated)
            rows.append(["the step", f"{step_ms:.2f}", f"{sum(estimated.values()):.2f}",
                         f"{sum(estimated.values()) / step_ms:.2f}"])
            print(harness.format_table(["kind", "traced ms", "estimated ms", "estimated / traced"], rows))
        rows = [[name[:90], kind_of(name), f"{1e3 * s / args.steps:.2f}"]
                for name, s in kernels.most_common(args.top)]
        print(harness.format_table(["kernel", "kind", "ms a step"], rows))


if __name__ == "__main__":
    main()
