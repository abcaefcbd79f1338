"""AdamW with linear warmup, cosine/linear decay to a floor, and global-norm clipping.

The train step passes each update its learning rate, the schedule at the state's step: a float16 step
skipped on overflow still moves the schedule on (PyTorch's GradScaler with a scheduler does the same), and the
rate logged is the rate applied.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then decay to `min_learning_rate_ratio` × peak at `steps`."""
    o = config.optimizer
    peak = o.learning_rate
    warmup = min(int(o.warmup_steps), int(config.steps))
    decay_steps = max(1, int(config.steps) - warmup)
    if o.decay == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=o.min_learning_rate_ratio)
    elif o.decay == "linear":
        after = optax.linear_schedule(peak, peak * o.min_learning_rate_ratio, decay_steps)
    else:
        after = optax.constant_schedule(peak)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def weight_decay_mask(params: Any, decay_embedding: bool) -> Any:
    """True for the matrices that decay.

    Biases and LayerNorm gains only shift and scale; decaying them pulls the model toward a degenerate function,
    so (as GPT-2 and nanoGPT do) only matrices decay. The position table is a lookup, not a map: it is left out.
    The tied token embedding is both; `decay_embedding` decides.
    """
    def decays(path, leaf) -> bool:
        # The last dict key names the parameter (boxed params add a `.value` after it).
        name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
        return {"token_embed": decay_embedding, "position_embed": False}.get(name, name.endswith("_kernel"))

    return jax.tree_util.tree_map_with_path(decays, params)


def scale_by_passed_learning_rate() -> optax.GradientTransformationExtraArgs:
    """Multiplies the updates by -learning_rate, passed to `update` as a keyword.

    optax's schedules read their own count of updates made, which a skipped step does not
    advance, so they would fall behind the train state's step. The state is still optax's
    ScaleByScheduleState (counting updates made): checkpoints keep `optax.adamw`'s layout.
    """
    def init(params: Any) -> optax.ScaleByScheduleState:
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates: Any, state: optax.ScaleByScheduleState, params: Any = None, *,
               learning_rate: jax.Array) -> tuple[Any, optax.ScaleByScheduleState]:
        updates = jax.tree.map(lambda u: jnp.array(-learning_rate, u.dtype) * u, updates)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)


def make(config: ml_collections.ConfigDict) -> optax.GradientTransformationExtraArgs:
    """Clipping, then AdamW; `update(grads, opt_state, params, learning_rate=...)` takes the rate."""
    o = config.optimizer
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip_norm),
        optax.chain(  # optax.adamw's three stages, the last one taking the rate it is given
            optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
            optax.add_decayed_weights(o.weight_decay, mask=lambda params: weight_decay_mask(params, o.decay_embedding)),
            scale_by_passed_learning_rate()))
