"""Fewer steps to the same loss? AdamW with cosine against AdamW and Muon with WSD, and the floor they cool to.

    python bench/optimizer_study.py --size shakespeare_char --text PATH/TO/tinyshakespeare.txt
    python bench/optimizer_study.py --size tiny                      # the quick start's stdlib corpus
    python bench/optimizer_study.py --size tiny --sweep muon:1.8e-3,3.6e-3,7.2e-3   # a peak swept on seed 0
    python bench/optimizer_study.py --size tiny --arms adamw_cosine,adamw_wsd,muon_wsd   # some arms only

Arms (`ARMS`): the config as it stands (`adamw_cosine`), and AdamW or Muon at `--adamw_rate`/`--muon_rate`
with WSD (1−sqrt over the last 20%) to a tenth of the peak (`_wsd`), the same WSD to zero (`_wsd_to0`), or
linear decay to zero from the end of warmup (`_d2z`, Bergsma et al. 2025); `muon_wsd_bf16` is `muon_wsd` with
its Newton–Schulz iterations in bfloat16, as an accelerator runs them. Each trains its config as
`train.py` would (the project's own loop, evals every `--eval_every` steps) for each seed. The peaks are chosen
on seed 0 (`--sweep`), so the table reports seeds 1 and up: the final validation loss of each arm (mean and
spread) and the step at which each run first reaches the AdamW-cosine arm's mean final loss; then the end
moved: the `adamw_wsd` run's checkpoint from its stable phase resumed with steps = 60% of the plan (its
cooldown from there), against cosine runs planned for that length. Runs already finished in --root are read,
not trained again. Writes bench/optimizer_study_<size>.json and docs/optimizer_study.png, one panel for each
size's json in bench/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from andrea_jax import metrics, train_loop  # noqa: E402
from configs import shakespeare_char, tiny  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {"shakespeare_char": shakespeare_char.get_config, "tiny": tiny.get_config}
COOLDOWN_FRACTION = 0.2  # Hägele et al.: 10-20% of the steps; the WSD arms
SHORT_FRACTION = 0.6  # the moved end: a run stopped at 60% of its plan


SCHEDULES = {"wsd": dict(decay="wsd", cooldown_shape="1-sqrt"),  # to the config's floor, a tenth
             "wsd_to0": dict(decay="wsd", cooldown_shape="1-sqrt", min_learning_rate_ratio=0.0),
             "d2z": dict(decay="linear", min_learning_rate_ratio=0.0)}
ARMS = ["adamw_cosine"] + [f"{optimizer}_{schedule}" for optimizer in ("adamw", "muon") for schedule in SCHEDULES]
# Muon's Newton–Schulz iterations in bfloat16, as accelerators run them (a CPU's "auto" runs them in float32)
BFLOAT16_ITERATIONS = "_bf16"


def arm(name: str, rates: dict[str, float]) -> dict:
    """An arm's optimizer overrides; the cosine arm is the config as it stands."""
    if name == "adamw_cosine":
        return {}
    optimizer, schedule = name.removesuffix(BFLOAT16_ITERATIONS).split("_", 1)
    iterations = dict(muon_ns_dtype="bfloat16") if name.endswith(BFLOAT16_ITERATIONS) else {}
    return dict(SCHEDULES[schedule], name=optimizer, learning_rate=rates[optimizer], **iterations)


def run_directory(args, size: str, name: str, seed: int, rates: dict[str, float]) -> str:
    """The swept arms' runs are kept by their peak: the sweep's seed 0 at the chosen peak is the arm's own, and
    another peak never reads runs of the last one."""
    kept_as = name if name == "adamw_cosine" else f"{name}_{rates[name.split('_')[0]]:g}"
    return os.path.join(args.root, size, kept_as, f"seed{seed}")


