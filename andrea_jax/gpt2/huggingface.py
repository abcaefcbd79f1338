"""Hugging Face GPT-2 format out and in: share a run, or start one from GPT-2 or nanoGPT weights.

  python -m andrea_jax.gpt2.huggingface export --workdir runs/tiny --out runs/tiny_hf [--step N] [--overwrite]
  python -m andrea_jax.gpt2.huggingface import --hf DIR_OR_CKPT --workdir runs/ft [--config configs/tiny.py]
                                        [--tokenizer FILE_OR_DIR] [--overwrite]

Both directions are exact: an export is a `GPT2LMHeadModel` directory that `transformers` loads with
the same logits; an import is a workdir at step 0 that train.py fine-tunes and eval.py evaluates. Both
are built beside the target and renamed into place, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Iterator, Mapping

import ml_collections
import numpy as np
from absl import flags

from andrea_jax import UserError, run_dir
from andrea_jax.gpt2 import interop
from andrea_jax.runtime import atomic
from andrea_jax.config import base_config, validate
from andrea_jax.data import tokenizer as tokenizers
from andrea_jax.data.tokenizer import END_OF_TEXT, Tokenizer
from andrea_jax.model import mlp_hidden_dim

WEIGHTS_FILE = "model.safetensors"
HF_CONFIG_FILE = "config.json"
HF_TOKENIZER_FILE = "tokenizer.json"
# Our own tokenizer.json beside the HF one: an import gets the exact byte or char tokenizer back.
ANDREA_TOKENIZER_FILE = "andrea_tokenizer.json"
# Written into an imported workdir: `train.py --config <workdir>/run_config.py` resumes it as saved.
RUN_CONFIG_FILE = "run_config.py"
# transformers' activation_function -> model.activation: OpenAI's GPT-2 uses the tanh GELU, nanoGPT the exact one.
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
               "gelu": "gelu_exact"}
# nanoGPT keeps nn.Linear weights (out, in); GPT-2's Conv1D and our kernels are (in, out).
_LINEAR_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Where a tokenizer may lie in a directory, in this order of preference.
_TOKENIZER_FILES = ([ANDREA_TOKENIZER_FILE], [HF_TOKENIZER_FILE], ["meta.pkl"], ["vocab.json", "merges.txt"])


class ExportError(UserError):
    """An export or import that cannot be done as asked; the message names the fix."""


# ---------------------------------------------------------------- export

def hf_tokenizer_json(tokenizer: Tokenizer) -> str:
    """The tokenizer as a HF `tokenizers` file giving the same ids."""
    if tokenizer.kind == "bpe":
        return tokenizer.to_json()  # already a HF tokenizers file
    from tokenizers import Tokenizer as HfTokenizer, decoders, models, pre_tokenizers

    if tokenizer.kind == "byte":  # byte-level BPE without merges: every byte its own token, id = byte value
        hf = HfTokenizer(models.BPE(vocab={char: byte for byte, char in tokenizers.byte_to_char().items()}, merges=[]))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.decoder = decoders.ByteLevel()
    else:  # char: BPE without merges or pre-tokenizer, every character its own token
        hf = HfTokenizer(models.BPE(vocab={c: i for i, c in enumerate(tokenizer.chars)}, merges=[]))
        hf.decoder = decoders.Fuse()
    if tokenizer.eot_id is not None:
        hf.add_special_tokens([END_OF_TEXT])
    return hf.to_str()


def write_hf(out: str, params: Mapping, model_config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> None:
    """Writes a GPT2LMHeadModel directory into `out` (which must exist); `model_config` is GPT-2's architecture."""
    from safetensors.numpy import save

    m, eot_id, dropout = model_config, tokenizer.eot_id, float(model_config.dropout)
    state_dict = interop.to_gpt2(params, m)
    # Tied: transformers ties lm_head to wte on load, as its own save_pretrained files expect.
    del state_dict["lm_head.weight"]
    # A char tokenizer from nanoGPT has no end-of-text: then there are no special tokens at all.
    special = {} if eot_id is None else {k: END_OF_TEXT for k in ("bos_token", "eos_token", "unk_token")}
    files = {
        # As bytes, written like the other files: safetensors' save_file creates its file 0600.
        WEIGHTS_FILE: save(state_dict, metadata={"format": "pt"}),
        HF_CONFIG_FILE: json.dumps({
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": int(m.vocab_size),  # padding rows are cut
            "n_positions": int(m.max_len), "n_ctx": int(m.max_len), "n_embd": int(m.d_model),
            "n_layer": int(m.n_layer), "n_head": int(m.n_head), "n_inner": mlp_hidden_dim(m),
            "activation_function": "gelu" if m.activation == "gelu_exact" else "gelu_new",
            "layer_norm_epsilon": float(m.layer_norm_epsilon),
            "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout,
            "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "use_cache": True, "tie_word_embeddings": True,
            "bos_token_id": eot_id, "eos_token_id": eot_id, "dtype": "float32"}, indent=2),
        HF_TOKENIZER_FILE: hf_tokenizer_json(tokenizer),
        "tokenizer_config.json": json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(m.max_len),
            **special, "add_prefix_space": False, "clean_up_tokenization_spaces": False}, indent=2),
        "special_tokens_map.json": json.dumps(special),
    }
    if tokenizer.kind != "bpe":
        files[ANDREA_TOKENIZER_FILE] = tokenizer.to_json()
    for name, content in files.items():
        atomic.write(os.path.join(out, name), content)


