"""Kill soak: a small run killed at random moments, restarted with the same command each time.

    python bench/kill_soak.py --kills 120 [--seed 0] [--out DIR]

Each trial starts a fresh workdir and token cache, so that data preparation can be hit too.
It runs `train.py` and kills it (SIGKILL, or SIGTERM one time in five) at a random moment of a
full run's duration, or aimed: within a second of data preparation starting (a trial's first
attempt), as a checkpoint save is under way, or during an evaluation; after
every kill it runs the same command again, up to --kills-per-trial kills, then lets the run
finish. A finished trial must have logged the losses and validation losses of an unbroken run
bit for bit, and every checkpoint it kept must restore in full (params, optimizer state).
Where each kill landed is read from the workdir at that moment (see `moment_of`). Prints a
table and writes the figures as JSON to DIR/kill_soak.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS, CHECKPOINT_EVERY, EVAL_EVERY = 120, 10, 20
OVERRIDES = ["--config.data.tokenizer=byte", "--config.model.vocab_size=0", "--config.model.dtype=float32",
             "--config.model.n_layer=2", "--config.model.d_model=128", "--config.model.n_head=4",
             "--config.model.mlp_dim=512", "--config.model.max_len=64", "--config.seq_len=64",
             "--config.batch_size=8", f"--config.steps={STEPS}", "--config.log_every=1",
             f"--config.eval_every={EVAL_EVERY}", "--config.eval_batches=8",
             f"--config.checkpoint_every={CHECKPOINT_EVERY}", "--config.keep_checkpoints=3"]


def write_corpus(directory: str) -> str:
    rng = random.Random(0)
    words = [f"{stem}{i}" for stem in ("alpha", "beta", "gamma", "delta") for i in range(40)]
    os.makedirs(directory, exist_ok=True)
    for index in range(20):
        with open(os.path.join(directory, f"part{index:02d}.txt"), "w") as f:
            f.write("\n".join(" ".join(rng.choices(words, k=12)) for _ in range(300)))
    return directory


def command(corpus: str, workdir: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs/tiny.py"),
            "--workdir", workdir, f"--config.data.source=text:{corpus}",
            f"--config.data.cache_dir={os.path.join(workdir, 'cache')}", *OVERRIDES]


def records(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def logged(workdir: str) -> list[tuple[int, str, float]]:
    return [(r["step"], key, r[key]) for r in records(workdir) for key in ("loss", "val_loss") if key in r]


def checkpoint_dirs(workdir: str) -> list[str]:
    directory = os.path.join(workdir, "checkpoints")
    return os.listdir(directory) if os.path.isdir(directory) else []


def moment_of(workdir: str, records_at_start: int) -> str:
    """Where a run is, read from its workdir: no config.json yet is Python's start (imports, flags);
    no data record yet is data preparation; an Orbax
    temporary directory is a checkpoint save; no new record since this attempt started is start-up
    (restore, compilation); a loss at an evaluation step without its val_loss is evaluation."""
    if not os.path.exists(os.path.join(workdir, "config.json")):
        return "process start (imports, flags)"
    if not os.path.exists(os.path.join(workdir, "data.json")):
        return "data preparation"
    if any("orbax-checkpoint-tmp" in name for name in checkpoint_dirs(workdir)):
        return "checkpoint save"
    now = records(workdir)
    if len(now) <= records_at_start:
        return "start-up (restore, compile)"
    last = now[-1]
    if "loss" in last and last["step"] % EVAL_EVERY == 0:
        return "evaluation"
    return "training steps"


def restores_every_checkpoint(workdir: str) -> list[str]:
    """The kept steps that fail to restore in full (params and optimizer state), with why."""
    import flax.linen as nn
    import jax

    from andrea_jax import checkpoint, first_line, fit, run_dir, sharding

    saver = checkpoint.Checkpointer(workdir, read_only=True)
    failures = []
    try:
        steps = saver.steps()
        if not steps:
            return ["no checkpoint kept"]
        config = run_dir.load_saved_config(workdir)  # config.json: as the run resolved it
        mesh = sharding.make_mesh(config, jax.devices()[:1])
        rules = sharding.rules(config)
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            abstract, _ = fit.abstract_state(config, mesh, rules, jax.random.key(config.seed))
            for step in steps:
                try:
                    state, meta = saver.restore(abstract, step=step)
                    if meta["step"] != step or set(state) != set(abstract) - {"step"}:
                        failures.append(f"step {step}: restored {sorted(state)} at meta step {meta['step']}")
                except Exception as error:  # noqa: BLE001 - every failure is a finding
                    failures.append(f"step {step}: {first_line(error)}")
    finally:
        saver.close()
    return failures


def wait_until(process: subprocess.Popen, condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline and not condition():
        time.sleep(0.002)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=120)
    parser.add_argument("--kills-per-trial", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="where the trials' workdirs go (default: a new temp dir)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="kill_soak_")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    corpus = write_corpus(os.path.join(out, "corpus"))
    rng = random.Random(args.seed)

    reference_dir = os.path.join(out, "unbroken")
    started = time.monotonic()
    subprocess.run(command(corpus, reference_dir), env=env, check=True, capture_output=True)
    duration = time.monotonic() - started
    reference = logged(reference_dir)
    print(f"unbroken run: {duration:.1f} s, {len(reference)} logged values", flush=True)

    landed = collections.Counter()
    failures: list[str] = []
    kills = trials = restarts = 0
    while kills < args.kills:
        workdir = os.path.join(out, f"trial{trials:03d}")
        trials += 1
        kills_here = 0
        while True:
            records_at_start = len(records(workdir))
            process = subprocess.Popen(command(corpus, workdir), env=env, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True)
            if kills_here < args.kills_per_trial:
                # Aimed kills: the phases a uniform moment rarely hits (data preparation is only
                # there on a trial's first attempt; evaluation is short).
                aim = rng.choices(["prepare", "save", "evaluation", "any"],
                                  [3 if kills_here == 0 else 0, 3, 2, 4])[0]
                if aim == "prepare":
                    wait_until(process, lambda: os.path.exists(os.path.join(workdir, "config.json")), duration)
                    time.sleep(rng.uniform(0, 1.0))
                elif aim == "save":
                    wait_until(process, lambda: any("orbax-checkpoint-tmp" in name
                                                    for name in checkpoint_dirs(workdir)), duration)
                    time.sleep(rng.uniform(0, 0.05))
                elif aim == "evaluation":
                    wait_until(process, lambda: moment_of(workdir, records_at_start) == "evaluation", duration)
                else:
                    wait_until(process, lambda: False, rng.uniform(0, duration))
                if process.poll() is None:
                    moment = moment_of(workdir, records_at_start)
                    kind = signal.SIGTERM if rng.random() < 0.2 else signal.SIGKILL
                    process.send_signal(kind)
                    process.communicate()
                    landed[(moment, kind.name)] += 1
                    kills += 1
                    kills_here += 1
                    restarts += 1
                    continue
            _, stderr = process.communicate()
            if process.returncode != 0:
                last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
                failures.append(f"{workdir}: exit {process.returncode} after {kills_here} kills: {last}")
            break
        if logged(workdir) != reference:
            failures.append(f"{workdir}: logged values differ from the unbroken run's")
        failures += [f"{workdir}: {why}" for why in restores_every_checkpoint(workdir)]
        print(f"trial {trials}: {kills_here} kills, {kills} in all, {len(failures)} failures", flush=True)

    summary = {"trials": trials, "kills": kills, "restarts": restarts,
               "landed": {f"{moment} / {kind}": count for (moment, kind), count in sorted(landed.items())},
               "failures": failures, "unbroken_seconds": round(duration, 1)}
    with open(os.path.join(out, "kill_soak.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("| where the kill landed | signal | kills |\n| --- | --- | --- |")
    for (moment, kind), count in sorted(landed.items()):
        print(f"| {moment} | {kind} | {count} |")
    print(f"{trials} trials, {kills} kills, {len(failures)} failures")
    for failure in failures:
        print("FAILED", failure)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
