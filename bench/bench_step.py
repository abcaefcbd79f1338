"""Train-step throughput: the project's jitted step against the PyTorch reference, side by side.

    python bench/bench_step.py [--only mid,shakespeare] [--dtypes float32,bfloat16] [--rounds 5]
                               [--torch-compile] [--no-torch]

Cases: shakespeare (configs/shakespeare_char.py), mid (6L d384, seq 256, batch 8,
vocab 8449), a120 (configs/andrea120m.py at seq 128, batch 4); gpu120m (context
1024, batch 32, bf16) is for accelerators (bench/gpu.sh).
On a CPU every case runs in float32 and in bfloat16, JAX and PyTorch alike
(PyTorch's bfloat16 is autocast): four contenders. PyTorch runs in a child
process (bench/torch_worker.py), so that its allocations and threads do not
change the JAX process's heap between repetitions. Each round runs one
repetition of every contender, in rotating order, so that the other work on a
shared machine slows all alike; medians are reported. The matmul ceilings
(2048³, float32 and bfloat16 with float32 accumulation) run in the same rounds.
MFU is against the measured matmul rate of the contender's compute dtype (as the
training loop does on a CPU) or the device's table peak.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DEFAULT_CASES = ["shakespeare", "mid", "a120"]


class TorchWorker:
    """bench/torch_worker.py in a child process: PyTorch's contenders, out of the JAX process."""

    def __init__(self, threads: int):
        env = dict(os.environ, ANDREA_TORCH_THREADS=str(threads))
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_worker.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def request(self, **message) -> dict:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the PyTorch worker exited (status {self.process.wait()}); its error is above")
        return json.loads(line)

    def contender(self, label: str, config, compile: bool):
        """(one-repetition callable, seconds of the first step), or an error message."""
        reply = self.request(op="build", label=label, config=config.to_json(), compile=compile)
        if "error" in reply:
            return reply["error"]
        return (lambda steps: self.run(label, steps)), reply["first_s"]

    def run(self, label: str, steps: int) -> float:
        reply = self.request(op="run", label=label, steps=steps)
        if "error" in reply:
            raise RuntimeError(f"{label}: {reply['error']}")
        return reply["step_s"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def bench_case(name: str, args, matmul_reps: dict) -> list[dict]:
    base = harness.make_case(name)
    nanogpt_flops, exact_flops = harness.flops_per_step(base)
    tokens = base.batch_size * base.seq_len
    device = jax.devices()[0]
    if args.dtypes:
        dtypes = args.dtypes.split(",")
    elif device.platform == "cpu":
        dtypes = ["float32", "bfloat16"]  # both, so that each ratio is measured, not assumed
    else:
        dtypes = [base.model.dtype]
    contenders, compile_s, dtype_of = {}, {}, {}
    jax_steps = []

    optimizers = args.optimizers.split(",")
    for dtype, optimizer_name in itertools.product(dtypes, optimizers):
        config = harness.make_case(name, dtype=dtype)
        config.optimizer.name = optimizer_name
        jax_step = harness.JaxStep(config)
        jax_steps.append(jax_step)
        label = f"jax {dtype}" + (f" {optimizer_name}" if optimizers != ["adamw"] else "")
        compile_s[label] = jax_step.compile()
        k = harness.steps_per_rep(jax_step.run(1), args.rep_seconds)
        contenders[label] = (lambda jax_step=jax_step, k=k: jax_step.run(k))
        dtype_of[label] = dtype

    torch_modes = [] if args.no_torch or importlib.util.find_spec("torch") is None else (
        [False] + ([True] if args.torch_compile else []))
    worker = TorchWorker(args.threads) if torch_modes else None
    for dtype in dtypes:
        for compiled in torch_modes:
            label = f"{'torch.compile' if compiled else 'torch eager'} {dtype}"
            made = worker.contender(label, harness.make_case(name, dtype=dtype), compiled)
            if isinstance(made, str):
                print(f"{name}: {label} failed: {made}", file=sys.stderr)
                continue
            run, compile_s[label] = made
            k = harness.steps_per_rep(run(1), args.rep_seconds)
            contenders[label] = (lambda run=run, k=k: run(k))
            dtype_of[label] = dtype

    reps = dict(contenders)
    reps.update(matmul_reps)
    samples = harness.interleave(reps, args.rounds)
    step_s = {label: harness.median(samples[label]) for label in contenders}

    f32_rate = harness.median(samples["matmul float32"]) if "matmul float32" in samples else None
    torch_f32 = step_s.get("torch eager float32", float("nan"))
    rows = []
    for label, seconds in step_s.items():
        dtype = dtype_of[label]
        table_peak = flops.device_peak_flops(device)
        if table_peak is not None:
            peak, peak_source = table_peak, f"{device.device_kind} table peak"
        elif "matmul " + dtype in samples:
            peak, peak_source = harness.median(samples["matmul " + dtype]), f"measured {dtype} matmul"
        else:  # --no-matmul on a CPU: no ceiling, no MFU
            peak, peak_source = float("nan"), "no peak (--no-matmul)"
        rows.append(dict(
            case=name, shape=harness.describe_case(base), impl=label, step_s=seconds,
            step_min_s=min(samples[label]), tokens_per_s=tokens / seconds,
            gflops_nanogpt=nanogpt_flops / seconds / 1e9, gflops_exact=exact_flops / seconds / 1e9,
            mfu_nanogpt=nanogpt_flops / seconds / peak, mfu_exact=exact_flops / seconds / peak,
            peak_source=peak_source, peak_gflops=peak / 1e9,
            of_f32_matmul=None if f32_rate is None else exact_flops / seconds / f32_rate,
            speed_vs_torch=torch_f32 / seconds,
            speed_vs_torch_same_dtype=step_s.get(f"torch eager {dtype}", float("nan")) / seconds,
            compile_s=compile_s.get(label, float("nan")) - seconds,  # the first step less a steady one
            samples=samples[label]))
    for label in matmul_reps:
        rows.append(dict(case=name, impl=label, gflops=harness.median(samples[label]) / 1e9,
                         gflops_best=max(samples[label]) / 1e9))
    for jax_step in jax_steps:
        jax_step.close()
    if worker is not None:
        worker.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(DEFAULT_CASES),
                        help=f"comma-separated cases (default {','.join(DEFAULT_CASES)}; also gpu120m)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repetitions (medians shown)")
    parser.add_argument("--rep-seconds", type=float, default=1.0, help="about this long a repetition")
    parser.add_argument("--no-torch", action="store_true", help="the JAX step alone")
    parser.add_argument("--torch-compile", action="store_true", help="also time torch.compile (inductor)")
    parser.add_argument("--no-matmul", action="store_true", help="skip the matmul ceilings (accelerators)")
    parser.add_argument("--threads", type=int, default=0,
                        help="1 = single-threaded JAX (--xla_cpu_multi_thread_eigen=false) and torch; "
                             "0 = all cores (the default). One thread is the fair comparison on a loaded machine.")
    parser.add_argument("--dtypes", default="",
                        help="compute dtypes to time, e.g. float32,bfloat16 (default: both on a CPU, "
                             "the case's own on an accelerator); PyTorch runs bfloat16 under autocast")
    parser.add_argument("--optimizers", default="adamw",
                        help="optimizers to time side by side, e.g. adamw,muon (default adamw)")
    parser.add_argument("--json", help="also write every sample here")
    args = parser.parse_args()
    if args.threads == 1:  # must be set before jax is imported
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    global jax, flops, harness
    import jax
    from andrea_jax import flops
    from andrea_jax.runtime import host_memory
    # As train.py runs (andrea_jax/runtime/cli.py); bench/torch_worker.py sets the same for PyTorch.
    host_memory.keep_freed_memory()
    from bench import harness
    print(harness.header("python bench/bench_step.py " + " ".join(sys.argv[1:])), flush=True)

    matmul_reps = {}
    if not args.no_matmul:
        for dtype in ("float32", "bfloat16"):
            matmul_reps["matmul " + dtype] = harness.Matmul(dtype).run

    rows = []
    for name in args.only.split(","):
        started = time.perf_counter()
        rows += bench_case(name.strip(), args, matmul_reps)
        print(f"[{name}: {time.perf_counter() - started:.0f} s, load average {harness.load_average()}]",
              file=sys.stderr, flush=True)

    table = []
    for r in rows:
        if "step_s" in r:
            table.append([r["case"], r["impl"], f"{r['step_s'] * 1e3:,.1f}", f"{r['step_min_s'] * 1e3:,.1f}",
                          f"{r['tokens_per_s']:,.0f}", f"{r['gflops_nanogpt']:.1f}", f"{r['gflops_exact']:.1f}",
                          f"{100 * r['mfu_nanogpt']:.1f}%", f"{100 * r['mfu_exact']:.1f}%",
                          "" if r["of_f32_matmul"] is None else f"{100 * r['of_f32_matmul']:.0f}%",
                          f"{r['speed_vs_torch']:.2f}×", f"{r['speed_vs_torch_same_dtype']:.2f}×",
                          f"{r['compile_s']:.1f}"])
        else:
            table.append([r["case"], r["impl"], "", "", "", f"{r['gflops']:.1f} (best {r['gflops_best']:.1f})",
                          "", "", "", "", "", "", ""])
    print(f"\nload average at end {harness.load_average()}; shapes: "
          + "; ".join(sorted({f"{r['case']} = {r['shape']}" for r in rows if 'shape' in r})))
    peaks = sorted({f"{r['case']}: {r['peak_source']} {r['peak_gflops']:.0f} GFLOP/s" for r in rows if "peak_source" in r})
    print("MFU peak: " + "; ".join(peaks))
    print(harness.format_table(
        ["case", "impl", "step ms (median)", "step ms (min)", "tokens/s", "GFLOP/s 6N", "GFLOP/s exact",
         "MFU 6N", "MFU exact", "exact / f32 matmul", "speed vs torch eager float32",
         "speed vs torch eager, same dtype", "compile s"], table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
