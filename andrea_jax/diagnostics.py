"""What happens inside the model during training, as a few scalars a step (`config.diagnostics`).

The train step adds these metrics when diagnostics are on:
  diag/grad_norm/block_{i}         L2 norm of block i's gradient, all its parameters together
  diag/attn_delta_ratio/block_{i}  |Attention output| / |stream it reads| in block i
  diag/mlp_delta_ratio/block_{i}   the same for the MLP
  diag/stream_norm/depth_{d}       |residual stream| at depth d: 0 = after the embedding,
                                   d = after block d - 1 (depth n_layer is what LN_f reads)
A norm |x| is the root mean square over the batch's tokens of each token's L2 norm, so a
ratio of 0.05 says a sub-layer moves the stream by about 5% of its length. With micro-batches
the stream figures are the mean over micro-batches; the gradient norms are the accumulated
gradient's. The block figures come from the model's "diagnostics" collection (see model.py),
which is stacked over depth under scan_layers, like the params.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections

PREFIX = "diag/"
BLOCK_STATS = ("attn_delta_ratio", "mlp_delta_ratio")


def per_block(tree: Mapping, model_config: ml_collections.ConfigDict) -> list[Any]:
    """Block i's subtree of a params- or collection-shaped tree, for each i (slices of the stack under scan)."""
    n_layer = int(model_config.n_layer)
    if model_config.scan_layers:
        stacked = tree["blocks"]["block"]
        return [jax.tree.map(lambda leaf, i=i: leaf[i], stacked) for i in range(n_layer)]
    return [tree[f"block_{i}"] for i in range(n_layer)]


def sown(value: Any) -> jax.Array:
    """A sown value: `sow` keeps a tuple of every call's value; each block calls once per forward."""
    (only,) = value
    return only


def block_grad_norms(grads: Mapping, model_config: ml_collections.ConfigDict) -> jax.Array:
    """[n_layer]: the L2 norm of each block's gradient."""
    norm = lambda tree: jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(tree)))
    return jnp.stack([norm(block) for block in per_block(grads, model_config)])


def stream_stats(collection: Mapping, model_config: ml_collections.ConfigDict) -> dict[str, jax.Array]:
    """The "diagnostics" collection of one forward pass -> arrays over depth: attn_delta_ratio and
    mlp_delta_ratio [n_layer], stream_norm [n_layer + 1]."""
    blocks = per_block(collection, model_config)
    stats = {name: jnp.stack([sown(block[name]) for block in blocks]) for name in (*BLOCK_STATS, "stream_norm")}
    stats["stream_norm"] = jnp.concatenate([sown(collection["embed_stream_norm"])[None], stats["stream_norm"]])
    return stats


def metrics(stats: Mapping[str, jax.Array], grad_norms: jax.Array) -> dict[str, jax.Array]:
    """Flat metric keys (see the module docstring) from `stream_stats` and `block_grad_norms`."""
    series = {"grad_norm/block": grad_norms, **{f"{name}/block": stats[name] for name in BLOCK_STATS},
              "stream_norm/depth": stats["stream_norm"]}
    return {f"{PREFIX}{name}_{i}": values[i] for name, values in series.items() for i in range(values.shape[0])}
