"""Speed levers of the train step, one at a time against the baseline, with the prediction written first.

    python bench/bench_levers.py [--case mid] [--dtype bfloat16] [--only pad128,ynn_off,...] [--rounds 4] [--no-flags]

In-process levers (config options, donation, host syncs, XLA options of the one
executable) are timed in pairs with
the baseline (baseline rep, lever rep, order alternating); the speed-up shown is
the median of the per-pair ratios, with their range. XLA flags need a fresh process each: children
alternate baseline / flag / baseline ..., each compiling and timing a few repetitions.
The baseline is the case as bench_step.py runs it (float32 unless --dtype, exact vocabulary,
xla attention, no scan, no remat, state donated, metrics read once a repetition).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

YNN_DOT_REDUCE_ELTWISE = "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE,LIBRARY_FUSION_TYPE_ELTWISE"
# name -> (what changes, prediction written before the first measurement)
LEVERS = {
    "pad128": (dict(model=dict(vocab_pad_multiple=128)),
               "mid: ±3% (CPU matmuls do not care about 128-multiples; +1.5% FLOPs); shakespeare: slower "
               "(66 -> 128 doubles the output matmul)"),
    "scan_layers": (dict(model=dict(scan_layers=True)),
                    "compile time about n_layer× shorter; step 0-5% slower (parameter slicing, grad stacking)"),
    "remat_on": (dict(model=dict(remat=True)),
                 "25-35% slower (the forward runs twice); the baseline already has remat off"),
    "no_donation": (dict(donate=False),
                    "mid +2-5% (a fresh copy of params + Adam moments each step); shakespeare +5-10%"),
    "bfloat16": (dict(model=dict(dtype="bfloat16")),
                 "mid 1.3-1.6× faster (AVX-512 BF16 matmuls 2.5× the f32 rate, diluted by casts and small "
                 "matrices); shakespeare: no gain (overhead-bound)"),
    "sync_every_step": (dict(sync_every_step=True),
                        "mid <1%; shakespeare 5-15% slower (the host waits for every step, no overlap)"),
    # XLA:CPU options for this executable alone, so that they pair with the baseline in one process.
    # (oneDNN, XNNPACK's dot fusion and graph mode, and the concurrency-optimised scheduler leave
    # jaxlib 0.10.2's compiled mid step unchanged: no lever.)
    "ynn_eltwise": (dict(compiler_options=dict(xla_cpu_experimental_ynn_fusion_type=YNN_DOT_REDUCE_ELTWISE)),
                    "±5%: YNNPACK also takes the elementwise fusions (softmax, GELU, LayerNorm)"),
    "ynn_individual_dot": (dict(compiler_options=dict(
                               xla_cpu_experimental_ynn_fusion_type="LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT")),
                           "0.95-1.0×: YNNPACK runs the dots alone, no fused producers or consumers"),
    "ynn_off": (dict(compiler_options=dict(xla_cpu_experimental_ynn_fusion_type="")),
                "0.7-0.9× (Eigen's dots), or bf16 fails: Eigen has no bf16 × bf16 → f32 dot"),
    "one_thread": (dict(compiler_options=dict(xla_cpu_multi_thread_eigen=False)),
                   "mid 0.6-0.9× (the matmuls lose a core); shakespeare ±10%"),
}
FLAG_LEVERS = {
    "eigen_1_thread": ("--xla_cpu_multi_thread_eigen=false",
                       "mid ~40% slower on a quiet machine (matmuls on one core), less under load; "
                       "shakespeare: maybe faster (no thread hand-offs for tiny ops)"),
    "xnnpack": ("--xla_cpu_use_xnnpack=true", "±10%: XNNPACK dots instead of Eigen's"),
    "onednn": ("--xla_cpu_use_onednn=true", "f32 ±10%; bf16 could gain if oneDNN reaches AMX better"),
}
DEFAULT_LEVERS = [name for name, (change, _) in LEVERS.items() if "compiler_options" not in change]


def make_step(case: str, change: dict, dtype: str = "float32"):
    from bench import harness
    # The baseline is float32 unless --dtype says otherwise; the "bfloat16" lever changes that alone.
    config = harness.make_case(case, **{"dtype": dtype, **change.get("model", {})})
    return harness.JaxStep(config, donate=change.get("donate", True),
                           sync_every_step=change.get("sync_every_step", False),
                           compiler_options=change.get("compiler_options"))


def in_process(args) -> list[dict]:
    from bench import harness
    steps, compile_s, k = {}, {}, {}
    for name in ["baseline"] + args.levers:
        step = make_step(args.case, LEVERS[name][0] if name != "baseline" else {}, args.dtype)
        compile_s[name] = step.compile()
        k[name] = harness.steps_per_rep(step.run(1), args.rep_seconds)
        steps[name] = step
    # Paired: each round times the baseline right next to each lever (order alternating) and
    # keeps the ratio, so the slow swings of a shared machine's load cancel within a pair.
    samples = {name: [] for name in steps}
    ratios = {name: [] for name in steps}
    for r in range(args.rounds):
        for index, name in enumerate(args.levers):
            pair = ["baseline", name] if (r + index) % 2 == 0 else [name, "baseline"]
            timed = {who: steps[who].run(k[who]) for who in pair}
            samples["baseline"].append(timed["baseline"])
            samples[name].append(timed[name])
            ratios[name].append(timed["baseline"] / timed[name])
    rows = []
    for name in steps:
        seconds = harness.median(samples[name])
        speedups = ratios[name] or [1.0]
        rows.append(dict(lever=name, step_s=seconds, speedup=harness.median(speedups),
                         speedup_range=(min(speedups), max(speedups)),
                         compile_s=compile_s[name] - seconds, samples=samples[name],
                         prediction=LEVERS[name][1] if name in LEVERS else "",
                         change=str(LEVERS[name][0]) if name in LEVERS else "as bench_step.py"))
    return rows


def child(args) -> None:
    """One process: compile, then `rounds` repetitions; prints JSON."""
    from bench import harness
    step = make_step(args.case, {}, args.dtype)
    compile_s = step.compile()
    k = harness.steps_per_rep(step.run(1), args.rep_seconds)
    samples = [step.run(k) for _ in range(args.rounds)]
    print(json.dumps(dict(compile_s=compile_s - statistics.median(samples), samples=samples)))


def with_flags(args) -> list[dict]:
    """Baseline and each flag in fresh processes, alternating, `args.flag_passes` times."""
    settings = {"baseline (no flag)": ""} | {name: flag for name, (flag, _) in FLAG_LEVERS.items()}
    results = {name: dict(samples=[], compile_s=[]) for name in settings}
    for _ in range(args.flag_passes):
        for name, flag in settings.items():
            env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flag).strip())
            out = subprocess.run([sys.executable, __file__, "--child", "--case", args.case, "--dtype", args.dtype,
                                  "--rounds", str(max(2, args.rounds // 2)), "--rep-seconds", str(args.rep_seconds)],
                                 env=env, capture_output=True, text=True)
            if out.returncode:
                print(f"{name}: child failed: {out.stderr[-500:]}", file=sys.stderr)
                continue
            got = json.loads(out.stdout.strip().splitlines()[-1])
            results[name]["samples"] += got["samples"]
            results[name]["compile_s"].append(got["compile_s"])
    base = statistics.median(results["baseline (no flag)"]["samples"])
    rows = []
    for name, got in results.items():
        if not got["samples"]:
            continue
        seconds = statistics.median(got["samples"])
        rows.append(dict(lever=name, step_s=seconds, speedup=base / seconds,
                         speedup_range=(base / max(got["samples"]), base / min(got["samples"])),
                         compile_s=statistics.median(got["compile_s"]), samples=got["samples"],
                         prediction=FLAG_LEVERS[name][1] if name in FLAG_LEVERS else "",
                         change=settings[name] or "XLA_FLAGS as in the environment"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="mid", help="shakespeare, mid, a120_f32, a120_bf16")
    parser.add_argument("--only", default=",".join(DEFAULT_LEVERS),
                        help=f"in-process levers: {','.join(LEVERS)}")
    parser.add_argument("--dtype", default="float32", help="the baseline's compute dtype")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--rep-seconds", type=float, default=1.0)
    parser.add_argument("--no-flags", action="store_true", help="skip the XLA-flag levers (fresh processes)")
    parser.add_argument("--flag-passes", type=int, default=2, help="alternations of the flag processes")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write every sample here")
    args = parser.parse_args()
    if args.child:
        return child(args)
    args.levers = [name for name in args.only.split(",") if name]
    from bench import harness
    print(harness.header("python bench/bench_levers.py " + " ".join(sys.argv[1:])), flush=True)
    print(f"case {args.case}: {harness.describe_case(harness.make_case(args.case, dtype=args.dtype))}", flush=True)
    started = time.perf_counter()
    rows = in_process(args) if args.levers else []
    print(f"[in-process levers: {time.perf_counter() - started:.0f} s, load average {harness.load_average()}]",
          file=sys.stderr, flush=True)
    if not args.no_flags:
        rows += with_flags(args)
    print(f"\nload average at end {harness.load_average()}")
    print(harness.format_table(
        ["lever", "change", "step ms (median)", "speed vs baseline (median; range)", "compile s",
         "prediction (written first)"],
        [[r["lever"], r["change"], f"{r['step_s'] * 1e3:,.1f}",
          f"{r['speedup']:.2f}× ({r['speedup_range'][0]:.2f}–{r['speedup_range'][1]:.2f})", f"{r['compile_s']:.1f}",
          r["prediction"]] for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
