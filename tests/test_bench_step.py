"""bench/bench_step.py end to end on the smallest case: its table's arithmetic, not its speed."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_step_reports_consistent_rates_for_every_contender(tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    result = subprocess.run(
        [sys.executable, "bench/bench_step.py", "--only", "shakespeare", "--dtypes", "float32,bfloat16",
         "--rounds", "2", "--rep-seconds", "0.05", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())
    steps = {r["impl"]: r for r in rows if "step_s" in r}
    has_torch = importlib.util.find_spec("torch") is not None
    expected = {"jax float32", "jax bfloat16"} | (
        {"torch eager float32", "torch eager bfloat16"} if has_torch else set())
    assert set(steps) == expected
    assert {r["impl"] for r in rows if "gflops" in r} == {"matmul float32", "matmul bfloat16"}
    tokens = 12 * 64  # configs/shakespeare_char.py: batch 12, context 64
    for r in steps.values():
        assert r["step_s"] > 0 and len(r["samples"]) == 2
        assert math.isclose(r["tokens_per_s"], tokens / r["step_s"], rel_tol=1e-9)
        assert math.isclose(r["mfu_nanogpt"], r["gflops_nanogpt"] * 1e9 / (r["peak_gflops"] * 1e9), rel_tol=1e-9)
        dtype = r["impl"].split()[-1]
        assert r["peak_source"] == f"measured {dtype} matmul"
    if has_torch:
        assert steps["torch eager float32"]["speed_vs_torch"] == 1.0
        for r in steps.values():
            same = steps["torch eager " + r["impl"].split()[-1]]["step_s"]
            assert math.isclose(r["speed_vs_torch_same_dtype"], same / r["step_s"], rel_tol=1e-9)
            assert math.isclose(r["speed_vs_torch"], steps["torch eager float32"]["step_s"] / r["step_s"],
                                rel_tol=1e-9)
    assert "| jax bfloat16 |" in result.stdout  # the Markdown table for RESULTS.md


def test_torch_worker_answers_each_request_and_reports_errors_as_replies():
    pytest.importorskip("torch")
    sys.path.insert(0, ROOT)
    from bench import harness, torch_worker
    config = harness.make_case("shakespeare", dtype="float32")
    config.batch_size = 2
    requests = [dict(op="build", label="a", config=config.to_json(), compile=False),
                dict(op="run", label="a", steps=2),
                dict(op="run", label="missing", steps=1),
                dict(op="fly")]
    replies = []
    torch_worker.serve([json.dumps(r) for r in requests], replies.append)
    assert len(replies) == 4
    assert replies[0]["first_s"] > 0 and replies[1]["step_s"] > 0
    assert replies[2] == {"error": "KeyError: 'missing'"}
    assert replies[3] == {"error": "unknown op 'fly'"}
