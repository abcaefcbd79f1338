"""Hugging Face export and import: same logits in transformers, same params back, clear refusals;
nanoGPT checkpoints in, with the logits of nanoGPT's own forward pass."""

import importlib.util
import json
import os
import pickle
import stat
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from andrea_jax import UserError, evaluate, model
from andrea_jax.gpt2 import huggingface, interop
from andrea_jax.config import base_config
from andrea_jax.data import tokenizer as tokenizers
from andrea_jax.sharding import unbox

TEXT = "def add(a, b):\n    return a + b  # the sum\n\nclass Point:\n    x: int = 0\n" * 40
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    huggingface.write_run(workdir, params, config, tokenizer)
    return dict(root=root, workdir=workdir, params=params, config=config, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def exported(run):
    return huggingface.export(run["workdir"], str(run["root"] / "hf"))


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
    """get_config() of the run_config.py an import writes, as train.py --config loads it."""
    spec = importlib.util.spec_from_file_location("run_config", os.path.join(workdir, huggingface.RUN_CONFIG_FILE))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


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


def test_every_exported_file_has_the_mode_the_umask_gives(exported):
    umask = os.umask(0)
    os.umask(umask)
    modes = {name: stat.S_IMODE(os.stat(os.path.join(exported, name)).st_mode) for name in os.listdir(exported)}
    assert "model.safetensors" in modes  # safetensors' own save_file gave it 0600
    assert modes == {name: 0o666 & ~umask for name in modes}


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
    ours = np.asarray(model.Transformer(run["config"].model).apply({"params": run["params"]}, ids_BxL))
    vocab = run["tokenizer"].vocab_size
    assert theirs.shape == ours[..., :vocab].shape and np.abs(theirs).max() > 1.0
    np.testing.assert_allclose(ours[..., :vocab], theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())


def test_import_gives_back_the_same_params(run, exported):
    workdir = str(run["root"] / "imported")
    config = huggingface.import_run(exported, workdir, run_config(0, "unused"))
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
    huggingface.import_run(exported, workdir, run["config"])
    config = load_run_config(workdir)
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
    huggingface.import_run(exported, workdir, run["config"])
    config = load_run_config(workdir)
    record = train_loop.train(config, workdir, devices=jax.devices()[:1])
    assert f"resumed from step 0 of {workdir}" in capsys.readouterr().out
    assert np.isfinite(record["loss"])
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f if "loss" in line][-1] == 1


@pytest.mark.parametrize("kind", ["byte", "char", "char without end-of-text"])
def test_byte_and_char_tokenizers_export_with_the_same_ids(kind):
    from tokenizers import Tokenizer as HfTokenizer

    ours = tokenizers.ByteTokenizer() if kind == "byte" else \
        tokenizers.CharTokenizer(TEXT + "é", end_of_text=kind == "char")
    hf = HfTokenizer.from_str(huggingface.hf_tokenizer_json(ours))
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
    nanogpt = {"_orig_mod." + k: torch.from_numpy(np.array(v.T if k.endswith(huggingface._LINEAR_SUFFIXES) else v))
               for k, v in sd.items()}
    path = tmp_path / "ckpt.pt"
    torch.save({"model": nanogpt, "model_args": dict(n_layer=2, n_head=4, n_embd=64, block_size=32,
                                                     vocab_size=m.vocab_size, bias=True)}, path)
    state_dict, hf = huggingface.read_state_dict(str(path))
    overrides = huggingface.model_overrides(state_dict, hf)
    assert overrides["vocab_size"] == m.vocab_size and overrides["mlp_dim"] == 256
    params = interop.from_gpt2(state_dict, ml_collections.ConfigDict({**m.to_dict(), **overrides}))
    _assert_same_params(params, run["params"], m.vocab_size)


def test_gpt2model_names_without_prefix_are_read(run, exported, tmp_path):
    from safetensors.numpy import load_file, save_file

    hf_dir = tmp_path / "gpt2_style"
    hf_dir.mkdir()
    weights = load_file(os.path.join(exported, "model.safetensors"))
    save_file({k.removeprefix("transformer."): v for k, v in weights.items()}, str(hf_dir / "model.safetensors"))
    (hf_dir / "config.json").write_text(open(os.path.join(exported, "config.json")).read())
    state_dict, _ = huggingface.read_state_dict(str(hf_dir))
    assert set(state_dict) == set(weights)


# ---- bad input: one line naming the fix, exit 2, nothing written ----

def _refuses(call, *words):
    with pytest.raises(UserError) as error:
        call()
    message = str(error.value)
    assert len(message.splitlines()) == 1, message
    for word in words:
        assert word in message, message


