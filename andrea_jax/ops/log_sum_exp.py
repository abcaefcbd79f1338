"""Each row's log-sum-exp in one pass (the recomputing attention's and the chunked loss's statistic)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def log_sum_exp(logits_BxCxV: jax.Array, *summed_BxCxV: jax.Array) -> tuple[jax.Array, ...]:
    """Each row's log-sum-exp over the last axis, then each of `summed_BxCxV`'s row sums, in one pass.

    The running (maximum, sum of exponentials below it) pair is one reduction, so the logits are
    read once, not once for the maximum and again for the sum as in optax's loss or
    `jax.nn.logsumexp`; the sums ride in the same reduction.
    """
    def combine(left, right):
        (max_a, sum_a, *more_a), (max_b, sum_b, *more_b) = left, right
        top = jnp.maximum(max_a, max_b)
        return (top, sum_a * jnp.exp(max_a - top) + sum_b * jnp.exp(max_b - top),
                *(a + b for a, b in zip(more_a, more_b)))

    # float32's minimum rather than -inf as the start: two starts combine to exp(0) × 0, not NaN.
    starts = (jnp.float32(jnp.finfo(jnp.float32).min), jnp.float32(0)) + (jnp.float32(0),) * len(summed_BxCxV)
    top_BxC, sum_BxC, *sums_BxC = jax.lax.reduce((logits_BxCxV, jnp.ones_like(logits_BxCxV), *summed_BxCxV),
                                                 starts, combine, (logits_BxCxV.ndim - 1,))
    return (top_BxC + jnp.log(sum_BxC), *sums_BxC)