def export(workdir: str, out: str, step: int | None = None, overwrite: bool = False) -> str:
    """The newest (or `step`) checkpoint of a run -> a Hugging Face GPT-2 directory; returns `out`."""
    from andrea_jax import evaluate

    _check_output(out, overwrite, "--out", keep=workdir)
    config = evaluate.run_config(workdir)
    interop.check_gpt2_architecture(config.model)  # the export's one check, before the restore, which may be slow
    restored = evaluate.restore(workdir, config, step)
    with _staged(out) as staging:
        write_hf(staging, restored.params, restored.config.model, restored.tokenizer)
    print(f"exported step {restored.step} of {workdir} to {out}", flush=True)
    return out


# ---------------------------------------------------------------- import

def read_state_dict(path: str) -> tuple[dict[str, np.ndarray], dict]:
    """A transformers GPT-2 directory (config.json + model.safetensors or pytorch_model.bin) or a nanoGPT
    `ckpt.pt` ({"model": ..., "model_args": ...}) -> (state dict in GPT2LMHeadModel names, HF-style config)."""
    if not os.path.exists(path):
        raise ExportError(f"--hf {path} does not exist; pass a Hugging Face GPT-2 directory or a nanoGPT ckpt.pt")
    if os.path.isfile(path):
        state_dict, hf = _read_nanogpt(path)
    else:
        config_path = os.path.join(path, HF_CONFIG_FILE)
        if not os.path.isfile(config_path):
            raise ExportError(f"{path} has no {HF_CONFIG_FILE}; pass a Hugging Face GPT-2 directory "
                              f"(config.json + model.safetensors) or a nanoGPT ckpt.pt")
        with open(config_path, encoding="utf-8") as f:
            hf = json.load(f)
        _check_gpt2(hf, path)
        state_dict = _read_weights(path)
        if not any(k.startswith(interop.PREFIX) for k in state_dict):
            # GPT2Model files (e.g. openai-community/gpt2) name the body without the prefix.
            state_dict = {(k if k.startswith("lm_head.") else interop.PREFIX + k): v for k, v in state_dict.items()}
    if interop.PREFIX + "wte.weight" not in state_dict:
        raise ExportError(f"{path} has no token embedding ({interop.PREFIX}wte.weight); pass a GPT-2 checkpoint")
    return state_dict, hf


def _check_gpt2(hf: dict, where: str) -> None:
    architectures = hf.get("architectures") or []
    if hf.get("model_type") != "gpt2" or any(a not in ("GPT2LMHeadModel", "GPT2Model") for a in architectures):
        found = ", ".join(architectures) or hf.get("model_type") or "unknown"
        raise ExportError(f"{where} holds a {found} model, not GPT-2; only GPT2LMHeadModel checkpoints "
                          f"have this architecture, pass one of those")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise ExportError(f"{where} uses activation_function={activation!r}; this model computes the tanh or "
                          f"exact GELU ({', '.join(map(repr, ACTIVATIONS))}), so its logits would differ; pick a "
                          f"GPT-2 with one of those")
    # Scaled attention, not by layer index, and the output matrix tied to the token embedding.
    gpt2 = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "tie_word_embeddings": True}
    changed = [f"{key}={hf[key]}" for key, value in gpt2.items() if bool(hf.get(key, value)) != value]
    if changed:
        raise ExportError(f"{where} sets {', '.join(changed)}, a model other than GPT-2's; pick a checkpoint "
                          f"with GPT-2's defaults there")