def config_for(size: str, seed: int, optimizer: dict, steps: int, args) -> "ml_collections.ConfigDict":
    c = CONFIGS[size]()
    c.seed, c.steps, c.eval_every = seed, steps, args.eval_every
    c.checkpoint_every = args.eval_every * 4  # the moved end resumes from one of these
    c.keep_checkpoints = 1 + steps // c.checkpoint_every
    c.optimizer.update(optimizer)
    if c.optimizer.decay == "wsd":
        c.optimizer.cooldown_steps = round(COOLDOWN_FRACTION * steps)
    if args.text:
        c.data.source = "text:" + os.path.abspath(args.text)
    c.data.cache_dir = os.path.join(args.root, "cache")
    return c


def run(config, workdir: str) -> list[tuple[int, float]]:
    """Trains (or finds finished) the run in `workdir`; its (step, val_loss) records."""
    records = metrics.read(workdir)
    if not any(r.get("step") == config.steps and "val_loss" in r for r in records):
        print(f"== {workdir}", flush=True)
        train_loop.train(config, workdir, devices=jax.devices()[:1])
        records = metrics.read(workdir)
    return [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]


def first_reaching(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, loss in curve if loss <= target), None)


def moved_end(size: str, seed: int, rates: dict[str, float], args) -> list[tuple[int, float]]:
    """The full-length WSD run's latest checkpoint at or before 60% − cooldown (still at its peak), copied and
    resumed with steps = 60% of the plan: the cooldown starts where that resume says."""
    steps = CONFIGS[size]().steps
    short = round(SHORT_FRACTION * steps)
    full = run_directory(args, size, "adamw_wsd", seed, rates)
    workdir = os.path.join(args.root, size, f"moved_end_{rates['adamw']:g}", f"seed{seed}")
    config = config_for(size, seed, arm("adamw_wsd", rates), steps, args)
    config.steps, config.optimizer.cooldown_steps = short, round(COOLDOWN_FRACTION * short)
    if not os.path.isdir(workdir):
        start = short - config.optimizer.cooldown_steps
        shutil.copytree(full, workdir)
        checkpoints = os.path.join(workdir, "checkpoints")
        kept = [int(name) for name in os.listdir(checkpoints) if name.isdigit() and int(name) <= start]
        if not kept:
            raise SystemExit(f"{full} has no checkpoint at or before step {start}: rerun it with a smaller "
                             f"--eval_every")
        for name in os.listdir(checkpoints):
            if name.isdigit() and int(name) > max(kept):
                shutil.rmtree(os.path.join(checkpoints, name))
        metrics.truncate_after(workdir, max(kept))  # as a run stopped there has them
    return run(config, workdir)


