"""A table of parameters per module, computed from shapes alone (no allocation)."""

from __future__ import annotations

import math
import re
from typing import Mapping

import flax.linen as nn
import jax
import ml_collections

from andrea_jax import model


def param_shapes(model_config: ml_collections.ConfigDict) -> Mapping:
    """Unboxed ShapeDtypeStructs of the params, via jax.eval_shape."""
    boxed = jax.eval_shape(lambda rng: model.init_params(model_config, rng), jax.random.key(0))
    return nn.meta.unbox(boxed)


def count(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def rows(model_config: ml_collections.ConfigDict) -> list[tuple[str, str, int]]:
    """(module, shapes, parameters) for each top-level module, then the total."""
    shapes = param_shapes(model_config)
    table = []
    for name in sorted(shapes, key=_module_order):
        subtree = shapes[name]
        if isinstance(subtree, Mapping) and all(isinstance(v, Mapping) for v in subtree.values()):
            # A block (or the scanned stack): its sub-layers' sizes.
            inner = subtree.get("block", subtree)
            described = " · ".join(f"{k} {count(v):,}" for k, v in inner.items())
        else:
            described = ", ".join(f"{jax.tree_util.keystr(path, simple=True, separator='/') or name} "
                                  f"{tuple(leaf.shape)}" for path, leaf in jax.tree_util.tree_leaves_with_path(subtree))
        table.append((name, described, count(subtree)))
    table.append(("total", "", count(shapes)))
    return table


def _module_order(name: str) -> tuple:
    """Embeddings, then blocks in depth order, then the final norm."""
    order = {"token_embed": 0, "position_embed": 1, "blocks": 2, "ln_f": 4}
    depth = int(name.rsplit("_", 1)[1]) if re.fullmatch(r"block_\d+", name) else 0
    return order.get(name, 3), depth


def format_table(model_config: ml_collections.ConfigDict) -> str:
    table = rows(model_config)
    width = max(len(r[0]) for r in table)
    lines = [f"{'module':<{width}}  {'parameters':>12}  shapes"]
    lines += [f"{name:<{width}}  {n:>12,}  {shapes}" for name, shapes, n in table]
    return "\n".join(lines)
