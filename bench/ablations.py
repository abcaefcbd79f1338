"""The ablation study: each design choice of ANDREA switched off in turn, trained from the same seed.

    python bench/ablations.py                 # the full study: 300 steps a variant, about 20 minutes on 2 CPU cores
    python bench/ablations.py --steps 50 --only baseline,post   # a quick look
    python bench/ablations.py --source text:PATH/input.txt      # offline: a copy of the shakespeare_char text

Every variant is the shakespeare_char recipe (4 layers, d_model 128, 4 heads, char
tokens, batch 12 × 64, AdamW at 1e-3 with cosine decay) with one switch changed,
trained on the same batches from the same seed for the same number of steps with the
project's own train step (diagnostics on). The deep variants have 24 thin layers
(d_model 64) and scan over depth. Writes ABLATIONS.md (the table, with the command as run), ablations.png
(loss curves) and ablations.json (every curve and per-block figure) into runs/ablations; `--out bench`
replaces the committed bench/ABLATIONS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from andrea_jax import diagnostics, model, optimizer, sharding, train_step  # noqa: E402
from andrea_jax.tools import logit_lens, parameter_table
from andrea_jax.config import base_config, validate  # noqa: E402
from andrea_jax.data import DataError, batcher, eras, pipeline  # noqa: E402
from configs import shakespeare_char  # noqa: E402


def by_depth(records: dict, name: str) -> list[float]:
    """The values of one statistic ("grad_norm", "attn_delta_ratio", ...) in depth order, from flat keys."""
    prefix = f"{diagnostics.PREFIX}{name}/"
    found = {int(key.rsplit("_", 1)[1]): float(value) for key, value in records.items() if key.startswith(prefix)}
    return [found[i] for i in sorted(found)]


HERE = os.path.dirname(os.path.abspath(__file__))
DEEP = dict(n_layer=24, d_model=64, n_head=4, mlp_dim=256, scan_layers=True)

# name -> (what changes, model overrides, optimizer overrides, plot panel)
VARIANTS = {
    "baseline": ("ANDREA: pre-norm, residual, tanh-GELU, 4× MLP, warmup", {}, {}, 0),
    "pre_no_warmup": ("pre-norm, no warmup", {}, dict(warmup_steps=0), 0),
    "post": ("post-norm, warmup", dict(norm_position="post"), {}, 0),
    "post_no_warmup": ("post-norm, no warmup", dict(norm_position="post"), dict(warmup_steps=0), 0),
    "no_residual": ("no residual connections", dict(residual=False), {}, 1),
    "deep24": ("24 layers × d_model 64", DEEP, {}, 1),
    "deep24_no_residual": ("24 layers × 64, no residuals", dict(DEEP, residual=False), {}, 1),
    "deep24_post_no_warmup": ("24 layers × 64, post-norm, no warmup", dict(DEEP, norm_position="post"),
                              dict(warmup_steps=0), 1),
    "relu": ("ReLU", dict(activation="relu"), {}, 2),
    "gelu_exact": ("exact (erf) GELU", dict(activation="gelu_exact"), {}, 2),
    "swiglu": ("SwiGLU, 8/3× (320)", dict(activation="swiglu"), {}, 2),
    "mlp_2x": ("2× MLP", dict(mlp_ratio=2.0), {}, 2),
    "mlp_8x": ("8× MLP", dict(mlp_ratio=8.0), {}, 2),
}
PANELS = ("norm position and warmup", "residuals and depth", "activation and MLP width")
LENS_TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun."


def study_config(steps: int, model_overrides: dict, optimizer_overrides: dict, source: str = ""):
    c = base_config()
    m = c.model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim, m.max_len, m.vocab_size = 4, 128, 4, 512, 64, 0
    m.update(model_overrides)
    c.seq_len, c.batch_size, c.steps = 64, 12, steps
    c.diagnostics = True
    o = c.optimizer
    o.learning_rate, o.min_learning_rate_ratio, o.warmup_steps, o.b2, o.weight_decay = 1e-3, 0.1, 100, 0.99, 0.1
    o.update(optimizer_overrides)
    recipe = shakespeare_char.get_config().data  # its text (downloaded once), characters, 90/10
    c.data.tokenizer, c.data.val_fraction = recipe.tokenizer, recipe.val_fraction
    c.data.source = source or recipe.source
    return c


def train_variant(config, prepared, eval_every: int, eval_batches: int) -> dict:
    """Trains one variant; returns its curves and per-block figures."""
    mesh = sharding.make_mesh(config, jax.devices()[:1])
    tx = optimizer.make(config)
    schedule = optimizer.learning_rate_schedule(config)
    record = {"train_loss": [], "val": [], "grad_norm": [], "diverged_at": None}
    # Windows drawn at random, as every variant of the committed table was trained.
    reader = eras.Reader(prepared.train, config.seed, config.seq_len, 0, False, order="random")
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.rules(config)):
        state = jax.jit(lambda rng: sharding.unbox(train_step.init_state(rng, config, tx)))(jax.random.key(config.seed))
        step_fn = jax.jit(train_step.make_train_step(config, tx, schedule), donate_argnums=0)
        eval_fn = jax.jit(train_step.make_eval_step(config))

        def validate_now(params) -> float:
            losses = [eval_fn(params, batcher.val_batch(prepared.val.tokens, index=i, batch_size=config.batch_size,
                                                        seq_len=config.seq_len)) for i in range(eval_batches)]
            return float(np.mean(jax.device_get(losses)))

        record["val"].append((0, validate_now(state["params"])))
        start = time.perf_counter()
        for step in range(config.steps):
            batch = reader.batch(step, config.batch_size)
            state, metrics = step_fn(state, batch)
            metrics = jax.device_get(metrics)
            if step == 0:
                record["diag_first"] = {k: float(v) for k, v in metrics.items() if k.startswith(diagnostics.PREFIX)}
            record["train_loss"].append(float(metrics["loss"]))
            record["grad_norm"].append(float(metrics["grad_norm"]))
            if not metrics["finite"]:
                record["diverged_at"] = step + 1
                break
            if (step + 1) % eval_every == 0 or step + 1 == config.steps:
                record["val"].append((step + 1, validate_now(state["params"])))
        record["diag_last"] = {k: float(v) for k, v in metrics.items() if k.startswith(diagnostics.PREFIX)}
        record["seconds"] = time.perf_counter() - start
        record["params"] = parameter_table.count(state["params"])
        if record["diverged_at"] is None:
            ids = prepared.tokenizer.encode(LENS_TEXT)[-config.model.max_len:]
            lens = logit_lens.logit_lens(state["params"], config.model, ids)
            record["lens_loss_by_depth"] = [float(x) for x in lens.target_loss.mean(-1)]
    return record


def init_check() -> dict:
    """The full ANDREA-120M at initialisation: how much each sub-layer writes relative to the stream."""
    m = base_config().model
    params = jax.jit(lambda rng: nn.meta.unbox(model.init_params(m, rng)))(jax.random.key(0))
    ids = np.random.default_rng(0).integers(0, m.vocab_size, (2, 128))
    apply = jax.jit(lambda p, x: model.Transformer(m).apply({"params": p}, x, mutable=[model.DIAGNOSTICS])[1])
    stats = jax.device_get(diagnostics.stream_stats(apply(params, ids)[model.DIAGNOSTICS], m))
    return {k: [float(x) for x in v] for k, v in stats.items()}


def summarise(name: str, record: dict, vocab: int) -> dict:
    vals = [v for _, v in record["val"]]
    best_step, best = min(record["val"][1:] or record["val"], key=lambda sv: sv[1])
    final = vals[-1]
    diverged = record["diverged_at"] is not None or not math.isfinite(final) or final >= math.log(vocab)
    first = by_depth(record["diag_first"], "grad_norm")
    last = by_depth(record["diag_last"], "grad_norm")
    return dict(name=name, params=record["params"], final=final, best=best, best_step=best_step, diverged=diverged,
                g0_first=first[0], g0_last=last[0], g_ratio_first=first[-1] / max(first[0], 1e-30),
                seconds=record["seconds"])


def plot(results: dict, out_png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5), sharey=True)
    for name, (described, _, _, panel) in VARIANTS.items():
        if name not in results:
            continue
        record = results[name]
        losses = np.asarray(record["train_loss"])
        window = 25
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid") if len(losses) > window else losses
        line, = axes[panel].plot(np.arange(len(smooth)) + (len(losses) - len(smooth)) + 1, smooth, lw=1, alpha=0.6)
        steps, vals = zip(*record["val"])
        axes[panel].plot(steps, vals, "o-", color=line.get_color(), ms=3, label=f"{name}: {described}")
    for ax, title in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylim(1.3, 4.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("loss (line: train, 25-step mean; dots: validation)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def write_markdown(path: str, rows: list[dict], results: dict, init: dict, args, seconds: float) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "andrea_jax", "bench/ablations.py"], cwd=HERE,
                           capture_output=True, text=True).stdout.strip()
    lines = [
        "# Ablations", "",
        f"Command: `python bench/ablations.py {' '.join(shlex.quote(argument) for argument in sys.argv[1:])}`  ",
        f"Date: {datetime.date.today()}; machine: {platform.machine()}, {os.cpu_count()} CPU cores "
        f"({jax.devices()[0].device_kind}, shared with other jobs), jax {jax.__version__}; "
        f"git commit {commit}{' (+ local changes)' if dirty else ''}; whole study {seconds / 60:.1f} min.", "",
        f"Each variant: the shakespeare_char recipe (4 layers, d_model 128, 4 heads, MLP 512, char tokens, "
        f"batch 12 × 64 tokens, AdamW lr 1e-3 cosine to 1e-4, 100 warmup steps unless stated, clip 1.0) with one "
        f"switch changed, {args.steps} steps from seed 0 on the same batches. Validation loss: the mean over the first "
        f"{args.eval_batches} validation batches (of 12 × 64), every {args.eval_every} steps. Diverged: a non-finite "
        f"step, or a final validation loss no better than uniform (ln vocab). Grad norm block 0: the gradient norm of the "
        f"first block at step 1 and at the last step; last/first: the last block's over the first's at step 1; s: wall-clock seconds of the run, compilation included.", "",
        "| variant | change | params | final val | best val (step) | diverged | grad norm block 0, step 1 → last | "
        "grad norm last/first block, step 1 | s |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | {VARIANTS[r['name']][0]} | {r['params']:,} | {r['final']:.4f} | "
                     f"{r['best']:.4f} ({r['best_step']}) | {'yes' if r['diverged'] else 'no'} | "
                     f"{r['g0_first']:.3g} → {r['g0_last']:.3g} | {r['g_ratio_first']:.3g} | {r['seconds']:.0f} |")
    lines += ["", "![loss curves](ablations.png)", ""]
    if "baseline" in results:
        b = results["baseline"]
        lines += ["## Inside the baseline", "",
                  "Per block, at step 1 and at the last step: ‖Δ_attn‖/‖x‖, ‖Δ_mlp‖/‖x‖ (each sub-layer's output "
                  "norm over the norm of the stream it reads) and the stream norm after the block.", "",
                  "| block | attn Δ step 1 | attn Δ last | mlp Δ step 1 | mlp Δ last | ‖x‖ step 1 | ‖x‖ last |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        first, last = b["diag_first"], b["diag_last"]
        for i, (a0, a1, m0, m1, x0, x1) in enumerate(zip(
                by_depth(first, "attn_delta_ratio"), by_depth(last, "attn_delta_ratio"),
                by_depth(first, "mlp_delta_ratio"), by_depth(last, "mlp_delta_ratio"),
                by_depth(first, "stream_norm")[1:], by_depth(last, "stream_norm")[1:])):
            lines.append(f"| {i} | {a0:.3f} | {a1:.3f} | {m0:.3f} | {m1:.3f} | {x0:.3f} | {x1:.3f} |")
        lines += ["", f"Embedding stream norm: {by_depth(first, 'stream_norm')[0]:.3f} at step 1, "
                      f"{by_depth(last, 'stream_norm')[0]:.3f} at the end.", ""]
        lens_rows = {n: r["lens_loss_by_depth"] for n, r in results.items() if "lens_loss_by_depth" in r}
        lines += ["## Logit lens after training", "",
                  f"Mean loss of the real next character at each depth (LN_f and the tied output applied to the "
                  f"stream after the embedding and after each block) over the last 64 characters of "
                  f"{json.dumps(LENS_TEXT)}.", "",
                  "| variant | " + " | ".join(["embed"] + [f"block {i}" for i in range(4)]) + " |",
                  "| --- |" + " ---: |" * 5]
        for n, losses in lens_rows.items():
            if len(losses) == 5:
                lines.append(f"| {n} | " + " | ".join(f"{x:.3f}" for x in losses) + " |")
        deep = [(n, r) for n, r in lens_rows.items() if len(r) == 25]
        for n, losses in deep:
            lines.append("")
            lines.append(f"{n}, every 4th depth: " + ", ".join(f"{d}: {losses[d]:.3f}" for d in range(0, 25, 4)))
        lines.append("")
    if init:
        lines += ["## ANDREA-120M at initialisation", "",
                  "The full-size model (12 × 768), GPT-2 init, random tokens (2 × 128): each sub-layer's output "
                  "norm relative to the stream it reads, and the stream norm after each block.", "",
                  "| block | " + " | ".join(str(i) for i in range(12)) + " |", "| --- |" + " ---: |" * 12,
                  "| attn ‖Δ‖/‖x‖ | " + " | ".join(f"{x:.2f}" for x in init["attn_delta_ratio"]) + " |",
                  "| mlp ‖Δ‖/‖x‖ | " + " | ".join(f"{x:.2f}" for x in init["mlp_delta_ratio"]) + " |",
                  "| ‖x‖ after | " + " | ".join(f"{x:.2f}" for x in init["stream_norm"][1:]) + " |", "",
                  f"Embedding stream norm: {init['stream_norm'][0]:.3f}.", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval_every", type=int, default=50)
    parser.add_argument("--eval_batches", type=int, default=10)
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    parser.add_argument("--out", default=os.path.join(HERE, "..", "runs", "ablations"),
                        help="directory for ABLATIONS.md, ablations.png, ablations.json (default: runs/ablations; "
                             "--out bench replaces the committed study)")
    parser.add_argument("--workdir", default="", help="where the tokenizer goes (default: a temporary directory)")
    parser.add_argument("--source", default="", help="data.source (default: the shakespeare_char recipe's "
                                                       "download; offline, text:PATH to a copy of its input.txt)")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    started = time.perf_counter()
    workdir = args.workdir or tempfile.mkdtemp(prefix="andrea_ablations_")
    base = study_config(args.steps, {}, {}, args.source)
    validate(base)
    try:
        prepared = pipeline.prepare(base, workdir)
    except DataError as error:  # offline, most often: the fix in this script's own flag
        parser.exit(2, f"error: {str(error).replace('--config.data.source=', '--source ')}\n")
    results, rows = {}, []
    for name in names:
        described, model_overrides, optimizer_overrides, _ = VARIANTS[name]
        config = study_config(args.steps, model_overrides, optimizer_overrides, args.source)
        config.model.vocab_size = prepared.tokenizer.vocab_size
        validate(config)
        record = train_variant(config, prepared, args.eval_every, args.eval_batches)
        results[name] = record
        rows.append(summarise(name, record, prepared.tokenizer.vocab_size))
        r = rows[-1]
        print(f"{name:<24} final val {r['final']:.4f}  best {r['best']:.4f}@{r['best_step']}  "
              f"diverged {r['diverged']}  |g0| {r['g0_first']:.3g}->{r['g0_last']:.3g}  {r['seconds']:.0f}s",
              flush=True)
    init = init_check() if not args.only else {}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ablations.json"), "w") as f:
        json.dump({"results": results, "init_check": init}, f)
    plot(results, os.path.join(args.out, "ablations.png"))
    write_markdown(os.path.join(args.out, "ABLATIONS.md"), rows, results, init, args, time.perf_counter() - started)
    print(f"wrote {args.out}/ABLATIONS.md, ablations.png, ablations.json in {(time.perf_counter() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
