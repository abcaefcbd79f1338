"""The logit lens: what the model would predict if it stopped after each block.

The residual stream at depth d (0 = the embedding, d = after block d - 1) goes
through the model's own head, LN_f and the tied output matrix, as if the blocks
after it were skipped. Depth n_layer is the model's real output. If the layers
refine the stream step by step, the loss of the actual next token falls with depth.

`trace` is the whole feature for one prompt: a text table and a PNG heatmap.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from andrea_jax import UserError, diagnostics, model

TOP_K = 5
_MAX_PLOTTED_POSITIONS = 48  # wider heatmaps have unreadable labels; the last ones are plotted


@dataclasses.dataclass(frozen=True)
class Lens:
    """One prompt through the lens; N = n_layer + 1 depths, L prompt tokens."""
    ids: np.ndarray  # [L]
    top_ids: np.ndarray  # [N, L, TOP_K] likeliest next tokens at each depth and position
    top_probs: np.ndarray  # [N, L, TOP_K]
    target_loss: np.ndarray  # [N, L - 1] -log p(the token that really comes next)
    target_rank: np.ndarray  # [N, L - 1] its rank among all tokens (0 = the top prediction)
    stream_norm: np.ndarray  # [N] RMS over tokens of the stream's L2 norm
    block_delta_ratio: np.ndarray  # [N - 1] |stream after block - stream before| / |stream before|
    attn_delta_ratio: np.ndarray  # [N - 1] as in diagnostics.py
    mlp_delta_ratio: np.ndarray  # [N - 1]


def _streams(intermediates: dict, model_config: ml_collections.ConfigDict) -> jax.Array:
    """[N, B, L, D]: the stream after the embedding, then after each block."""
    (embed,) = intermediates["embed_stream"]
    if model_config.scan_layers:
        (blocks,) = intermediates["blocks"]["block"]["stream"]  # stacked: [n_layer, B, L, d]
    else:
        blocks = jnp.stack([intermediates[f"block_{i}"]["stream"][0] for i in range(model_config.n_layer)])
    return jnp.concatenate([embed[None], blocks])


def logit_lens(params: Any, model_config: ml_collections.ConfigDict, ids: Sequence[int]) -> Lens:
    """The lens for one sequence of token ids (at most model.max_len of them)."""
    m = model_config
    ids_L = np.asarray(ids, np.int32)
    if not 1 <= ids_L.shape[0] <= m.max_len:
        raise ValueError(f"the lens takes 1 to model.max_len={m.max_len} tokens, not {ids_L.shape[0]}")
    params = nn.meta.unbox(params)
    frozen = ml_collections.FrozenConfigDict(m)
    out = _lens_arrays(params, jnp.asarray(ids_L)[None], frozen)
    out = jax.device_get(out)
    return Lens(ids=ids_L, **{k: np.asarray(v) for k, v in out.items()})


@functools.partial(jax.jit, static_argnums=2)
def _lens_arrays(params: Any, ids_1xL: jax.Array, model_config: ml_collections.FrozenConfigDict) -> dict:
    """The Lens fields but ids, as arrays, in one compiled pass."""
    _, variables = model.Transformer(model_config).apply(
        {"params": params}, ids_1xL, mutable=[model.INTERMEDIATES, model.DIAGNOSTICS])
    streams_NxLxD = _streams(variables[model.INTERMEDIATES], model_config)[:, 0]
    stats = diagnostics.stream_stats(variables[model.DIAGNOSTICS], model_config)
    # Every depth through the real head: the depths stand in for the batch axis.
    logits_NxLxV = model.head(params, model_config, streams_NxLxD)
    logprobs_NxLxV = jax.nn.log_softmax(logits_NxLxV, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs_NxLxV, TOP_K)
    targets_Lm1 = ids_1xL[0, 1:]
    target_logprob_NxLm1 = jnp.take_along_axis(logprobs_NxLxV[:, :-1], targets_Lm1[None, :, None], axis=-1)[..., 0]
    # Rank = how many tokens the depth finds strictly likelier than the real one.
    target_rank_NxLm1 = jnp.sum(logprobs_NxLxV[:, :-1] > target_logprob_NxLm1[..., None], axis=-1)
    streams_f32 = streams_NxLxD.astype(jnp.float32)
    norms_N = jnp.sqrt(jnp.mean(jnp.sum(jnp.square(streams_f32), -1), -1))
    step_norms = jnp.sqrt(jnp.mean(jnp.sum(jnp.square(streams_f32[1:] - streams_f32[:-1]), -1), -1))
    return {"top_ids": top_ids, "top_probs": jnp.exp(top_logprobs), "target_loss": -target_logprob_NxLm1,
            "target_rank": target_rank_NxLm1, "stream_norm": norms_N, "block_delta_ratio": step_norms / norms_N[:-1],
            "attn_delta_ratio": stats["attn_delta_ratio"], "mlp_delta_ratio": stats["mlp_delta_ratio"]}


def _label(tokenizer: Any, token_id: int) -> str:
    """A token as printable text: newlines and tabs escaped, so tables stay aligned."""
    text = tokenizer.decode([int(token_id)])
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def format_table(lens: Lens, tokenizer: Any) -> str:
    """One row per depth: stream and delta sizes, the real next token's mean loss and rank, the last top-3."""
    depths = lens.top_ids.shape[0]
    predictions = lens.target_loss.shape[1]
    lines = [f"logit lens over {len(lens.ids)} tokens; loss, rank and top-1 accuracy of the real next token "
             f"averaged over {predictions} positions; the top 3 after the last token",
             f"{'depth':>5}  {'after':<8} {'|x|':>7} {'block Δ':>8} {'attn Δ':>7} {'mlp Δ':>7} "
             f"{'loss':>7} {'rank':>7} {'top-1':>6}  next after the last token"]
    for d in range(depths):
        after = "embed" if d == 0 else f"block_{d - 1}"
        deltas = ("", "", "") if d == 0 else (f"{lens.block_delta_ratio[d - 1]:.3f}",
                                              f"{lens.attn_delta_ratio[d - 1]:.3f}",
                                              f"{lens.mlp_delta_ratio[d - 1]:.3f}")
        if predictions:
            scores = (f"{lens.target_loss[d].mean():7.3f} {lens.target_rank[d].mean():7.1f} "
                      f"{(lens.target_rank[d] == 0).mean():6.2f}")
        else:
            scores = f"{'-':>7} {'-':>7} {'-':>6}"
        top = ", ".join(f"'{_label(tokenizer, t)}' {p:.2f}" for t, p in zip(lens.top_ids[d, -1, :3],
                                                                             lens.top_probs[d, -1, :3]))
        lines.append(f"{d:>5}  {after:<8} {lens.stream_norm[d]:7.3f} {deltas[0]:>8} {deltas[1]:>7} "
                     f"{deltas[2]:>7} {scores}  {top}")
    lines.append("Δ columns: the block's (or sub-layer's) output norm relative to the stream it read")
    return "\n".join(lines)