def summary(values: list[float]) -> str:
    if not values:
        return "not reached"
    spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.3f}{spread}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(CONFIGS), required=True)
    parser.add_argument("--text", default="", help="a local copy of the corpus (shakespeare_char downloads it)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval_every", type=int, default=100)
    parser.add_argument("--adamw_rate", type=float, default=3e-3, help="AdamW's peak in the WSD and D2Z arms "
                                                                           "(chosen by --sweep)")
    parser.add_argument("--muon_rate", type=float, default=3e-3, help="Muon's peak (chosen by --sweep)")
    parser.add_argument("--sweep", default="", help="OPTIMIZER:PEAKS, the WSD arm's peaks to try on seed 0, "
                                                    "e.g. adamw:1e-3,3e-3,1e-2")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, among {', '.join(ARMS)}, and "
                                                              f"muon_wsd{BFLOAT16_ITERATIONS} (bfloat16 iterations)")
    parser.add_argument("--no_moved_end", action="store_true", help="leave out the moved end's runs")
    parser.add_argument("--root", default="/tmp/andrea-optimizer-study", help="where the runs' workdirs go")
    args = parser.parse_args()
    size, steps = args.size, CONFIGS[args.size]().steps
    rates = {"adamw": args.adamw_rate, "muon": args.muon_rate}
    names = args.arms.split(",")
    if not set(names) <= {*ARMS, f"muon_wsd{BFLOAT16_ITERATIONS}"} or "adamw_cosine" not in names:
        raise SystemExit(f"--arms {args.arms}: choose among {', '.join(ARMS)}, adamw_cosine (the target) among them")

    if args.sweep:
        optimizer, _, peaks = args.sweep.partition(":")
        if optimizer not in rates or not peaks:
            raise SystemExit(f"--sweep {args.sweep}: write it OPTIMIZER:PEAKS, e.g. adamw:1e-3,3e-3,1e-2")
        for rate in map(float, peaks.split(",")):
            swept = dict(rates, **{optimizer: rate})
            curve = run(config_for(size, 0, arm(f"{optimizer}_wsd", swept), steps, args),
                        run_directory(args, size, f"{optimizer}_wsd", 0, swept))
            print(f"{optimizer}_wsd at {rate:g}: final val loss {curve[-1][1]:.4f}", flush=True)
        return

    curves = {name: [run(config_for(size, seed, arm(name, rates), steps, args),
                         run_directory(args, size, name, seed, rates)) for seed in range(args.seeds)]
              for name in names}
    if not args.no_moved_end:
        short = round(SHORT_FRACTION * steps)
        curves["moved_end_wsd"] = [moved_end(size, seed, rates, args) for seed in range(args.seeds)]
        curves["cosine_planned_short"] = [run(config_for(size, seed, {}, short, args),
                                              os.path.join(args.root, size, "cosine_short", f"seed{seed}"))
                                          for seed in range(args.seeds)]
    reported = range(1, args.seeds) if args.seeds > 1 else range(args.seeds)  # seed 0 chose the peaks
    target = statistics.mean(curves["adamw_cosine"][seed][-1][1] for seed in reported)

    print(f"\n{size}, {steps} steps, seeds {', '.join(map(str, reported))}; target: adamw_cosine's mean final val "
          f"loss {target:.4f}")
    print("| arm | final val loss (mean ± sd) | first step at the target (each seed) |")
    print("| --- | --- | --- |")
    for name, runs in curves.items():
        reached = [first_reaching(runs[seed], target) for seed in reported]
        print(f"| {name} (ends at {runs[0][-1][0]}) | {summary([runs[seed][-1][1] for seed in reported])} | "
              f"{', '.join(str(step) if step else '—' for step in reached)} |")
    result = {"size": size, "steps": steps, "target": target, "reported_seeds": list(reported), "rates": rates,
              "arms": {name: arm(name, rates) for name in names}, "curves": curves}
    with open(os.path.join(HERE, f"optimizer_study_{size}.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot()


def plot() -> None:
    """docs/optimizer_study.png: each arm's mean validation curve, one panel a size found in bench/."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    found = [json.load(open(os.path.join(HERE, f"optimizer_study_{size}.json"))) for size in sorted(CONFIGS)
             if os.path.exists(os.path.join(HERE, f"optimizer_study_{size}.json"))]
    figure, axes = plt.subplots(1, len(found), figsize=(6 * len(found), 4.2), squeeze=False)
    for axis, result in zip(axes[0], found):
        for name, runs in result["curves"].items():
            steps = [step for step, _ in runs[0]]
            mean = [statistics.mean(curve[i][1] for curve in runs) for i in range(len(steps))]
            axis.plot(steps, mean, label=name, linestyle="--" if "short" in name or "moved" in name else "-")
        axis.axhline(result["target"], color="grey", linewidth=0.8)
        axis.set_title(f"{result['size']}: mean of {len(result['curves']['adamw_cosine'])} seeds")
        axis.set_xlabel("step")
        axis.set_ylabel("validation loss")
        low = min(curve[-1][1] for runs in result["curves"].values() for curve in runs)
        axis.set_ylim(low - 0.05, low + 1.0)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(os.path.join(HERE, "..", "docs", "optimizer_study.png"), dpi=110)


if __name__ == "__main__":
    main()
