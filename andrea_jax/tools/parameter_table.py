"""A table of parameters per module, computed from shapes alone (no allocation)."""

from __future__ import annotations

import math
from typing import Mapping

import flax.linen as nn
import jax
import ml_collections

from andrea_jax import model


def param_shapes(model_config: ml_collections.ConfigDict) -> Mapping:
    return nn.meta.unbox(jax.eval_shape(lambda rng: model.init_params(model_config, rng), jax.random.key(0)))


def count(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def rows(model_config: ml_collections.ConfigDict) -> list[tuple[str, str, int]]:
    """(module, shapes, parameters) for each top-level module in the model's order, then the total."""
    shapes = param_shapes(model_config)
    order = ["token_embed", "position_embed", "blocks", *(f"block_{i}" for i in range(model_config.n_layer)), "ln_f"]
    table = []
    for name in (name for name in order if name in shapes):
        module = shapes[name]
        if name.startswith("block"):  # a block (or the scanned stack): its sub-layers' sizes
            described = " · ".join(f"{k} {count(v):,}" for k, v in module.get("block", module).items())
        else:
            described = ", ".join(f"{jax.tree_util.keystr(path, simple=True, separator='/') or name} "
                                  f"{tuple(leaf.shape)}" for path, leaf in jax.tree_util.tree_leaves_with_path(module))
        table.append((name, described, count(module)))
    return table + [("total", "", count(shapes))]


def format_table(model_config: ml_collections.ConfigDict) -> str:
    table = rows(model_config)
    width = max(len(r[0]) for r in table)
    return "\n".join([f"{'module':<{width}}  {'parameters':>12}  shapes"] +
                     [f"{name:<{width}}  {n:>12,}  {shapes}" for name, shapes, n in table])