def plot(lens: Lens, tokenizer: Any, out_png: str) -> None:
    """Heatmap: depth × position, colour = probability of the real next token, text = the top-1 guess."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = lens.target_loss.shape[1]
    first = max(0, positions - _MAX_PLOTTED_POSITIONS)
    probs_NxL = np.exp(-lens.target_loss[:, first:])
    depths, shown = probs_NxL.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * shown + 2), max(3.0, 0.4 * depths + 1.5)))
    image = ax.imshow(probs_NxL, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, origin="lower")
    for d in range(depths):
        for p in range(shown):
            guess = _label(tokenizer, lens.top_ids[d, first + p, 0])
            ax.text(p, d, guess[:4], ha="center", va="center", fontsize=6,
                    color="black" if probs_NxL[d, p] > 0.5 else "white")
    ax.set_xticks(range(shown))
    ax.set_xticklabels([_label(tokenizer, t) for t in lens.ids[1 + first:]], rotation=90, fontsize=7)
    ax.set_yticks(range(depths))
    ax.set_yticklabels(["embed"] + [f"block {i}" for i in range(depths - 1)], fontsize=7)
    ax.set_xlabel("real next token")
    ax.set_ylabel("stream read after")
    ax.set_title("logit lens: p(real next token) by depth; text = top-1 guess")
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.02)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def trace(params: Any, model_config: ml_collections.ConfigDict, tokenizer: Any, text: str,
          out_png: str | None) -> str:
    """The lens for `text` (its last model.max_len tokens): the table, and the heatmap written to out_png."""
    ids = tokenizer.encode(text)
    if not ids:
        raise UserError("--trace needs a text of at least one token")
    ids = ids[-int(model_config.max_len):]
    lens = logit_lens(params, model_config, ids)
    if out_png:
        plot(lens, tokenizer, out_png)
    return format_table(lens, tokenizer)
