"""Fewer steps to the same loss? AdamW with cosine against AdamW at 3× the peak with WSD and Muon with WSD.

    python bench/optimizer_study.py --size shakespeare_char --text PATH/TO/tinyshakespeare.txt
    python bench/optimizer_study.py --size tiny                      # the quick start's stdlib corpus
    python bench/optimizer_study.py --size shakespeare_char --text ... --sweep 1e-3,3e-3,1e-2   # Muon's rate, seed 0

Each arm trains its config as `train.py` would (the project's own loop, evals every `--eval_every` steps) for
each seed. Printed: the final validation loss of each arm (mean and spread over seeds) and the step at which
each run first reaches the AdamW-cosine arm's mean final loss; then the end moved: the WSD run's checkpoint
from its stable phase resumed with steps = 60% of the plan (its cooldown from there), against cosine runs
planned for that length. Runs already finished in --root are read, not trained again. Writes
bench/optimizer_study_<size>.json and docs/optimizer_study.png, one panel for each size's json in bench/.
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


def arms(size: str, muon_rate: float) -> dict[str, dict]:
    """name -> optimizer overrides; the cosine arm is the config as it stands."""
    peak = CONFIGS[size]().optimizer.learning_rate
    wsd = dict(decay="wsd", cooldown_shape="1-sqrt")
    return {"adamw_cosine": {},
            "adamw_3x_wsd": dict(wsd, learning_rate=3 * peak),
            "muon_wsd": dict(wsd, name="muon", learning_rate=muon_rate)}


def run_directory(args, size: str, name: str, seed: int, muon_rate: float) -> str:
    """Muon's runs are kept by their rate: the sweep's seed 0 at the chosen rate is the arm's own, and another
    --muon_rate never reads runs of the last one."""
    return os.path.join(args.root, size, f"{name}_{muon_rate:g}" if name == "muon_wsd" else name, f"seed{seed}")


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


def moved_end(size: str, seed: int, wsd_arm: dict, args) -> list[tuple[int, float]]:
    """The full-length WSD run's latest checkpoint at or before 60% − cooldown (still at its peak), copied and
    resumed with steps = 60% of the plan: the cooldown starts where that resume says."""
    steps = CONFIGS[size]().steps
    short = round(SHORT_FRACTION * steps)
    full = os.path.join(args.root, size, "adamw_3x_wsd", f"seed{seed}")
    workdir = os.path.join(args.root, size, "moved_end", f"seed{seed}")
    config = config_for(size, seed, wsd_arm, steps, args)
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
    parser.add_argument("--muon_rate", type=float, default=3e-3, help="Muon's peak (chosen by --sweep)")
    parser.add_argument("--sweep", default="", help="comma-separated Muon peaks to try on seed 0, e.g. 1e-3,3e-3,1e-2")
    parser.add_argument("--root", default="/tmp/andrea-optimizer-study", help="where the runs' workdirs go")
    args = parser.parse_args()
    size, steps = args.size, CONFIGS[args.size]().steps

    if args.sweep:
        for rate in map(float, args.sweep.split(",")):
            arm = dict(arms(size, rate)["muon_wsd"])
            curve = run(config_for(size, 0, arm, steps, args), run_directory(args, size, "muon_wsd", 0, rate))
            print(f"muon_wsd at {rate:g}: final val loss {curve[-1][1]:.4f}", flush=True)
        return

    curves = {name: [run(config_for(size, seed, arm, steps, args),
                         run_directory(args, size, name, seed, args.muon_rate)) for seed in range(args.seeds)]
              for name, arm in arms(size, args.muon_rate).items()}
    target = statistics.mean(curve[-1][1] for curve in curves["adamw_cosine"])
    short = round(SHORT_FRACTION * steps)
    wsd_arm = arms(size, args.muon_rate)["adamw_3x_wsd"]
    curves["moved_end_wsd"] = [moved_end(size, seed, wsd_arm, args) for seed in range(args.seeds)]
    curves["cosine_planned_short"] = [run(config_for(size, seed, {}, short, args),
                                          os.path.join(args.root, size, "cosine_short", f"seed{seed}"))
                                      for seed in range(args.seeds)]

    print(f"\n{size}, {steps} steps, {args.seeds} seeds; target: adamw_cosine's mean final val loss {target:.4f}")
    print("| arm | final val loss (mean ± sd) | first step at the target (each seed) |")
    print("| --- | --- | --- |")
    for name, runs in curves.items():
        reached = [first_reaching(curve, target) for curve in runs]
        print(f"| {name} (ends at {runs[0][-1][0]}) | {summary([curve[-1][1] for curve in runs])} | "
              f"{', '.join(str(step) if step else '—' for step in reached)} |")
    result = {"size": size, "steps": steps, "target": target, "muon_rate": args.muon_rate,
              "arms": {name: arm for name, arm in arms(size, args.muon_rate).items()}, "curves": curves}
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