def _command(*args, cwd=ROOT):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "andrea_jax.gpt2.huggingface", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_command_line_errors_are_one_line(run, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for args, words in [(["export", "--workdir", run["workdir"], "--out", str(out)], ["--overwrite"]),
                        (["--workdir", str(tmp_path / "new")], ["say export or import first;"])]:
        result = _command(*args)
        err = result.stderr.strip()
        assert result.returncode == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
        assert all(word in err for word in words), err
    assert os.listdir(out) == ["keep.txt"] and not (tmp_path / "new").exists()


def test_export_without_checkpoint_refuses(run, tmp_path):
    workdir = tmp_path / "untrained"
    workdir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (workdir / name).write_text(open(os.path.join(run["workdir"], name)).read())
    out = tmp_path / "out"
    _refuses(lambda: huggingface.export(str(workdir), str(out)), "no checkpoint", "train first")
    assert not out.exists()


def test_non_gpt2_architecture_refuses(tmp_path):
    hf_dir = tmp_path / "llama"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    workdir = tmp_path / "new"
    _refuses(lambda: huggingface.import_run(str(hf_dir), str(workdir)), "LlamaForCausalLM", "not GPT-2")
    assert not workdir.exists()


def test_other_activation_refuses(exported, tmp_path):
    hf_dir = tmp_path / "quick_gelu"
    hf_dir.mkdir()
    config = json.load(open(os.path.join(exported, "config.json")))
    (hf_dir / "config.json").write_text(json.dumps({**config, "activation_function": "quick_gelu"}))
    _refuses(lambda: huggingface.import_run(str(hf_dir), str(tmp_path / "new")), "quick_gelu", "gelu_new", "'gelu'")


def test_untied_or_rescaled_attention_refuses(exported, tmp_path):
    config = json.load(open(os.path.join(exported, "config.json")))
    for key, value in [("tie_word_embeddings", False), ("scale_attn_by_inverse_layer_idx", True)]:
        hf_dir = tmp_path / key
        hf_dir.mkdir()
        (hf_dir / "config.json").write_text(json.dumps({**config, key: value}))
        _refuses(lambda: huggingface.import_run(str(hf_dir), str(tmp_path / "new")), f"{key}={value}",
                 "GPT-2's defaults")


def test_non_empty_output_needs_overwrite(run, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _refuses(lambda: huggingface.export(run["workdir"], str(out)), "--overwrite")
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    _refuses(lambda: huggingface.export(run["workdir"], run["workdir"], overwrite=True), "its own source")
    assert os.path.isdir(os.path.join(run["workdir"], "checkpoints"))
    huggingface.export(run["workdir"], str(out), overwrite=True)
    assert "keep.txt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)


def test_ablated_architecture_refuses_export(run, tmp_path):
    workdir = tmp_path / "post_norm"
    workdir.mkdir()
    saved = json.load(open(os.path.join(run["workdir"], "config.json")))
    saved["config"]["model"]["norm_position"] = "post"
    (workdir / "config.json").write_text(json.dumps(saved))
    _refuses(lambda: huggingface.export(str(workdir), str(tmp_path / "out")), "not GPT-2's", "norm_position")
    assert not (tmp_path / "out").exists()


# ---- nanoGPT: its checkpoint and meta.pkl as its user has them ----

CHAR_TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"


def nanogpt_state_dict(vocab_rows: int, bias: bool, seed: int = 0, n_layer: int = 2, d: int = 64,
                       block_size: int = 32) -> dict:
    """A random nanoGPT GPT's state dict: its names, nn.Linear (out, in) weights, no biases when bias=False."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)

    def normal(*shape, std=0.2, mean=0.0):
        return torch.from_numpy((mean + std * rng.standard_normal(shape)).astype(np.float32))

    sd = {"transformer.wte.weight": normal(vocab_rows, d, std=0.5), "transformer.wpe.weight": normal(block_size, d)}
    layers = {"ln_1": (d,), "attn.c_attn": (3 * d, d), "attn.c_proj": (d, d), "ln_2": (d,), "mlp.c_fc": (4 * d, d),
              "mlp.c_proj": (d, 4 * d)}
    named = {f"transformer.h.{i}.{name}": shape for i in range(n_layer) for name, shape in layers.items()}
    for name, shape in {**named, "transformer.ln_f": (d,)}.items():
        sd[name + ".weight"] = normal(*shape, mean=1.0) if len(shape) == 1 else normal(*shape)
        if bias:
            sd[name + ".bias"] = normal(shape[0], std=0.1)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]  # tied: one tensor, as nanoGPT saves it
    return sd


def nanogpt_logits(sd: dict, n_head: int, ids_BxL: np.ndarray) -> np.ndarray:
    """nanoGPT's forward pass on its state dict in float64: nn.Linear layers, LayerNorm with optional bias,
    causal scaled-dot-product attention, the exact GELU, the head tied to the token embedding."""
    import torch
    from torch.nn import functional as F

    w = {k: v.double() for k, v in sd.items()}
    linear = lambda x, name: F.linear(x, w[name + ".weight"], w.get(name + ".bias"))
    norm = lambda x, name: F.layer_norm(x, x.shape[-1:], w[name + ".weight"], w.get(name + ".bias"), 1e-5)
    batch, length = ids_BxL.shape
    x = w["transformer.wte.weight"][torch.from_numpy(ids_BxL)] + w["transformer.wpe.weight"][:length]
    heads = lambda t: t.view(batch, length, n_head, -1).transpose(1, 2)
    for i in range(len({k.split(".")[2] for k in w if k.startswith("transformer.h.")})):
        p = f"transformer.h.{i}."
        q, k, v = linear(norm(x, p + "ln_1"), p + "attn.c_attn").split(x.shape[-1], dim=-1)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + linear(y.transpose(1, 2).reshape(batch, length, -1), p + "attn.c_proj")
        x = x + linear(F.gelu(linear(norm(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    return linear(norm(x, "transformer.ln_f"), "lm_head").numpy()


def write_nanogpt(out_dir, sd: dict, n_head: int, bias: bool, dataset: str = "shakespeare_char") -> str:
    """out_dir/ckpt.pt as nanoGPT's train.py saves it, its model compiled (names under `_orig_mod.`)."""
    import torch

    parameters = [torch.nn.Parameter(v.clone()) for v in sd.values()]
    optimizer = torch.optim.AdamW(parameters, lr=1e-3, betas=(0.9, 0.99))
    sum(p.square().sum() for p in parameters).backward()
    optimizer.step()
    d, block_size = sd["transformer.wpe.weight"].shape[1], sd["transformer.wpe.weight"].shape[0]
    model_args = dict(n_layer=len({k.split(".")[2] for k in sd if k.startswith("transformer.h.")}), n_head=n_head,
                      n_embd=d, block_size=block_size, bias=bias, vocab_size=sd["lm_head.weight"].shape[0],
                      dropout=0.0)
    config = dict(dataset=dataset, out_dir=os.path.basename(out_dir), batch_size=12, learning_rate=1e-3,
                  compile=True, device="cpu", dtype="float32", wandb_log=False, **model_args)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "ckpt.pt")
    torch.save({"model": {"_orig_mod." + k: v for k, v in sd.items()}, "optimizer": optimizer.state_dict(),
                "model_args": model_args, "iter_num": 100, "best_val_loss": torch.tensor(2.56), "config": config},
               path)
    return path


def write_meta(directory, text: str) -> dict:
    """nanoGPT's data/<dataset>/meta.pkl for a character-level text, as its prepare.py writes it."""
    chars = sorted(set(text))
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "meta.pkl"), "wb") as f:
        pickle.dump(meta, f)
    return meta


