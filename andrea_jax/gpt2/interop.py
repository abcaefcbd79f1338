"""GPT-2 weights in, GPT-2 weights out.

A state dict in the Hugging Face `GPT2LMHeadModel` layout (name -> numpy array)
becomes this model's params and back. GPT-2's Conv1D weights are already
(in, out) like our kernels; c_attn's (D, 3·D) columns are q|k|v, each split into
heads, which is exactly our (D, 3, H, K) qkv kernel reshaped.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import ml_collections

from andrea_jax.config import padded_vocab_size
from andrea_jax.model import mlp_hidden_dim, non_gpt2_features

PREFIX = "transformer."


def _block_from_gpt2(sd: Mapping[str, np.ndarray], i: int, n_head: int) -> dict:
    p = f"{PREFIX}h.{i}."
    d_model = sd[p + "ln_1.weight"].shape[0]
    head_dim = d_model // n_head
    return {
        "ln_1": {"scale": sd[p + "ln_1.weight"], "bias": sd[p + "ln_1.bias"]},
        "attn": {
            "qkv_kernel": sd[p + "attn.c_attn.weight"].reshape(d_model, 3, n_head, head_dim),
            "qkv_bias": sd[p + "attn.c_attn.bias"].reshape(3, n_head, head_dim),
            "out_kernel": sd[p + "attn.c_proj.weight"].reshape(n_head, head_dim, d_model),
            "out_bias": sd[p + "attn.c_proj.bias"],
        },
        "ln_2": {"scale": sd[p + "ln_2.weight"], "bias": sd[p + "ln_2.bias"]},
        "mlp": {
            "fc_kernel": sd[p + "mlp.c_fc.weight"],
            "fc_bias": sd[p + "mlp.c_fc.bias"],
            "proj_kernel": sd[p + "mlp.c_proj.weight"],
            "proj_bias": sd[p + "mlp.c_proj.bias"],
        },
    }


def _block_to_gpt2(block: Mapping, i: int) -> dict[str, np.ndarray]:
    p = f"{PREFIX}h.{i}."
    attn, mlp = block["attn"], block["mlp"]
    d_model = attn["qkv_kernel"].shape[0]
    return {
        p + "ln_1.weight": block["ln_1"]["scale"], p + "ln_1.bias": block["ln_1"]["bias"],
        p + "attn.c_attn.weight": attn["qkv_kernel"].reshape(d_model, 3 * d_model),
        p + "attn.c_attn.bias": attn["qkv_bias"].reshape(3 * d_model),
        p + "attn.c_proj.weight": attn["out_kernel"].reshape(d_model, d_model),
        p + "attn.c_proj.bias": attn["out_bias"],
        p + "ln_2.weight": block["ln_2"]["scale"], p + "ln_2.bias": block["ln_2"]["bias"],
        p + "mlp.c_fc.weight": mlp["fc_kernel"], p + "mlp.c_fc.bias": mlp["fc_bias"],
        p + "mlp.c_proj.weight": mlp["proj_kernel"], p + "mlp.c_proj.bias": mlp["proj_bias"],
    }


def stack_blocks(blocks: list[Mapping]) -> dict:
    """Per-block param trees -> one tree with a leading layer axis (scan layout)."""
    if isinstance(blocks[0], Mapping):
        return {k: stack_blocks([b[k] for b in blocks]) for k in blocks[0]}
    return np.stack([np.asarray(b) for b in blocks])


def unstack_blocks(stacked: Mapping, n_layer: int) -> list[dict]:
    """The inverse of `stack_blocks`."""
    def take(tree, i):
        return {k: take(v, i) for k, v in tree.items()} if isinstance(tree, Mapping) else np.asarray(tree)[i]
    return [take(stacked, i) for i in range(n_layer)]


def check_gpt2_architecture(m: ml_collections.ConfigDict) -> None:
    """GPT-2 weights describe a pre-norm, residual, GELU model; an ablation variant is something else."""
    features = non_gpt2_features(m)
    if features:
        raise ValueError(f"{'; '.join(features)}: not GPT-2's architecture (pre-norm, residual, GELU), so GPT-2 "
                         f"weights cannot hold the model; set them back to their defaults")


def _check_shapes(sd: Mapping[str, np.ndarray], m: ml_collections.ConfigDict) -> None:
    wte = sd.get(PREFIX + "wte.weight")
    if wte is None:
        raise ValueError(f"no '{PREFIX}wte.weight' in the state dict: pass a GPT2LMHeadModel state dict")
    n_layer = len({k.split(".")[2] for k in sd if k.startswith(PREFIX + "h.")})
    found = dict(n_layer=n_layer, d_model=wte.shape[1], vocab_size=wte.shape[0],
                 max_len=sd[PREFIX + "wpe.weight"].shape[0],
                 mlp_dim=sd[PREFIX + "h.0.mlp.c_fc.weight"].shape[1])
    mlp_width = found.pop("mlp_dim")
    if mlp_hidden_dim(m) != mlp_width:
        raise ValueError(f"the GPT-2 weights have mlp_dim={mlp_width} but the config gives an MLP width of "
                         f"{mlp_hidden_dim(m)}; set --config.model.mlp_ratio=0 --config.model.mlp_dim={mlp_width}")
    for key, value in found.items():
        if int(m[key]) != value:
            raise ValueError(f"the GPT-2 weights have {key}={value} but model.{key}={m[key]}; "
                             f"set --config.model.{key}={value}")


def from_gpt2(sd: Mapping[str, np.ndarray], m: ml_collections.ConfigDict) -> dict:
    """HF GPT2LMHeadModel state dict (numpy arrays) -> float32 params of `Transformer(m)`."""
    check_gpt2_architecture(m)
    sd = {k: np.asarray(v, dtype=np.float32) for k, v in sd.items() if not k.endswith((".attn.bias", ".masked_bias"))}
    _check_shapes(sd, m)
    wte = sd[PREFIX + "wte.weight"]
    vocab_rows = padded_vocab_size(m)
    # Padding rows get zeros: they are masked out of the logits anyway.
    token_embed = np.zeros((vocab_rows, wte.shape[1]), np.float32)
    token_embed[: wte.shape[0]] = wte
    blocks = [_block_from_gpt2(sd, i, m.n_head) for i in range(m.n_layer)]
    params = {
        "token_embed": token_embed,
        "position_embed": sd[PREFIX + "wpe.weight"],
        "ln_f": {"scale": sd[PREFIX + "ln_f.weight"], "bias": sd[PREFIX + "ln_f.bias"]},
    }
    if m.scan_layers:
        params["blocks"] = {"block": stack_blocks(blocks)}
    else:
        params.update({f"block_{i}": b for i, b in enumerate(blocks)})
    return params


def to_gpt2(params: Mapping, m: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
    """Params of `Transformer(m)` -> HF GPT2LMHeadModel state dict (numpy float32)."""
    check_gpt2_architecture(m)
    params = _to_numpy(params)
    if m.scan_layers:
        blocks = unstack_blocks(params["blocks"]["block"], m.n_layer)
    else:
        blocks = [params[f"block_{i}"] for i in range(m.n_layer)]
    wte = params["token_embed"][: m.vocab_size]
    sd = {
        PREFIX + "wte.weight": wte,
        PREFIX + "wpe.weight": params["position_embed"],
        PREFIX + "ln_f.weight": params["ln_f"]["scale"],
        PREFIX + "ln_f.bias": params["ln_f"]["bias"],
        "lm_head.weight": wte,  # tied
    }
    for i, block in enumerate(blocks):
        sd.update(_block_to_gpt2(block, i))
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in sd.items()}


def _to_numpy(tree):
    if isinstance(tree, Mapping):
        return {k: _to_numpy(v) for k, v in tree.items()}
    return np.asarray(tree)
