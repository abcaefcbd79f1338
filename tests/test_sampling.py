"""Generation with a KV cache against full forward passes, and the sampling filters."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from andrea_jax import model
from andrea_jax.gpt2 import interop
from andrea_jax.tools import sampling
from tests.test_model import forward, init, small_model

PROMPT = [5, 17, 42, 8, 99]


@functools.partial(jax.jit, static_argnums=2)
def _forward(params: dict, ids_BxL: jax.Array, model_config: ml_collections.FrozenConfigDict) -> jax.Array:
    return model.Transformer(model_config).apply({"params": params}, ids_BxL)


def greedy_without_cache(params: dict, model_config: ml_collections.ConfigDict, prompt_ids: list[int],
                         max_new_tokens: int) -> list[int]:
    """The reference for the cached path: every step re-runs the whole sequence."""
    m = ml_collections.FrozenConfigDict(model_config)
    params = nn.meta.unbox(params)
    ids = list(prompt_ids)
    # Padded to max_len so one program serves every step; causal attention keeps the
    # padding from reaching the position read.
    while len(ids) < min(len(prompt_ids) + max_new_tokens, m.max_len):
        padded_1xL = np.zeros((1, m.max_len), np.int32)
        padded_1xL[0, :len(ids)] = ids
        logits_V = _forward(params, jnp.asarray(padded_1xL), m)[0, len(ids) - 1, :m.vocab_size]
        ids.append(int(jnp.argmax(logits_V)))
    return ids[len(prompt_ids):]


def model_and_params(scale=4.0, **options):
    """A small model (max_len 16) with weights scaled up, so the logits are far from flat."""
    m = small_model()
    params = init(m, scale=scale)
    other = small_model(**options)
    return other, interop.from_gpt2(interop.to_gpt2(params, m), other)


def test_cache_shapes_and_dtype():
    cache = sampling.init_cache(small_model(dtype="bfloat16"), batch_size=2)
    assert cache["block_1"]["attn"]["key"].shape == (2, 16, 4, 16)
    assert cache["block_1"]["attn"]["value"].dtype == jnp.bfloat16
    assert cache["index"].shape == () and int(cache["index"]) == 0
    scanned = sampling.init_cache(small_model(scan_layers=True), batch_size=2)
    assert scanned["blocks"]["block"]["attn"]["key"].shape == (2, 2, 16, 4, 16)  # layer axis first


@pytest.mark.parametrize("options", [dict(), dict(scan_layers=True, remat=True)])
def test_prefill_and_decode_steps_give_the_full_forward_logits(options):
    m, params = model_and_params(**options)
    ids = np.random.default_rng(0).integers(0, m.vocab_size, (2, 9))
    full = np.asarray(forward(m, params, ids))
    assert np.abs(full).max() > 1.0
    tol = dict(atol=2e-5 * np.abs(full).max(), rtol=0)
    frozen = ml_collections.FrozenConfigDict(m)
    logits, cache = sampling.prefill(params, sampling.init_cache(m, 2), jnp.asarray(ids[:, :5]), frozen)
    np.testing.assert_allclose(np.asarray(logits), full[:, :5], **tol)
    for t in range(5, 9):  # one token a step
        logits, cache = sampling.prefill(params, cache, jnp.asarray(ids[:, t:t + 1]), frozen)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, t], **tol)
    assert int(cache["index"]) == 9


@pytest.mark.parametrize("scan_layers", [False, True])
def test_greedy_with_cache_equals_greedy_without(scan_layers):
    m, params = model_and_params(scan_layers=scan_layers)
    expected = greedy_without_cache(params, m, PROMPT, max_new_tokens=11)
    assert len(expected) == 11 and len(set(expected)) > 3  # not one token repeated
    assert sampling.generate(params, m, PROMPT, max_new_tokens=11, temperature=0.0) == expected


def test_top_k_1_and_tiny_top_p_are_greedy():
    m, params = model_and_params()
    greedy = greedy_without_cache(params, m, PROMPT, max_new_tokens=8)
    assert sampling.generate(params, m, PROMPT, max_new_tokens=8, top_k=1, seed=3) == greedy
    assert sampling.generate(params, m, PROMPT, max_new_tokens=8, top_p=1e-6, seed=3) == greedy
    # and plain sampling from these logits does differ, so the checks above mean something
    assert sampling.generate(params, m, PROMPT, max_new_tokens=8, temperature=2.0, seed=3) != greedy


def test_seed_fixes_the_sample():
    m, params = model_and_params(scale=1.0)  # small weights: a flat-ish distribution
    draw = lambda seed: sampling.generate(params, m, PROMPT, max_new_tokens=10, seed=seed)
    first = draw(0)
    assert len(first) == 10
    assert draw(0) == first
    assert draw(1) != first


def test_filters_keep_only_the_allowed_tokens():
    # probabilities 0.5, 0.3, 0.15, 0.05 on tokens 3, 0, 2, 1
    logits_1xV = jnp.log(jnp.array([[0.3, 0.05, 0.15, 0.5]]))
    keys = jax.random.split(jax.random.key(0), 400)
    draw = jax.vmap(lambda key, top_k, top_p: sampling.sample_token(logits_1xV, key, 1.0, top_k, top_p, 4)[0],
                    in_axes=(0, None, None))
    assert set(np.asarray(draw(keys, 0, 1.0)).tolist()) == {0, 1, 2, 3}
    assert set(np.asarray(draw(keys, 2, 1.0)).tolist()) == {3, 0}
    assert set(np.asarray(draw(keys, 0, 0.7)).tolist()) == {3, 0}  # 0.5 + 0.3 reaches 0.7
    assert set(np.asarray(draw(keys, 3, 0.9)).tolist()) == {3, 0, 2}
    assert int(sampling.sample_token(logits_1xV, keys[0], 0.0, 0, 1.0, 4)[0]) == 3


def test_padded_vocabulary_rows_are_never_sampled():
    # Even if the padding columns held the largest logits, they are cut off.
    logits_1xV = jnp.concatenate([jnp.zeros((1, 101)), jnp.full((1, 27), 50.0)], axis=1)
    keys = jax.random.split(jax.random.key(0), 300)
    tokens = jax.vmap(lambda key: sampling.sample_token(logits_1xV, key, 1.0, 0, 1.0, 101))(keys)
    assert int(tokens.max()) < 101 and len(set(np.asarray(tokens).ravel().tolist())) > 50
    assert int(sampling.sample_token(logits_1xV, keys[0], 0.0, 0, 1.0, 101)[0]) < 101
    # and through the model: a padded vocabulary at a high temperature stays in range
    m, params = model_and_params(scale=1.0, vocab_pad_multiple=64)
    assert params["token_embed"].shape[0] == 128
    out = sampling.generate(params, m, PROMPT, max_new_tokens=11, temperature=5.0)
    assert len(out) == 11 and max(out) < m.vocab_size


def test_stops_at_end_of_text_without_returning_it():
    m, params = model_and_params()
    greedy = sampling.generate(params, m, PROMPT, max_new_tokens=11, temperature=0.0)
    stop = next(i for i in range(2, 11) if greedy[i] not in greedy[:i])
    assert sampling.generate(params, m, PROMPT, max_new_tokens=11, temperature=0.0,
                             eot_id=greedy[stop]) == greedy[:stop]
    # A model whose every prediction is end-of-text gives nothing, even when sampling.
    eot = 100
    params = dict(params, ln_f=dict(scale=jnp.zeros(64), bias=30.0 * params["token_embed"][eot]))
    assert sampling.generate(params, m, PROMPT, max_new_tokens=5, eot_id=eot) == []
    assert sampling.generate(params, m, PROMPT, max_new_tokens=5) == [eot] * 5


def test_length_limits():
    m, params = model_and_params()
    assert len(sampling.generate(params, m, list(range(10)), max_new_tokens=100, temperature=0.0)) == 6
    assert len(sampling.generate(params, m, list(range(10)), max_new_tokens=3, temperature=0.0)) == 3