def _assert_equal_logits(ours: np.ndarray, theirs: np.ndarray) -> None:
    """Equal to float32 rounding: 1e-5 of the largest logit (the reference runs in float64)."""
    assert ours.shape == theirs.shape and np.abs(theirs).max() > 3.0
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())


def _logits(workdir: str, ids_BxL: np.ndarray, **model_changes) -> np.ndarray:
    restored = evaluate.restore(workdir, evaluate.run_config(workdir))
    m = ml_collections.ConfigDict({**restored.config.model.to_dict(), **model_changes})
    logits = model.Transformer(m).apply({"params": jax.device_get(restored.params)}, ids_BxL)
    return np.asarray(logits)[..., :m.vocab_size]


@pytest.mark.parametrize("bias", [False, True])
def test_nanogpt_char_checkpoint_gives_nanogpt_logits(tmp_path, bias):
    sd = nanogpt_state_dict(len(set(CHAR_TEXT)), bias, seed=int(bias))
    ckpt = write_nanogpt(str(tmp_path / "out-shakespeare-char"), sd, n_head=4, bias=bias)
    meta = write_meta(tmp_path / "data" / "shakespeare_char", CHAR_TEXT)
    workdir = str(tmp_path / "run")
    # No --tokenizer: meta.pkl is found where nanoGPT's sample.py looks, data/<config dataset>/.
    config = huggingface.import_run(ckpt, workdir)
    assert config.model.activation == "gelu_exact" and config.model.vocab_size == meta["vocab_size"]
    tokenizer = tokenizers.load(os.path.join(workdir, "tokenizer.json"))
    assert (tokenizer.kind, tokenizer.eot_id, tokenizer.vocab_size) == ("char", None, meta["vocab_size"])
    ids_BxL = np.array([tokenizer.encode(CHAR_TEXT[:32]), tokenizer.encode(CHAR_TEXT[-32:])])
    assert ids_BxL[0].tolist() == [meta["stoi"][c] for c in CHAR_TEXT[:32]]
    theirs = nanogpt_logits(sd, 4, ids_BxL)
    _assert_equal_logits(_logits(workdir, ids_BxL), theirs)
    # The exact GELU is what makes them equal: the tanh one misses by over ten times the tolerance.
    assert np.abs(_logits(workdir, ids_BxL, activation="gelu_tanh") - theirs).max() > 1e-4 * np.abs(theirs).max()


