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


def _frozen(model_config: ml_collections.ConfigDict) -> ml_collections.FrozenConfigDict:
    return ml_collections.FrozenConfigDict(model_config)


def init_cache(model_config: ml_collections.ConfigDict, batch_size: int) -> dict:
    """An empty cache for `batch_size` sequences: zeros shaped by a decode-mode init."""
    def init(ids_BxL):
        return Transformer(model_config).init(jax.random.key(0), ids_BxL, decode=True)["cache"]
    shapes = jax.eval_shape(init, jax.ShapeDtypeStruct((batch_size, 1), jnp.int32))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


@functools.partial(jax.jit, static_argnums=3)
def prefill(params: dict, cache: dict, ids_BxL: jax.Array,
            model_config: ml_collections.FrozenConfigDict) -> tuple[jax.Array, dict]:
    """Runs L tokens through the model after those already cached: (logits [B, L, V], cache)."""
    logits_BxLxV, variables = Transformer(model_config).apply(
        {"params": params, "cache": cache}, ids_BxL, decode=True, mutable=["cache"])
    return logits_BxLxV, variables["cache"]


@functools.partial(jax.jit, static_argnums=3)
def decode_step(params: dict, cache: dict, token_B: jax.Array,
                model_config: ml_collections.FrozenConfigDict) -> tuple[jax.Array, dict]:
    """Appends one token per sequence to the cache: (next-token logits [B, V], cache)."""
    logits_Bx1xV, cache = prefill(params, cache, token_B[:, None], model_config)
    return logits_Bx1xV[:, 0], cache


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
    rank_V = jnp.arange(vocab_size)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab_size), vocab_size)
    sorted_BxV = jnp.where(rank_V < k, sorted_BxV, -jnp.inf)
    # Nucleus: keep a token while the mass ranked above it is below top_p; the
    # first always stays, so a tiny top_p is greedy.
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    mass_above_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    kept_B = jnp.minimum(jnp.sum(mass_above_BxV < top_p, axis=-1), k)
    threshold_B = jnp.take_along_axis(sorted_BxV, kept_B[:, None] - 1, axis=-1)
    filtered_BxV = jnp.where(scaled_BxV >= threshold_B, scaled_BxV, -jnp.inf)

    drawn_B = jax.random.categorical(key, filtered_BxV, axis=-1)
    return jnp.where(temperature > 0, drawn_B, greedy_B).astype(jnp.int32)


def _check_prompt(model_config: ml_collections.ConfigDict, prompt_ids: list[int]) -> None:
    m = model_config
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; give at least one token (e.g. the end-of-text id)")
    if len(prompt_ids) >= m.max_len:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens but model.max_len={m.max_len} leaves no room "
                         f"to generate; keep at most the last {m.max_len - 1} tokens")
    if min(prompt_ids) < 0 or max(prompt_ids) >= m.vocab_size:
        raise ValueError(f"prompt ids must lie in [0, {m.vocab_size}); was it encoded with this model's tokenizer?")


def generate(params: dict, model_config: ml_collections.ConfigDict, prompt_ids: list[int], *,
             max_new_tokens: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, eot_id: int | None = None) -> list[int]:
    """The tokens that follow `prompt_ids`: up to max_new_tokens, fewer at end-of-text
    (which is not returned) or when prompt + new tokens reach model.max_len."""
    _check_prompt(model_config, prompt_ids)
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 (0 = greedy), top_k >= 0 (0 = off) and 0 < top_p <= 1; "
                         f"got temperature={temperature}, top_k={top_k}, top_p={top_p}")
    m = _frozen(model_config)
    params = nn.meta.unbox(params)
    logits_1xLxV, cache = prefill(params, init_cache(m, 1), jnp.asarray([prompt_ids], jnp.int32), m)
    logits_1xV = logits_1xLxV[:, -1]
    budget = min(max_new_tokens, m.max_len - len(prompt_ids))
    # Each token's key depends only on the seed and its position, so a run repeats exactly.
    seed_key = jax.random.key(seed)
    new_ids: list[int] = []
    for position in range(len(prompt_ids), len(prompt_ids) + budget):
        token_1 = sample_token(logits_1xV, jax.random.fold_in(seed_key, position),
                               temperature, top_k, top_p, m.vocab_size)
        token = int(token_1[0])
        if token == eot_id:
            break
        new_ids.append(token)
        if len(new_ids) < budget:  # the last token need not go through the model
            logits_1xV, cache = decode_step(params, cache, token_1, m)
    return new_ids
