"""Dynamic loss scaling, for float16 compute: small gradients survive float16's narrow range.

float16 flushes magnitudes below about 6e-8 to zero, and a language model's cotangents sit there. The loss is
multiplied by a scale before the backward pass and the float32 gradients divided by it after; a step whose
gradients overflowed is skipped and the scale halved, and after `GROWTH_INTERVAL` good steps in a row it
doubles. The scale lives in the train state, so a checkpoint carries it and a resumed run is exact. bfloat16
and float32 need none: their exponent range is float32's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROWTH_INTERVAL = 2000  # good steps before the scale doubles
INITIAL_SCALE = 2.0 ** 16


def init() -> dict:
    return {"scale": jnp.asarray(INITIAL_SCALE, jnp.float32), "good_steps": jnp.zeros((), jnp.int32),
            "skipped_steps": jnp.zeros((), jnp.int32)}


def update(state: dict, finite: jax.Array) -> dict:
    """The scale after a step whose gradients were `finite` (or not: then the step was skipped)."""
    good_steps = state["good_steps"] + 1
    grow = finite & (good_steps >= GROWTH_INTERVAL)
    scale = jnp.where(finite, jnp.where(grow, 2 * state["scale"], state["scale"]), state["scale"] / 2)
    return {"scale": scale, "good_steps": jnp.where(finite & ~grow, good_steps, 0),
            "skipped_steps": state["skipped_steps"] + (~finite).astype(jnp.int32)}
