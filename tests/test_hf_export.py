"""Hugging Face export and import: same logits in transformers, same params back, clear refusals."""

import json
import os

import jax
import ml_collections
import numpy as np
import pytest

from andrea_jax import evaluate, hf_export, interop, model
from andrea_jax.config import base_config
from andrea_jax.data import tokenizer as tokenizers
from andrea_jax.sharding import unbox

TEXT = "def add(a, b):\n    return a + b  # the sum\n\nclass Point:\n    x: int = 0\n" * 40


def run_config(vocab_size: int, corpus: str) -> ml_collections.ConfigDict:
    c = base_config()
    m = c.model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim, m.max_len = 2, 64, 4, 256, 32
    m.vocab_size, m.vocab_pad_multiple = vocab_size, 16  # padding rows that the export must cut
    c.seq_len, c.batch_size, c.steps, c.eval_batches = 16, 8, 1, 1
    c.data.source = f"text:{corpus}"
    c.data.tokenizer = "bpe"
    c.data.val_fraction = 0.3
    return c


def random_params(m: ml_collections.ConfigDict, seed: int) -> dict:
    """Params of the model's shapes with large random values (no init run: that is slow on 8 CPU devices)."""
    shapes = unbox(jax.eval_shape(lambda key: model.init_params(m, key), jax.random.key(0)))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape)).astype(np.float32), shapes)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A workdir as train.py leaves it (random, non-trivial params), without spending time training."""
    root = tmp_path_factory.mktemp("hf")
    corpus = root / "corpus.txt"
    corpus.write_text(TEXT)
    tokenizer = tokenizers.train_bpe([TEXT], num_merges=40)
    config = run_config(tokenizer.vocab_size, str(corpus))
    config.data.cache_dir = str(root / "cache")
    params = random_params(config.model, seed=3)
    workdir = str(root / "run")
    os.makedirs(workdir)
    hf_export.write_run(workdir, params, config, tokenizer)
    return dict(root=root, workdir=workdir, params=params, config=config, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def exported(run):
    return hf_export.export(run["workdir"], str(run["root"] / "hf"))


def _flat(tree):
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_export_writes_gpt2_files_with_padding_cut(run, exported):
    from safetensors.numpy import load_file

    config = json.load(open(os.path.join(exported, "config.json")))
    vocab = run["tokenizer"].vocab_size
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["activation_function"] == "gelu_new"
    assert (config["vocab_size"], config["n_positions"], config["n_inner"]) == (vocab, 32, 256)
    assert config["eos_token_id"] == config["bos_token_id"] == run["tokenizer"].eot_id == vocab - 1
    assert config["tie_word_embeddings"] is True
    weights = load_file(os.path.join(exported, "model.safetensors"))
    assert model.padded_vocab_size(run["config"].model) > vocab
    assert weights["transformer.wte.weight"].shape == (vocab, 64)
    np.testing.assert_array_equal(weights["transformer.wte.weight"], np.asarray(run["params"]["token_embed"])[:vocab])
    with open(os.path.join(exported, "tokenizer.json")) as f:
        assert f.read() == run["tokenizer"].to_json()


def test_transformers_loads_the_export_with_the_same_logits(run, exported):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel.from_pretrained(exported).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    text = "def add(a, b):\n    return a + b"
    ids = run["tokenizer"].encode(text)
    assert tokenizer(text)["input_ids"] == ids
    assert tokenizer.eos_token_id == run["tokenizer"].eot_id
    ids_BxL = np.array([ids[:32], ids[-32:]])
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids_BxL)).logits.numpy()
    ours = np.asarray(model.build(run["config"].model).apply({"params": run["params"]}, ids_BxL))
    vocab = run["tokenizer"].vocab_size
    assert theirs.shape == ours[..., :vocab].shape and np.abs(theirs).max() > 1.0
    np.testing.assert_allclose(ours[..., :vocab], theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())


def test_import_gives_back_the_same_params(run, exported):
    workdir = str(run["root"] / "imported")
    config = hf_export.import_run(exported, workdir, run_config(0, "unused"))
    for key in ("n_layer", "d_model", "n_head", "mlp_dim", "vocab_size", "max_len"):
        assert config.model[key] == run["config"].model[key], key
    assert config.data.tokenizer == "bpe"
    assert sorted(os.listdir(workdir)) == ["checkpoints", "config.json", "run_config.py", "tokenizer.json"]
    assert tokenizers.load(os.path.join(workdir, "tokenizer.json")).sha256 == run["tokenizer"].sha256
    restored = evaluate.restore(workdir, evaluate.run_config(workdir))
    assert restored.step == 0
    _assert_same_params(restored.params, run["params"], run["tokenizer"].vocab_size)


def _assert_same_params(back, original, vocab_size):
    """Equal, except the padding rows of the embedding: never exported, imported as zeros."""
    back, original = _flat(back), _flat(original)
    assert original.keys() == back.keys()
    for key in original:
        if "token_embed" in key:
            np.testing.assert_array_equal(back[key][vocab_size:], 0.0)
            back[key], original[key] = back[key][:vocab_size], original[key][:vocab_size]
        np.testing.assert_array_equal(back[key], original[key], err_msg=key)


def test_imported_checkpoint_restores_as_a_training_state(run, exported, tmp_path):
    """The restore train.py does on resume: params and optimizer state against its abstract state."""
    import flax.linen as nn
    from andrea_jax import checkpoint, optimizer, sharding, train_step

    workdir = str(tmp_path / "finetune")
    hf_export.import_run(exported, workdir, run["config"])
    config = hf_export.load_config_file(os.path.join(workdir, hf_export.RUN_CONFIG_FILE))
    mesh = sharding.make_mesh(config, jax.devices()[:1])
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.rules(config)):
        boxed = jax.eval_shape(lambda key: train_step.init_state(key, config, optimizer.make(config)),
                               jax.random.key(0))
        shardings = sharding.logical_shardings(boxed, mesh, sharding.rules(config))
    saved = checkpoint.Checkpointer(workdir, read_only=True)
    try:
        state, meta = saved.restore(checkpoint.abstract_like(unbox(boxed), shardings),
                                    tokenizer_sha256=run["tokenizer"].sha256)
    finally:
        saved.close()
    assert meta["step"] == 0 and meta["config"]["model"]["d_model"] == 64
    _assert_same_params(state["params"], run["params"], run["tokenizer"].vocab_size)
    moments = [np.asarray(leaf) for leaf in jax.tree.leaves(state["opt_state"])]
    assert len(moments) > 2 * len(jax.tree.leaves(run["params"])) and all(not m.any() for m in moments)


@pytest.mark.slow
def test_imported_run_fine_tunes_in_train(run, exported, tmp_path, capsys):
    from andrea_jax import train_loop

    workdir = str(tmp_path / "finetune")
    hf_export.import_run(exported, workdir, run["config"])
    config = hf_export.load_config_file(os.path.join(workdir, hf_export.RUN_CONFIG_FILE))
    record = train_loop.train(config, workdir, devices=jax.devices()[:1])
    assert f"resumed from step 0 of {workdir}" in capsys.readouterr().out
    assert np.isfinite(record["loss"])
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f if "loss" in line][-1] == 1


@pytest.mark.parametrize("kind", ["byte", "char"])
def test_byte_and_char_tokenizers_export_with_the_same_ids(kind):
    from tokenizers import Tokenizer as HfTokenizer

    ours = tokenizers.ByteTokenizer() if kind == "byte" else tokenizers.build_char([TEXT + "é"])
    hf = HfTokenizer.from_str(hf_export.hf_tokenizer_json(ours))
    text = TEXT[:200] + ("é ü 日本 🙂" if kind == "byte" else "é")
    ids = ours.encode(text)
    assert hf.encode(text, add_special_tokens=False).ids == ids
    assert hf.token_to_id(tokenizers.END_OF_TEXT) == ours.eot_id
    assert hf.decode(ids) == text


def test_nanogpt_checkpoint_imports_with_linear_weights_transposed(run, tmp_path):
    torch = pytest.importorskip("torch")
    m = run["config"].model
    sd = interop.to_gpt2(run["params"], m)
    del sd["lm_head.weight"]
    nanogpt = {"_orig_mod." + k: torch.from_numpy(np.array(v.T if k.endswith(hf_export._LINEAR_SUFFIXES) else v))
               for k, v in sd.items()}
    path = tmp_path / "ckpt.pt"
    torch.save({"model": nanogpt, "model_args": dict(n_layer=2, n_head=4, n_embd=64, block_size=32,
                                                     vocab_size=m.vocab_size, bias=True)}, path)
    params, overrides = hf_export.load_gpt2(str(path), m)
    assert overrides["vocab_size"] == m.vocab_size and overrides["mlp_dim"] == 256
    _assert_same_params(params, run["params"], m.vocab_size)


def test_gpt2model_names_without_prefix_are_read(run, exported, tmp_path):
    from safetensors.numpy import load_file, save_file

    hf_dir = tmp_path / "gpt2_style"
    hf_dir.mkdir()
    weights = load_file(os.path.join(exported, "model.safetensors"))
    save_file({k.removeprefix("transformer."): v for k, v in weights.items()}, str(hf_dir / "model.safetensors"))
    (hf_dir / "config.json").write_text(open(os.path.join(exported, "config.json")).read())
    state_dict, _ = hf_export.read_state_dict(str(hf_dir))
    assert set(state_dict) == set(weights)


# ---- bad input: one line naming the fix, exit 2, nothing written ----

def _fails(capsys, argv, *words):
    with pytest.raises(SystemExit) as exit_info:
        hf_export.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for word in words:
        assert word in err, err


def test_export_without_checkpoint_refuses(run, tmp_path, capsys):
    workdir = tmp_path / "untrained"
    workdir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (workdir / name).write_text(open(os.path.join(run["workdir"], name)).read())
    out = tmp_path / "out"
    _fails(capsys, ["export", "--workdir", str(workdir), "--out", str(out)], "no checkpoint", "train first")
    assert not out.exists()


def test_non_gpt2_architecture_refuses(tmp_path, capsys):
    hf_dir = tmp_path / "llama"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    workdir = tmp_path / "new"
    _fails(capsys, ["import", "--hf", str(hf_dir), "--workdir", str(workdir)], "LlamaForCausalLM", "not GPT-2")
    assert not workdir.exists()


def test_exact_gelu_gpt2_refuses(exported, tmp_path, capsys):
    hf_dir = tmp_path / "erf"
    hf_dir.mkdir()
    config = json.load(open(os.path.join(exported, "config.json")))
    (hf_dir / "config.json").write_text(json.dumps({**config, "activation_function": "gelu"}))
    _fails(capsys, ["import", "--hf", str(hf_dir), "--workdir", str(tmp_path / "new")], "gelu_new")


def test_non_empty_output_needs_overwrite(run, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _fails(capsys, ["export", "--workdir", run["workdir"], "--out", str(out)], "--overwrite")
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    _fails(capsys, ["export", "--workdir", run["workdir"], "--out", run["workdir"], "--overwrite"], "its own source")
    assert os.path.isdir(os.path.join(run["workdir"], "checkpoints"))
    hf_export.main(["export", "--workdir", run["workdir"], "--out", str(out), "--overwrite"])
    assert "keep.txt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)


def test_ablated_architecture_refuses_export(run, tmp_path, capsys):
    workdir = tmp_path / "post_norm"
    workdir.mkdir()
    saved = json.load(open(os.path.join(run["workdir"], "config.json")))
    saved["config"]["model"]["norm_position"] = "post"
    (workdir / "config.json").write_text(json.dumps(saved))
    _fails(capsys, ["export", "--workdir", str(workdir), "--out", str(tmp_path / "out")], "not GPT-2's",
           "norm_position")
    assert not (tmp_path / "out").exists()
