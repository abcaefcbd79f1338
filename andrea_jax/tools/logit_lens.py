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
    block_delta_ratio: np.ndarray  # [N - 1] |stream after block - stream before| / |stream before|
    attn_delta_ratio: np.ndarray  # [N - 1] and the next two: diagnostics.stream_stats
    mlp_delta_ratio: np.ndarray  # [N - 1]
    stream_norm: np.ndarray  # [N] RMS over tokens of the stream's L2 norm


def logit_lens(params: Any, model_config: ml_collections.ConfigDict, ids: Sequence[int]) -> Lens:
    """The lens for one sequence of token ids (1 to model.max_len of them)."""
    ids_L = np.asarray(ids, np.int32)
    out = _lens_arrays(nn.meta.unbox(params), jnp.asarray(ids_L)[None], ml_collections.FrozenConfigDict(model_config))
    return Lens(ids=ids_L, **{k: np.asarray(v) for k, v in jax.device_get(out).items()})


@functools.partial(jax.jit, static_argnums=2)
def _lens_arrays(params: Any, ids_1xL: jax.Array, model_config: ml_collections.FrozenConfigDict) -> dict:
    """The Lens fields but ids, as arrays, in one compiled pass."""
    _, variables = model.Transformer(model_config).apply(
        {"params": params}, ids_1xL, mutable=[model.INTERMEDIATES, model.DIAGNOSTICS])
    intermediates = variables[model.INTERMEDIATES]
    # The stream after the embedding, then after each block.
    streams_NxLxD = jnp.stack([diagnostics.sown(intermediates["embed_stream"])] + [
        diagnostics.sown(block["stream"]) for block in diagnostics.per_block(intermediates, model_config)])[:, 0]
    stats = diagnostics.stream_stats(variables[model.DIAGNOSTICS], model_config)
    # Every depth through the real head: the depths stand in for the batch axis.
    logprobs_NxLxV = jax.nn.log_softmax(model.head(params, model_config, streams_NxLxD), axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs_NxLxV, TOP_K)
    target_logprob_NxLm1 = jnp.take_along_axis(logprobs_NxLxV[:, :-1], ids_1xL[0, 1:, None][None], axis=-1)[..., 0]
    # Rank = how many tokens the depth finds strictly likelier than the real one.
    target_rank_NxLm1 = jnp.sum(logprobs_NxLxV[:, :-1] > target_logprob_NxLm1[..., None], axis=-1)
    steps_Nm1xLxD = jnp.diff(streams_NxLxD.astype(jnp.float32), axis=0)
    step_norms = jnp.sqrt(jnp.mean(jnp.sum(jnp.square(steps_Nm1xLxD), -1), -1))
    return {"top_ids": top_ids, "top_probs": jnp.exp(top_logprobs), "target_loss": -target_logprob_NxLm1,
            "target_rank": target_rank_NxLm1, "block_delta_ratio": step_norms / stats["stream_norm"][:-1], **stats}


def _label(tokenizer: Any, token_id: int) -> str:
    """A token as printable text: newlines and tabs escaped, so tables stay aligned."""
    text = tokenizer.decode([int(token_id)])
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def format_table(lens: Lens, tokenizer: Any) -> str:
    """One row per depth: stream and delta sizes, the real next token's mean loss and rank, the last top-3."""
    predictions = lens.target_loss.shape[1]
    lines = [f"logit lens over {len(lens.ids)} tokens; loss, rank and top-1 accuracy of the real next token "
             f"averaged over {predictions} positions; the top 3 after the last token",
             f"{'depth':>5}  {'after':<8} {'|x|':>7} {'block Δ':>8} {'attn Δ':>7} {'mlp Δ':>7} "
             f"{'loss':>7} {'rank':>7} {'top-1':>6}  next after the last token"]
    for d in range(lens.top_ids.shape[0]):
        after = "embed" if d == 0 else f"block_{d - 1}"
        deltas = [f"{ratio[d - 1]:.3f}" if d else "" for ratio in (lens.block_delta_ratio, lens.attn_delta_ratio,
                                                                   lens.mlp_delta_ratio)]
        scores = (f"{lens.target_loss[d].mean():7.3f} {lens.target_rank[d].mean():7.1f} "
                  f"{(lens.target_rank[d] == 0).mean():6.2f}" if predictions else f"{'-':>7} {'-':>7} {'-':>6}")
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

    first = max(0, lens.target_loss.shape[1] - _MAX_PLOTTED_POSITIONS)
    probs_NxL = np.exp(-lens.target_loss[:, first:])
    depths, shown = probs_NxL.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * shown + 2), max(3.0, 0.4 * depths + 1.5)))
    image = ax.imshow(probs_NxL, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, origin="lower")
    for d in range(depths):
        for p in range(shown):
            ax.text(p, d, _label(tokenizer, lens.top_ids[d, first + p, 0])[:4], ha="center", va="center",
                    fontsize=6, color="black" if probs_NxL[d, p] > 0.5 else "white")
    ax.set_xticks(range(shown), [_label(tokenizer, t) for t in lens.ids[1 + first:]], rotation=90, fontsize=7)
    ax.set_yticks(range(depths), ["embed"] + [f"block {i}" for i in range(depths - 1)], fontsize=7)
    ax.set(xlabel="real next token", ylabel="stream read after",
           title="logit lens: p(real next token) by depth; text = top-1 guess")
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
    lens = logit_lens(params, model_config, ids[-int(model_config.max_len):])
    if out_png:
        plot(lens, tokenizer, out_png)
    return format_table(lens, tokenizer)
