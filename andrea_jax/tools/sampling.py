"""Text generation: prefill a KV cache with the prompt, then decode one token a step.

The cache is the model's "cache" collection (see model.py), a fixed-size pytree
passed in and returned, so each step costs one token's forward pass and every
step after the first reuses one compiled program. The model config is a static
jit argument, so it travels as a (hashable) FrozenConfigDict.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from andrea_jax.model import Transformer


def init_cache(model_config: ml_collections.ConfigDict, batch_size: int) -> dict:
    """An empty cache for `batch_size` sequences: zeros shaped by a decode-mode init."""
    def init(ids_BxL):
        return Transformer(model_config).init(jax.random.key(0), ids_BxL, decode=True)["cache"]
    shapes = jax.eval_shape(init, jax.ShapeDtypeStruct((batch_size, 1), jnp.int32))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


@functools.partial(jax.jit, static_argnums=3)
def prefill(params: dict, cache: dict, ids_BxL: jax.Array,
            model_config: ml_collections.FrozenConfigDict) -> tuple[jax.Array, dict]:
    """Runs L tokens through the model after those already cached: (logits [B, L, V], cache). With L = 1,
    a decode step."""
    logits_BxLxV, variables = Transformer(model_config).apply(
        {"params": params, "cache": cache}, ids_BxL, decode=True, mutable=["cache"])
    return logits_BxLxV, variables["cache"]


@functools.partial(jax.jit, static_argnums=5)
def sample_token(logits_BxV: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float,
                 vocab_size: int) -> jax.Array:
    """One token per row: argmax when temperature == 0, else a draw after top-k, then top-p, filtering.

    top_k = 0 and top_p = 1 switch their filter off. Columns from vocab_size on
    (padding rows of the embedding) are cut off, so they can never be drawn.
    """
    logits_BxV = logits_BxV[:, :vocab_size].astype(jnp.float32)
    greedy_B = jnp.argmax(logits_BxV, axis=-1)
    scaled_BxV = logits_BxV / jnp.where(temperature > 0, temperature, 1.0)

    sorted_BxV = jnp.sort(scaled_BxV, axis=-1)[:, ::-1]  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab_size), vocab_size)
    sorted_BxV = jnp.where(jnp.arange(vocab_size) < k, sorted_BxV, -jnp.inf)
    # Nucleus: keep a token while the mass ranked above it is below top_p; the
    # first always stays, so a tiny top_p is greedy.
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    mass_above_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    kept_B = jnp.minimum(jnp.sum(mass_above_BxV < top_p, axis=-1), k)
    threshold_B = jnp.take_along_axis(sorted_BxV, kept_B[:, None] - 1, axis=-1)
    filtered_BxV = jnp.where(scaled_BxV >= threshold_B, scaled_BxV, -jnp.inf)

    drawn_B = jax.random.categorical(key, filtered_BxV, axis=-1)
    return jnp.where(temperature > 0, drawn_B, greedy_B).astype(jnp.int32)


def generate(params: dict, model_config: ml_collections.ConfigDict, prompt_ids: list[int], *,
             max_new_tokens: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, eot_id: int | None = None) -> list[int]:
    """The tokens that follow `prompt_ids` (1 to model.max_len - 1 of this model's ids): up to max_new_tokens,
    fewer at end-of-text (which is not returned) or when prompt + new tokens reach model.max_len.

    temperature >= 0 (0 = greedy), top_k >= 0 (0 = off), 0 < top_p <= 1, as eval.py's flags check them.
    """
    m = ml_collections.FrozenConfigDict(model_config)
    params = nn.meta.unbox(params)
    logits_1xLxV, cache = prefill(params, init_cache(m, 1), jnp.asarray([prompt_ids], jnp.int32), m)
    budget = min(max_new_tokens, m.max_len - len(prompt_ids))
    # Each token's key depends only on the seed and its position, so a run repeats exactly.
    new_ids: list[int] = []
    for position in range(len(prompt_ids), len(prompt_ids) + budget):
        token_1 = sample_token(logits_1xLxV[:, -1], jax.random.fold_in(jax.random.key(seed), position),
                               temperature, top_k, top_p, m.vocab_size)
        if int(token_1[0]) == eot_id:
            break
        new_ids.append(int(token_1[0]))
        if len(new_ids) < budget:  # the last token need not go through the model
            logits_1xLxV, cache = prefill(params, cache, token_1[:, None], m)
    return new_ids
