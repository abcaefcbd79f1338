"""eval.py and andrea_jax/evaluate.py: a run trained on 8 devices, scored and sampled on 1 or 8."""

import json
import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from andrea_jax import checkpoint, evaluate, metrics, run_dir, train_loop, train_step
from andrea_jax.config import ConfigError
from andrea_jax.data.tokenizer import CharTokenizer
from tests.test_checkpoint import tiny_config
from tests.test_sampling import greedy_without_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run trained on 8 devices over a (2, 2, 2) mesh; checkpoints at steps 5 and 10."""
    tmp_path = tmp_path_factory.mktemp("eval")
    config = tiny_config(tmp_path, steps=10, eval_every=5, eval_batches=2, peak_flops=1e12,
                         **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    workdir = str(tmp_path / "run")
    train_loop.train(config, workdir)
    return workdir


def run_eval(*args, devices=1):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


def val_manifest(workdir):
    data = json.load(open(os.path.join(workdir, "data.json")))
    return json.load(open(os.path.join(data["validation_directory"], "val.json")))


def test_eval_py_on_one_device_reports_loss_perplexity_bits_per_byte_a_sample_a_trace_and_the_plot(trained):
    # One launch for all of eval.py's outputs: each start costs seconds of imports before any work.
    result = run_eval("--workdir", trained, "--prompt", "the ", "--temperature", "0", "--max_new_tokens", "20",
                      "--trace", "the tea", "--plot")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "step 10: val loss" in out and "perplexity" in out and "bits per byte" in out
    assert "over 1 cpu device(s)" in out

    report = json.load(open(os.path.join(trained, "eval_step10.json")))
    # The same two validation batches the training loop scored at step 10 on 8 devices.
    logged = [r["val_loss"] for r in metrics.read(trained) if r["step"] == 10 and "val_loss" in r]
    assert report["loss"] == pytest.approx(logged[0], rel=1e-5)
    assert report["tokens"] == 2 * 8 * 32 and report["batches"] == 2 and report["dtype"] == "float32"
    assert report["perplexity"] == pytest.approx(math.exp(report["loss"]), rel=1e-12)
    manifest = val_manifest(trained)
    assert (report["split_tokens"], report["split_bytes"]) == (manifest["num_tokens"], manifest["num_bytes"])
    evaluated_bytes = manifest["num_bytes"] * report["tokens"] / manifest["num_tokens"]
    assert report["bits_per_byte"] == pytest.approx(
        report["loss"] * report["tokens"] / (evaluated_bytes * math.log(2)), rel=1e-12)
    assert 0.5 < report["bits_per_byte"] < 8  # a char model early in training: a few bits a byte
    logged = [r["val_bits_per_byte"] for r in metrics.read(trained) if r["step"] == 10 and "val_loss" in r]
    assert report["bits_per_byte"] == pytest.approx(logged[0], rel=1e-5)  # as training logged it

    sample = out.split("--- sample (temperature 0.0, top_k 200, top_p 1.0, seed 0) ---\n")[1]
    sample = sample.split("\nlogit lens over ")[0].rstrip("\n")  # the trace's table follows the sample
    assert sample.startswith("the ") and 4 < len(sample) <= 4 + 20  # one character a token

    rows = [line for line in out.splitlines() if line.split()[:2] in (["0", "embed"], ["1", "block_0"],
                                                                      ["2", "block_1"])]
    assert len(rows) == 3  # the tiny model has 2 blocks: embedding + one row per block
    for name in ("trace_step10.png", "metrics.png"):
        path = os.path.join(trained, name)
        assert os.path.getsize(path) > 10_000
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_whole_split_and_an_older_step(trained):
    config = evaluate.run_config(trained)
    restored = evaluate.restore(trained, config, step=5)
    assert restored.step == 5 and restored.mesh.devices.size == 8
    split = evaluate.validation_split(restored.config, restored.tokenizer)
    report = evaluate.score(restored, split, batches=0)

    windows = (split.num_tokens - 1) // 32
    assert windows % 8, "the split should end in a partial batch, to test the padding rows"
    assert report["tokens"] == windows * 32 and report["batches"] == -(-windows // 8)
    assert report["fraction_of_split"] == pytest.approx(windows * 32 / split.num_tokens)
    # Independently: every window in one unsharded batch.
    windows_NxLp1 = np.stack([split.tokens[i * 32:i * 32 + 33] for i in range(windows)]).astype(np.int32)
    params = jax.device_get(restored.params)
    expected = float(jax.jit(lambda p, b: train_step.token_losses(p, restored.config.model, b)[0].mean())(
        params, windows_NxLp1))
    assert report["loss"] == pytest.approx(expected, rel=1e-5)
    newest = evaluate.score(evaluate.restore(trained, config), split, batches=0)
    assert newest["step"] == 10 and newest["loss"] < report["loss"]


def test_greedy_sample_follows_the_model(trained):
    restored = evaluate.restore(trained, evaluate.run_config(trained))
    text = evaluate.continue_text(restored, "the ", max_new_tokens=12, temperature=0.0, top_k=0, top_p=1.0,
                                  seed=0)
    tokenizer = restored.tokenizer
    reference = greedy_without_cache(jax.device_get(restored.params), restored.config.model,
                                              tokenizer.encode("the "), 12)
    if tokenizer.eot_id in reference:
        reference = reference[:reference.index(tokenizer.eot_id)]
    assert text == tokenizer.decode(reference)


def test_sampling_without_end_of_text_runs_to_the_budget_and_says_so(tmp_path, capsys):
    """nanoGPT's char vocabulary (as an import of its meta.pkl gives) has no end-of-text to stop at."""
    from andrea_jax import model, sharding

    tokenizer = CharTokenizer("the quick brown fox", end_of_text=False)
    config = tiny_config(tmp_path)
    config.model.vocab_size = tokenizer.vocab_size
    shapes = sharding.unbox(jax.eval_shape(lambda key: model.init_params(config.model, key), jax.random.key(0)))
    params = jax.tree.map(lambda s: np.random.default_rng(0).normal(0, 0.5, s.shape).astype(s.dtype), shapes)
    restored = evaluate.Restored(params, 0, config, tokenizer, sharding.make_mesh(config, jax.devices()[:1]))
    sample = evaluate.continue_text(restored, "the ", max_new_tokens=9, temperature=1.0, top_k=0, top_p=1.0, seed=0)
    assert len(sample) == 9 and "no end-of-text token, so the sample cannot stop early" in capsys.readouterr().out
    with pytest.raises(evaluate.EvalError, match="pass a --prompt"):
        evaluate.continue_text(restored, "", max_new_tokens=9, temperature=1.0, top_k=0, top_p=1.0, seed=0)


