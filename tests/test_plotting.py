"""The run plot: four panels from metrics.jsonl, non-finite values left out, clear errors."""

import json
import os
import subprocess
import sys

import pytest

from andrea_jax.tools import plotting

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_metrics(workdir, records):
    with open(workdir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _records():
    train = [{"step": s, "loss": 9.0 / s ** 0.3, "lr": 1e-3 * min(1, s / 50), "grad_norm": 1.0 + 1 / s,
              "tokens_per_second": 1000.0 + s, "mfu": 0.1} for s in range(10, 210, 10)]
    train[3]["loss"] = "nan"  # how metrics.Writer keeps a non-finite value
    return train + [{"step": 100, "val_loss": 2.5}, {"step": 200, "val_loss": 2.2}]


def test_series_keeps_finite_numbers_only():
    steps, values = plotting.series(_records(), "loss")
    assert len(steps) == 19 and 40 not in steps
    assert values[0] == pytest.approx(9.0 / 10 ** 0.3)
    assert plotting.series(_records(), "val_loss") == ([100, 200], [2.5, 2.2])


def test_plot_run_writes_a_png_in_the_workdir(tmp_path):
    import matplotlib.image

    _write_metrics(tmp_path, _records())
    path = plotting.plot_run(str(tmp_path))
    assert path == str(tmp_path / "metrics.png")
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (770, 1210)  # 11 × 7 inches at 110 dpi
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_a_run_that_scored_hellaswag_gets_its_panel_with_gpt2_as_a_line(tmp_path):
    import matplotlib.image
    import matplotlib.pyplot as plt

    scores = [{"step": s, "hellaswag/acc": a, "hellaswag/acc_norm": n}
              for s, a, n in ((100, 0.26, 0.27), (200, 0.27, 0.29))]
    figure = plotting.figure_of(_records() + scores, "run")
    [panel] = [axis for axis in figure.axes if axis.get_title() == "HellaSwag"]
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in panel.get_lines()}
    assert lines["acc_norm"] == ([100, 200], [0.27, 0.29]) and lines["acc"] == ([100, 200], [0.26, 0.27])
    assert lines["GPT-2 124M acc_norm (0.2955)"][1] == [0.2955, 0.2955]
    plt.close(figure)
    _write_metrics(tmp_path, _records() + scores)
    assert matplotlib.image.imread(plotting.plot_run(str(tmp_path))).shape[:2] == (770, 1815)  # a third column


def test_cli_writes_to_out_and_refuses_an_empty_run(tmp_path):
    _write_metrics(tmp_path, _records())
    command = [sys.executable, "-m", "andrea_jax.tools.plotting", "--workdir"]
    run = lambda *args: subprocess.run(command + list(args), capture_output=True, text=True, cwd=REPO)
    assert run(str(tmp_path), "--out", str(tmp_path / "curves.png")).returncode == 0
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    empty = tmp_path / "empty"
    empty.mkdir()
    for workdir, message in [(empty, "holds no training records yet; train first"),
                             (tmp_path / "nowhere", "nowhere does not exist; pass the directory train.py wrote")]:
        result = run(str(workdir))
        assert result.returncode == 2 and result.stderr.startswith("error: ") and message in result.stderr
        assert "Traceback" not in result.stderr
    assert not (empty / "metrics.png").exists()