def _read_weights(path: str) -> dict[str, np.ndarray]:
    index, bin_path = os.path.join(path, WEIGHTS_FILE + ".index.json"), os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(index):  # sharded
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        files = [WEIGHTS_FILE]
    elif os.path.isfile(bin_path):
        return {k: v.float().numpy() for k, v in _torch_load(bin_path).items()}
    else:
        raise ExportError(f"{path} has neither {WEIGHTS_FILE} nor pytorch_model.bin; pass a complete "
                          f"Hugging Face GPT-2 directory")
    from safetensors.flax import load_file  # reads bfloat16 too, which NumPy cannot

    return {k: np.asarray(v, np.float32) for name in files for k, v in load_file(os.path.join(path, name)).items()}


def _torch_load(path: str) -> dict:
    try:
        import torch
    except ImportError:
        raise ExportError(f"reading {path} needs PyTorch; pip install torch (the CPU build is enough), "
                          f"or convert it to safetensors") from None
    try:
        # Tensors and plain values only: nanoGPT's ckpt.pt (its config, model_args, optimizer state) is that.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # not a torch file, or one holding objects that weights_only refuses
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ExportError(f"cannot read {path} as tensors and plain values ({reason}); pass a nanoGPT ckpt.pt "
                          f"or a Hugging Face GPT-2 directory") from None


def _read_nanogpt(path: str) -> tuple[dict[str, np.ndarray], dict]:
    checkpoint = _torch_load(path)
    if not isinstance(checkpoint, dict) or "model" not in checkpoint or "model_args" not in checkpoint:
        raise ExportError(f"{path} is not a nanoGPT checkpoint (a dict with 'model' and 'model_args'); "
                          f"pass one, or a Hugging Face GPT-2 directory")
    # "_orig_mod." is torch.compile's wrapper.
    model = {key.removeprefix("_orig_mod."): value.float().numpy() for key, value in checkpoint["model"].items()}
    state_dict = {key: array.T if key.endswith(_LINEAR_SUFFIXES) else array for key, array in model.items()}
    # nanoGPT's bias=False drops every bias; zeros are the same model.
    for key in [k for k in state_dict if k.endswith(".weight") and ("ln_" in k or k.endswith(_LINEAR_SUFFIXES))]:
        state_dict.setdefault(key.removesuffix("weight") + "bias", np.zeros(state_dict[key].shape[-1], np.float32))
    # nanoGPT's GELU is the exact (erf) one, its LayerNorm epsilon 1e-5; the dataset names its meta.pkl.
    hf = {"n_head": checkpoint["model_args"]["n_head"], "activation_function": "gelu", "layer_norm_epsilon": 1e-5,
          "dataset": (checkpoint.get("config") or {}).get("dataset")}
    return state_dict, hf


def model_overrides(state_dict: Mapping[str, np.ndarray], hf: dict) -> dict:
    """The model config keys a GPT-2 checkpoint fixes: the weights' shapes, the heads, the norm and GELU."""
    return {**interop.gpt2_shapes(state_dict), "n_head": int(hf["n_head"]), "mlp_ratio": 0.0,
            "layer_norm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)),
            "activation": ACTIVATIONS[hf.get("activation_function", "gelu_new")]}