@pytest.mark.slow
def test_a_tokenizer_without_end_of_text_trains_and_scores(tmp_path):
    config = tiny_config(tmp_path, steps=2, eval_every=2, log_every=1, checkpoint_every=2)
    corpus = config.data.source.removeprefix("text:")
    text = "".join(open(os.path.join(corpus, name)).read() for name in sorted(os.listdir(corpus)))
    CharTokenizer(text, end_of_text=False).save(tmp_path / "nanogpt_chars.json")
    config.data.tokenizer = str(tmp_path / "nanogpt_chars.json")
    workdir = str(tmp_path / "run")
    train_loop.train(config, workdir, devices=jax.devices()[:1])
    restored = evaluate.restore(workdir, evaluate.run_config(workdir))
    assert restored.step == 2 and restored.tokenizer.eot_id is None
    assert restored.config.model.vocab_size == len(set(text))
    split = evaluate.validation_split(restored.config, restored.tokenizer)
    assert split.num_tokens == split.num_bytes  # one token per (ASCII) character, no separators
    assert np.isfinite(evaluate.score(restored, split, batches=1)["loss"])


def test_helpshort_says_what_config_takes():
    result = subprocess.run([sys.executable, "eval.py", "--helpshort"], capture_output=True, text=True, timeout=60,
                            cwd=ROOT)
    help_text = " ".join(result.stdout.split())
    assert "--config: A config file such as configs/tiny.py, replacing the run's config.json (default: that file); " \
           "--config.x=y changes a key of either" in help_text, result.stdout
    assert "ConfigDict instance" not in help_text


def test_missing_workdir_and_bad_flags_fail_with_one_line(tmp_path):
    for args, message in [
        (["--workdir", str(tmp_path / "nowhere")], f"--workdir {tmp_path / 'nowhere'} does not exist"),
        (["--workdir", str(tmp_path), "--top_p", "0"], "--top_p=0.0: must be in (0, 1]"),
    ]:
        result = run_eval(*args)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [f"error: {result.stderr.strip()[7:]}"]
        assert message in result.stderr and "Traceback" not in result.stderr


