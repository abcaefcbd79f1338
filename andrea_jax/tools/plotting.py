"""A run at a glance: python -m andrea_jax.tools.plotting --workdir runs/tiny

Draws four panels from the workdir's metrics.jsonl into <workdir>/metrics.png:
training and validation loss (log scale, where the early drop and the late
slope both show), learning rate, tokens per second, and gradient norm; a fifth,
HellaSwag's accuracy, for a run that scored it, with GPT-2 124M's as a line.
"""

from __future__ import annotations

import math
import os

from absl import flags

from andrea_jax import UserError, metrics

PLOT_FILE = "metrics.png"
# GPT-2 124M's HellaSwag acc_norm, completion style (llm.c's evaluation): the yardstick of this size.
GPT2_124M_HELLASWAG = 0.2955


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`, finite numbers only (a non-finite value is logged as a string)."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(int(record["step"]))
            values.append(float(value))
    return steps, values


def plot_run(workdir: str, path: str | None = None) -> str:
    """Writes the run's curves to `path` (default <workdir>/metrics.png) and returns the path."""
    import matplotlib
    matplotlib.use("Agg")  # files only: works headless and inside notebooks alike
    import matplotlib.pyplot as plt

    if not os.path.isdir(workdir):
        raise UserError(f"--workdir {workdir} does not exist; pass the directory train.py wrote")
    records = metrics.read(workdir)
    if not series(records, "loss")[0]:
        where = os.path.join(workdir, metrics.METRICS_FILE)
        raise UserError(f"{where} holds no training records yet; train first "
                         f"(python train.py --workdir {workdir} ...), one is written every log_every steps")
    figure = figure_of(records, os.path.basename(os.path.abspath(workdir)))
    path = path or os.path.join(workdir, PLOT_FILE)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def figure_of(records: list[dict], name: str):
    """The panels of a run's records (with training losses among them), as a matplotlib Figure."""
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    train_steps, train_loss = series(records, "loss")
    val_steps, val_loss = series(records, "val_loss")
    hellaswag_steps, hellaswag_acc_norm = series(records, "hellaswag/acc_norm")

    columns = 3 if hellaswag_steps else 2
    figure, axes = plt.subplots(2, columns, figsize=(5.5 * columns, 7), sharex=True, squeeze=False)
    loss_axis, lr_axis, speed_axis, grad_axis = (axes[row, column] for row in range(2) for column in range(2))
    if hellaswag_steps:
        hellaswag_axis = axes[0, 2]
        hellaswag_axis.plot(hellaswag_steps, hellaswag_acc_norm, "o-", color="tab:red", label="acc_norm")
        hellaswag_axis.plot(*series(records, "hellaswag/acc"), "s--", color="tab:gray", label="acc")
        hellaswag_axis.axhline(GPT2_124M_HELLASWAG, color="black", linestyle=":",
                               label=f"GPT-2 124M acc_norm ({GPT2_124M_HELLASWAG})")
        hellaswag_axis.axhline(0.25, color="tab:gray", linewidth=0.8, label="chance (0.25)")
        hellaswag_axis.set(title="HellaSwag", ylabel="accuracy")
        hellaswag_axis.legend()
        axes[1, 2].axis("off")
    loss_axis.plot(train_steps, train_loss, label="train", color="tab:blue")
    if val_steps:
        loss_axis.plot(val_steps, val_loss, "o-", label="validation", color="tab:orange")
        best = min(range(len(val_loss)), key=val_loss.__getitem__)
        loss_axis.annotate(f"{val_loss[best]:.3f}", (val_steps[best], val_loss[best]),
                           textcoords="offset points", xytext=(0, 8), ha="center", color="tab:orange")
    loss_axis.set(title="loss", ylabel="cross-entropy (nats per token, log scale)", yscale="log")
    loss_axis.legend()

    for axis, key, title, ylabel, log in (
            (lr_axis, "lr", "learning rate", "learning rate", False),
            (speed_axis, "tokens_per_second", "throughput", "tokens / s", False),
            (grad_axis, "grad_norm", "gradient norm (before clipping)", "global L2 norm (log scale)", True)):
        steps, values = series(records, key)
        axis.plot(steps, values, color="tab:green" if key == "lr" else "tab:purple")
        axis.set(title=title, ylabel=ylabel)
        if log and values and min(values) > 0:
            axis.set_yscale("log")
    for axis in axes.ravel():
        if axis.get_yscale() == "log":  # ticks labelled 2, 3, 5 rather than 2×10⁰: a loss curve spans about a decade
            axis.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)))
            axis.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            axis.yaxis.set_minor_formatter(ticker.NullFormatter())
        axis.grid(True, which="both", alpha=0.3)
    for axis in (*axes[1, :2], *axes[0, 2:]):
        axis.set_xlabel("step")
        axis.xaxis.set_tick_params(labelbottom=True)
    figure.suptitle(f"{name}: {train_steps[-1]} steps, "
                    f"last train loss {train_loss[-1]:.3f}"
                    + (f", last val loss {val_loss[-1]:.3f}" if val_loss else ""))
    figure.tight_layout()
    return figure


def main(argv: list[str]) -> None:
    del argv
    from andrea_jax.runtime import cli, storage

    def plot() -> None:
        with storage.WorkingCopy(flags.FLAGS.workdir, owns=lambda name: name == PLOT_FILE) as copy:
            print(f"wrote {storage.shown(plot_run(copy.local, flags.FLAGS.out))}")

    cli.run(plot, join_cluster=False)


if __name__ == "__main__":
    from andrea_jax.runtime import cli

    flags.DEFINE_string("workdir", None, "run directory written by train.py")
    flags.DEFINE_string("out", None, f"PNG path (default: <workdir>/{PLOT_FILE})")
    flags.mark_flags_as_required(["workdir"])
    cli.run_app(main)