def load_tokenizer(path: str, tokenizer_path: str | None = None, dataset: str | None = None) -> Tokenizer:
    """The checkpoint's tokenizer: --tokenizer (a file, or a directory holding one), else one beside
    the checkpoint, else nanoGPT's data/<dataset>/meta.pkl, where its sample.py looks for it."""
    if tokenizer_path and os.path.isfile(tokenizer_path):
        return tokenizers.load(tokenizer_path)
    if tokenizer_path:
        directories = [tokenizer_path]
    else:
        beside = os.path.abspath(path if os.path.isdir(path) else os.path.dirname(path))
        # nanoGPT writes out_dir inside its repository, and sample.py runs from the repository's root.
        roots = [os.path.dirname(beside), os.getcwd()] if dataset else []
        directories = [beside] + [os.path.join(root, "data", dataset) for root in roots]
    for directory in directories:
        for names in _TOKENIZER_FILES:
            files = [os.path.join(directory, name) for name in names]
            if all(os.path.isfile(f) for f in files):
                return tokenizers.load(files[0]) if len(files) == 1 else _gpt2_bpe(*files)
    raise ExportError(f"no tokenizer for {path} in {' or '.join(directories)} (tokenizer.json, nanoGPT's "
                      f"meta.pkl, or GPT-2's vocab.json + merges.txt); pass --tokenizer with one of them")