def test_a_step_that_does_not_exist_fails_with_one_line_and_writes_nothing(trained):
    before = sorted(os.listdir(trained))
    result = run_eval("--workdir", trained, "--step", "7")
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: no checkpoint for step 7 in {trained}/checkpoints; available steps: 5, 10"]
    assert "Traceback" not in result.stderr
    assert sorted(os.listdir(trained)) == before


def test_a_run_without_checkpoints_or_config(trained, tmp_path):
    workdir = tmp_path / "fresh"
    workdir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(os.path.join(trained, name), workdir / name)
    with pytest.raises(evaluate.EvalError, match="no checkpoint in .*fresh/checkpoints yet; train first"):
        evaluate.restore(str(workdir), evaluate.run_config(str(workdir)))
    (workdir / "tokenizer.json").unlink()
    shutil.copytree(os.path.join(trained, "checkpoints"), workdir / "checkpoints")
    with pytest.raises(evaluate.EvalError) as error:  # trained, then the tokenizer lost
        evaluate.restore(str(workdir))
    assert str(error.value) == (f"{workdir} has checkpoints but no tokenizer.json; put the run's own tokenizer.json "
                                f"back (its checkpoints record its SHA-256)")
    (workdir / "config.json").unlink()
    with pytest.raises(evaluate.EvalError, match="holds no config.json; pass the directory train.py wrote"):
        evaluate.run_config(str(workdir))
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint for step 3 .*available steps: 5, 10"):
        evaluate.restore(trained, evaluate.run_config(trained), step=3)
    other_shape = evaluate.run_config(trained)
    other_shape.model.d_model = 32
    with pytest.raises(ConfigError, match="holds a run with model.d_model=64, not 32; pass --config.model.d_model=64"):
        evaluate.restore(trained, other_shape)


def test_a_run_killed_before_its_tokenizer_was_saved_says_so_and_writes_nothing(tmp_path):
    workdir = tmp_path / "killed"
    run_dir.save_config(str(workdir), tiny_config(tmp_path))  # what train.py writes before it prepares the data
    (workdir / run_dir.LOCK_FILE).write_text("pid 1 on elsewhere, started 2025-01-01 00:00:00")
    before = {path.name: path.read_bytes() for path in workdir.iterdir()}
    result = run_eval("--workdir", str(workdir))
    assert (result.returncode, result.stdout, result.stderr) == (
        2, "", f"error: the run in {workdir} never finished preparing its data (it has no tokenizer.json and no "
               f"checkpoint): there is nothing to evaluate; run train.py with this --workdir to prepare the data "
               f"and train\n")
    assert {path.name: path.read_bytes() for path in workdir.iterdir()} == before


def test_a_mesh_larger_than_the_devices_falls_back_to_every_device_on_the_data_axis(trained, capsys):
    config = evaluate.run_config(trained)
    config.mesh.update(dict(data=16, fsdp=1, tensor=1))
    config.microbatches = 2
    restored = evaluate.restore(trained, config)
    assert "the run's mesh {'data': 16, 'fsdp': 1, 'tensor': 1} does not fit the 8 device(s) here" in \
        capsys.readouterr().out
    assert dict(restored.mesh.shape) == {"data": 8, "fsdp": 1, "tensor": 1} and restored.config.microbatches == 1
    assert config.mesh.data == 16  # the caller's config is left as it was


@pytest.mark.parametrize("recorded", ["splash", "flash"])  # "flash": the TPU kernel's name in earlier versions
def test_a_run_trained_on_a_tpu_evaluates_on_a_cpu_with_this_machines_attention(trained, tmp_path, recorded):
    workdir = tmp_path / "tpu_run"
    shutil.copytree(trained, workdir)
    record = json.load(open(workdir / "config.json"))
    record["config"]["model"]["attention"] = recorded
    (workdir / "config.json").write_text(json.dumps(record))
    assert evaluate.restore(str(workdir), evaluate.run_config(str(workdir))).config.model.attention == "xla"
    result = run_eval("--workdir", str(workdir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "val loss" in result.stdout

