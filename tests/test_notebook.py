"""The Colab notebook runs top to bottom on a CPU in its smoke setting, so it cannot rot unseen."""

import glob
import json
import math
import os
import re
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "colab.ipynb")
TIME_LIMIT_S = 240  # about a minute on an idle 2-core machine; the bound catches a notebook gone heavy


def test_notebook_runs_headless_in_smoke_mode(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    if not os.path.exists(os.path.join(ROOT, "eval.py")):
        pytest.skip("eval.py is not in this tree yet; the notebook's evaluation cell calls it")
    # The kernel and the commands it starts inherit this environment: one CPU device, the smoke setting.
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("ANDREA_NOTEBOOK_SMOKE", "1")
    monkeypatch.setenv("ANDREA_NOTEBOOK_DIR", str(tmp_path))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    started = time.perf_counter()
    nbclient.NotebookClient(notebook, timeout=TIME_LIMIT_S, kernel_name="python3",
                            resources={"metadata": {"path": ROOT}}).execute()
    elapsed = time.perf_counter() - started
    assert elapsed < TIME_LIMIT_S, f"the smoke run took {elapsed:.0f} s"

    workdir = os.path.join(tmp_path, "colab_tiny")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "loss" in r] == [5, 10, 15, 20, 25, 30]
    assert [r["step"] for r in records if "val_loss" in r] == [15, 30]
    assert os.path.getsize(os.path.join(workdir, "metrics.png")) > 10_000
    (report_path,) = glob.glob(os.path.join(workdir, "eval_step*.json"))
    report = json.load(open(report_path))
    assert report["step"] == 30 and report["loss"] < math.log(257)  # learnt something over uniform bytes
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(workdir + "_hf"))
    with open(os.path.join(workdir + "_finetune", "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f][-1] == 10
    outputs = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", []))
    assert "--- sample" in outputs and "resumed from step 0" in outputs
    # What the run chose, and why: on a CPU there is no memory limit to fit, so one micro-batch.
    assert re.search(r"computes in (float32|bfloat16) with 1 micro-batch\(es\) of 8 sequences .* on data from text:",
                     outputs)
