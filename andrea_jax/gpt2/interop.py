"""GPT-2 weights in, GPT-2 weights out.

A state dict in the Hugging Face `GPT2LMHeadModel` layout (name -> numpy array)
becomes this model's params and back. GPT-2's Conv1D weights are already
(in, out) like our kernels; c_attn's (D, 3·D) columns are q|k|v, each split into
heads, which is exactly our (D, 3, H, K) qkv kernel reshaped.
"""

from __future__ import annotations

from typing import Mapping

import jax
import ml_collections
import numpy as np

from andrea_jax import UserError
from andrea_jax.config import padded_vocab_size
from andrea_jax.model import mlp_hidden_dim, non_gpt2_features

PREFIX = "transformer."


# Our block's params and their GPT-2 names under transformer.h.{i}.; only attention's differ in shape.
_BLOCK_NAMES = {
    ("ln_1", "scale"): "ln_1.weight", ("ln_1", "bias"): "ln_1.bias",
    ("attn", "qkv_kernel"): "attn.c_attn.weight", ("attn", "qkv_bias"): "attn.c_attn.bias",
    ("attn", "out_kernel"): "attn.c_proj.weight", ("attn", "out_bias"): "attn.c_proj.bias",
    ("ln_2", "scale"): "ln_2.weight", ("ln_2", "bias"): "ln_2.bias",
    ("mlp", "fc_kernel"): "mlp.c_fc.weight", ("mlp", "fc_bias"): "mlp.c_fc.bias",
    ("mlp", "proj_kernel"): "mlp.c_proj.weight", ("mlp", "proj_bias"): "mlp.c_proj.bias",
}


def stack_blocks(blocks: list[Mapping]) -> dict:
    """Per-block param trees -> one tree with a leading layer axis (scan layout)."""
    return jax.tree.map(lambda *layers: np.stack(layers), *blocks)


def check_gpt2_architecture(m: ml_collections.ConfigDict) -> None:
    """GPT-2 weights describe a pre-norm, residual, GELU model; an ablation variant is something else."""
    features = non_gpt2_features(m)
    if features:
        raise UserError(f"{'; '.join(features)}: not GPT-2's architecture (pre-norm, residual, GELU), so GPT-2 "
                         f"weights cannot hold the model; set them back to their defaults")


def gpt2_shapes(sd: Mapping[str, np.ndarray]) -> dict[str, int]:
    """The model config keys a GPT-2 state dict's weights fix."""
    wte = sd[PREFIX + "wte.weight"]
    return {"n_layer": len({k.split(".")[2] for k in sd if k.startswith(PREFIX + "h.")}),
            "d_model": int(wte.shape[1]), "vocab_size": int(wte.shape[0]),
            "max_len": int(sd[PREFIX + "wpe.weight"].shape[0]),
            "mlp_dim": int(sd[PREFIX + "h.0.mlp.c_fc.weight"].shape[1])}


def from_gpt2(sd: Mapping[str, np.ndarray], m: ml_collections.ConfigDict) -> dict:
    """HF GPT2LMHeadModel state dict (numpy arrays) -> float32 params of `Transformer(m)`."""
    check_gpt2_architecture(m)
    sd = {k: np.asarray(v, dtype=np.float32) for k, v in sd.items() if not k.endswith((".attn.bias", ".masked_bias"))}
    shapes = gpt2_shapes(sd)
    mlp_width = shapes.pop("mlp_dim")
    if mlp_hidden_dim(m) != mlp_width:
        raise UserError(f"the GPT-2 weights have mlp_dim={mlp_width} but the config gives an MLP width of "
                         f"{mlp_hidden_dim(m)}; set --config.model.mlp_ratio=0 --config.model.mlp_dim={mlp_width}")
    for key, value in shapes.items():
        if int(m[key]) != value:
            raise UserError(f"the GPT-2 weights have {key}={value} but model.{key}={m[key]}; "
                             f"set --config.model.{key}={value}")
    wte = sd[PREFIX + "wte.weight"]
    # Padding rows get zeros: they are masked out of the logits anyway.
    token_embed = np.zeros((padded_vocab_size(m), wte.shape[1]), np.float32)
    token_embed[: wte.shape[0]] = wte
    head_dim = m.d_model // m.n_head
    heads = {"qkv_kernel": (m.d_model, 3, m.n_head, head_dim), "qkv_bias": (3, m.n_head, head_dim),
             "out_kernel": (m.n_head, head_dim, m.d_model)}
    blocks = [{} for _ in range(m.n_layer)]
    for i, block in enumerate(blocks):
        for (group, name), gpt2_name in _BLOCK_NAMES.items():
            weight = sd[f"{PREFIX}h.{i}.{gpt2_name}"]
            block.setdefault(group, {})[name] = weight.reshape(heads.get(name, weight.shape))
    params = {"token_embed": token_embed, "position_embed": sd[PREFIX + "wpe.weight"],
              "ln_f": {"scale": sd[PREFIX + "ln_f.weight"], "bias": sd[PREFIX + "ln_f.bias"]}}
    if m.scan_layers:
        params["blocks"] = {"block": stack_blocks(blocks)}
    else:
        params.update({f"block_{i}": b for i, b in enumerate(blocks)})
    return params


def to_gpt2(params: Mapping, m: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
    """Params of `Transformer(m)` -> HF GPT2LMHeadModel state dict (numpy float32).

    `m` must pass `check_gpt2_architecture`: its caller checks, before reading any weights."""
    params = jax.tree.map(np.asarray, params)
    if m.scan_layers:
        blocks = [jax.tree.map(lambda layers: layers[i], params["blocks"]["block"]) for i in range(m.n_layer)]
    else:
        blocks = [params[f"block_{i}"] for i in range(m.n_layer)]
    wte = params["token_embed"][: m.vocab_size]
    sd = {PREFIX + "wte.weight": wte, PREFIX + "wpe.weight": params["position_embed"],
          PREFIX + "ln_f.weight": params["ln_f"]["scale"], PREFIX + "ln_f.bias": params["ln_f"]["bias"],
          "lm_head.weight": wte}  # tied
    flat = {"qkv_kernel": (m.d_model, -1), "qkv_bias": (-1,), "out_kernel": (-1, m.d_model)}
    for i, block in enumerate(blocks):
        sd.update({f"{PREFIX}h.{i}.{gpt2_name}": block[group][name].reshape(flat.get(name, block[group][name].shape))
                   for (group, name), gpt2_name in _BLOCK_NAMES.items()})
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in sd.items()}