def _gpt2_bpe(vocab: str, merges: str) -> Tokenizer:
    """GPT-2's byte-level BPE from its vocab.json and merges.txt (what tiktoken's "gpt2" encodes)."""
    from tokenizers import Tokenizer as HfTokenizer, decoders, models, pre_tokenizers

    hf = HfTokenizer(models.BPE.from_file(vocab, merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([END_OF_TEXT])
    return tokenizers.BpeTokenizer(hf)


def import_run(path: str, workdir: str, config: ml_collections.ConfigDict | None = None,
               tokenizer_path: str | None = None, overwrite: bool = False) -> ml_collections.ConfigDict:
    """A GPT-2 or nanoGPT checkpoint -> a new workdir at step 0 that train.py and eval.py take; returns its config.

    `config` (default: base_config()) gives everything but the model's shape and activation: data,
    optimizer, steps, and the params' layout (scan_layers, vocab_pad_multiple); seq_len is lowered to
    the checkpoint's context if longer.
    """
    _check_output(workdir, overwrite, "--workdir", keep=path)
    config = ml_collections.ConfigDict((config or base_config()).to_dict())
    state_dict, hf = read_state_dict(path)
    tokenizer = load_tokenizer(path, tokenizer_path, hf.get("dataset"))
    # Embedding rows no token can reach are cut (nanoGPT pads GPT-2's 50257 to 50304).
    wte, size = state_dict[interop.PREFIX + "wte.weight"], tokenizer.vocab_size
    if size > len(wte):
        raise ExportError(f"the tokenizer has {size} entries but the embedding only {len(wte)} rows; pass the one "
                          f"the model was trained with (--tokenizer: a tokenizer.json, nanoGPT's meta.pkl, or a "
                          f"directory with vocab.json + merges.txt)")
    if size < len(wte):
        print(f"note: keeping the first {size} of {len(wte)} embedding rows (the tokenizer's entries)", flush=True)
    state_dict[interop.PREFIX + "wte.weight"] = wte[:size]
    config.model.update(model_overrides(state_dict, hf))
    config.seq_len = min(int(config.seq_len), int(config.model.max_len))
    config.data.tokenizer = tokenizer.kind
    validate(config)
    params = interop.from_gpt2(state_dict, config.model)
    with _staged(workdir) as staging:
        write_run(staging, params, config, tokenizer)
    print(f"imported {path} into {workdir} (step 0); fine-tune with: python train.py --config "
          f"{os.path.join(workdir, RUN_CONFIG_FILE)} --workdir {workdir} --config.steps=N", flush=True)
    return config


def write_run(workdir: str, params: Mapping, config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> None:
    """A workdir as train.py leaves it at step 0: config.json, tokenizer.json, checkpoint, run_config.py."""
    import jax

    from andrea_jax import checkpoint, optimizer
    from andrea_jax.data import pipeline

    run_dir.save_config(workdir, config)
    tokenizer.save(os.path.join(workdir, pipeline.TOKENIZER_FILE))
    params = jax.tree.map(jax.numpy.asarray, params)
    state = {"params": params, "opt_state": optimizer.make(config).init(params)}  # fresh moments
    with contextlib.closing(checkpoint.Checkpointer(workdir, keep=int(config.keep_checkpoints))) as saver:
        saver.save(0, state, {"tokenizer_sha256": tokenizer.sha256, "config": config.to_dict()})
    with open(os.path.join(workdir, RUN_CONFIG_FILE), "w", encoding="utf-8") as f:
        f.write(f'"""The config of the run in this directory, as saved in {run_dir.CONFIG_FILE}: '
                f'pass it to train.py --config."""\n\nimport json\nimport os\n\nimport ml_collections\n\n\n'
                f'def get_config():\n'
                f'    with open(os.path.join(os.path.dirname(__file__), "{run_dir.CONFIG_FILE}")) as f:\n'
                f'        return ml_collections.ConfigDict(json.load(f)["config"])\n')


# ---------------------------------------------------------------- shared

def _check_output(out: str, overwrite: bool, flag: str, keep: str | None = None) -> None:
    """Refuses a non-empty target without --overwrite, and never replaces the run it reads."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"{flag} {out} is a file; pass a directory path")
    if keep is not None:
        target, source = os.path.realpath(out), os.path.realpath(keep)
        if source == target or source.startswith(target + os.sep):
            raise ExportError(f"{flag} {out} would replace its own source {keep}; pass another directory")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ExportError(f"{flag} {out} exists and is not empty; pass --overwrite to replace it, "
                          f"or pick a new directory")


@contextlib.contextmanager
def _staged(target: str) -> Iterator[str]:
    """A scratch directory beside `target`, renamed onto it only when the block succeeds."""
    target = os.path.abspath(target)
    staging = f"{target}.tmp{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if os.path.isdir(target):
        shutil.rmtree(target)  # _check_output allowed it: empty, or --overwrite
    os.replace(staging, target)


# ---------------------------------------------------------------- command line

# The flags each command needs; the others it ignores.
_REQUIRED = {"export": ("workdir", "out"), "import": ("hf", "workdir")}


def main(argv: list[str]) -> None:
    """`export` or `import`, with the flags defined under __main__; errors as one line and exit status 2."""
    from absl import logging

    from andrea_jax.runtime import cli, storage

    values = flags.FLAGS
    command = " ".join(argv[1:])

    def convert() -> None:
        if command not in _REQUIRED:
            raise ExportError(f"say export or import first{f', not {command!r}' if command else ''}; "
                              f"e.g. python -m andrea_jax.gpt2.huggingface export --workdir RUN --out DIR")
        missing = [f"--{name}" for name in _REQUIRED[command] if values[name].value is None]
        if missing:
            raise ExportError(f"{command} needs {' and '.join(missing)}; see --helpshort")
        if command == "import" and storage.is_remote(values.workdir):
            raise ExportError(f"import into a local --workdir, not {values.workdir}; a run on the bucket starts "
                              f"from it with train.py --config.init_params_from=THAT_WORKDIR")
        with storage.WorkingCopy(values.workdir) as copy:  # of a gs:// workdir: its files, pulled
            if command == "export":
                export(copy.local, values.out, values.step, values.overwrite)
            else:
                import_run(values.hf, copy.local, values.config, values.tokenizer, values.overwrite)

    cli.run(convert, join_cluster=False, verbosity=logging.ERROR)  # Orbax's read-only warnings


if __name__ == "__main__":
    from ml_collections import config_flags

    from andrea_jax.runtime import cli

    flags.DEFINE_string("workdir", None, "export: the run directory to read; import: the new run directory")
    flags.DEFINE_string("out", None, "export: the directory to write (config.json, model.safetensors, ...)")
    flags.DEFINE_integer("step", None, "export: the checkpoint step (default: the newest)")
    flags.DEFINE_string("hf", None, "import: a Hugging Face GPT-2 directory, or a nanoGPT ckpt.pt")
    flags.DEFINE_string("tokenizer", None, "import: a tokenizer.json, nanoGPT's meta.pkl, or a directory with "
                        "vocab.json + merges.txt (default: beside the checkpoint, or nanoGPT's data/<dataset>/)")
    config_flags.DEFINE_config_file("config", None, "import: the config for everything but the model's shape "
                                    "(data, optimizer, steps), e.g. configs/tiny.py", lock_config=False)
    flags.DEFINE_bool("overwrite", False, "replace a non-empty output directory")
    cli.run_app(main)