def test_nanogpt_import_as_typed_then_export_keeps_exact_gelu(tmp_path):
    """`import --hf out-shakespeare-char/ckpt.pt` from nanoGPT's directory; the export says "gelu"."""
    sd = nanogpt_state_dict(len(set(CHAR_TEXT)), bias=False)
    write_nanogpt(str(tmp_path / "out-shakespeare-char"), sd, n_head=4, bias=False)
    write_meta(tmp_path / "data" / "shakespeare_char", CHAR_TEXT)
    workdir = str(tmp_path / "run")
    result = _command("import", "--hf", "out-shakespeare-char/ckpt.pt", "--workdir", workdir, "--config",
                      os.path.join(ROOT, "configs", "shakespeare_char.py"), "--config.steps=7", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "fine-tune with" in result.stdout and "GELU" not in result.stdout  # no note about a different GELU
    config = load_run_config(workdir)
    assert (config.steps, config.model.activation, config.data.tokenizer) == (7, "gelu_exact", "char")

    exported = huggingface.export(workdir, str(tmp_path / "hf"))
    hf_config = json.load(open(os.path.join(exported, "config.json")))
    assert hf_config["activation_function"] == "gelu" and hf_config["eos_token_id"] is None
    chars = sorted(set(CHAR_TEXT))
    ids_BxL = np.array([[chars.index(c) for c in CHAR_TEXT[:24]]])
    transformers = pytest.importorskip("transformers")
    import torch
    with torch.no_grad():
        theirs = transformers.GPT2LMHeadModel.from_pretrained(exported).eval()(torch.from_numpy(ids_BxL)).logits
    _assert_equal_logits(theirs.numpy(), nanogpt_logits(sd, 4, ids_BxL))

    again = huggingface.import_run(exported, str(tmp_path / "again"))
    assert again.model.activation == "gelu_exact"
    assert tokenizers.load(os.path.join(tmp_path / "again", "tokenizer.json")).eot_id is None


def test_nanogpt_gpt2_vocabulary_imports_with_vocab_and_merges(run, tmp_path):
    """A GPT-2-vocabulary checkpoint (embedding padded, as nanoGPT pads 50257 to 50304) with
    --tokenizer naming a directory of vocab.json + merges.txt; the padding rows are cut."""
    bpe_dir = tmp_path / "gpt2"
    bpe_dir.mkdir()
    run["tokenizer"]._hf.model.save(str(bpe_dir))  # vocab.json + merges.txt, end-of-text added after
    vocab = run["tokenizer"].vocab_size
    sd = nanogpt_state_dict(vocab + 23, bias=True, seed=2)
    ckpt = write_nanogpt(str(tmp_path / "out"), sd, n_head=4, bias=True, dataset="openwebtext")
    workdir = str(tmp_path / "run")
    config = huggingface.import_run(ckpt, workdir, tokenizer_path=str(bpe_dir))
    assert config.model.vocab_size == vocab and config.data.tokenizer == "bpe"
    tokenizer = tokenizers.load(os.path.join(workdir, "tokenizer.json"))
    assert tokenizer.eot_id == run["tokenizer"].eot_id and tokenizer.encode(TEXT) == run["tokenizer"].encode(TEXT)
    ids_BxL = np.array([tokenizer.encode(TEXT)[:32]])
    _assert_equal_logits(_logits(workdir, ids_BxL), nanogpt_logits(sd, 4, ids_BxL)[..., :vocab])
    _refuses(lambda: huggingface.import_run(ckpt, str(tmp_path / "none")), "no tokenizer", "meta.pkl", "--tokenizer")
