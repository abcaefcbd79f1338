"""AdamW or Muon, with linear warmup, a decay to a floor (cosine, linear, or warmup-stable-decay), and global-norm
clipping.

The train step passes each update its learning rate, the schedule at the state's step: a float16 step
skipped on overflow still moves the schedule on (PyTorch's GradScaler with a scheduler does the same), and the
rate logged is the rate applied.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax


# Muon's orthogonalised update has every singular value near 1, an RMS of about 1/sqrt(max(rows, cols)); scaled
# to 0.2 × sqrt(max(rows, cols)) it has AdamW's typical update RMS of about 0.2 (Moonlight, Liu et al. 2025), so
# one learning rate and one weight decay serve both groups and AdamW's rates carry over.
MUON_UPDATE_RMS = 0.2

# The blocks' matrices Muon orthogonalises, by parameter name: which axes are a matrix's inputs (reduction) and
# outputs; every other axis (q, k, v's stacking axis; scan_layers' leading depth axis) is a batch of matrices.
# q, k and v are each the [D, H·K] projection they stand for (as three separate Linear layers would be), not one
# [D, 3·H·K] matrix (which would tie their scales together) nor per head (a [D, K] slice is 12× taller than wide,
# and orthogonalising it equalises heads that are meant to differ).
MUON_MATRICES = {
    "qkv_kernel": optax.contrib.MuonDimensionNumbers(reduction_axis=-4, output_axis=(-2, -1)),  # [D, 3, H, K]
    "out_kernel": optax.contrib.MuonDimensionNumbers(reduction_axis=(-3, -2), output_axis=-1),  # [H, K, D]
    **{name: optax.contrib.MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)  # [D, F] or [F, D]
       for name in ("fc_kernel", "gate_kernel", "proj_kernel")},
}


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then decay to `min_learning_rate_ratio` × peak at `steps`.

    "wsd" holds the peak until the last `cooldown_steps`, then cools down to the floor ("linear", or
    "1-sqrt": floor + (peak - floor)(1 - sqrt(t / cooldown_steps))). Only the cooldown depends on `steps`, so
    a run resumed with other `steps` while at its peak applies the same rates as before up to the new cooldown.
    """
    o = config.optimizer
    peak, floor = o.learning_rate, o.learning_rate * o.min_learning_rate_ratio
    warmup = min(int(o.warmup_steps), int(config.steps))
    decay_steps = max(1, int(config.steps) - warmup)
    phases, boundaries = [optax.linear_schedule(0.0, peak, warmup)], [warmup]
    if o.decay == "cosine":
        phases.append(optax.cosine_decay_schedule(peak, decay_steps, alpha=o.min_learning_rate_ratio))
    elif o.decay == "linear":
        phases.append(optax.linear_schedule(peak, floor, decay_steps))
    elif o.decay == "wsd":
        cooldown = int(o.cooldown_steps)
        phases.append(optax.constant_schedule(peak))
        boundaries.append(int(config.steps) - cooldown)
        if o.cooldown_shape == "linear":
            phases.append(optax.linear_schedule(peak, floor, cooldown))
        else:
            phases.append(lambda t: floor + (peak - floor) * (1 - jnp.sqrt(jnp.clip(t / cooldown, 0.0, 1.0))))
    else:
        phases.append(optax.constant_schedule(peak))
    if warmup == 0:
        phases, boundaries = phases[1:], boundaries[1:]
    return optax.join_schedules(phases, boundaries) if boundaries else phases[0]


def cooldown_start(config: ml_collections.ConfigDict) -> int | None:
    """The step a "wsd" run's cooldown starts at; None for the other decays."""
    return int(config.steps) - int(config.optimizer.cooldown_steps) if config.optimizer.decay == "wsd" else None


def weight_decay_mask(params: Any, decay_embedding: bool) -> Any:
    """True for the matrices that decay.

    Biases and LayerNorm gains only shift and scale; decaying them pulls the model toward a degenerate function,
    so (as GPT-2 and nanoGPT do) only matrices decay. The position table is a lookup, not a map: it is left out.
    The tied token embedding is both; `decay_embedding` decides.
    """
    def decays(path, leaf) -> bool:
        name = parameter_name(path)
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


def parameter_name(path: tuple) -> str:
    """The last dict key of a parameter's path (boxed params add a `.value` after it)."""
    return [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]


def muon_groups(params: Any) -> Any:
    """"muon" for the blocks' matrices (`MUON_MATRICES`), "adam" for the rest: the token table (tied to the
    output head, so both a lookup and the last projection), the position table, LayerNorms and biases."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "muon" if parameter_name(path) in MUON_MATRICES else "adam",
                                            params)


def _muon_dimensions(updates: Any) -> Any:
    # Inside optax.partition the other group's leaves are MaskedNodes, empty subtrees that tree_map keeps as they are.
    return jax.tree_util.tree_map_with_path(lambda path, _: MUON_MATRICES[parameter_name(path)], updates)


def _scale_to_adam_rms() -> optax.GradientTransformation:
    """Multiplies each orthogonalised update by MUON_UPDATE_RMS × sqrt(max(fan_in, fan_out)) of its matrices."""
    def scale(path, update):
        dims = MUON_MATRICES[parameter_name(path)]
        fans = [math.prod(update.shape[axis] for axis in (axes if isinstance(axes, tuple) else (axes,)))
                for axes in (dims.reduction_axis, dims.output_axis)]
        return update * jnp.asarray(MUON_UPDATE_RMS * math.sqrt(max(fans)), update.dtype)

    return optax.stateless(lambda updates, params: jax.tree_util.tree_map_with_path(scale, updates))


def make(config: ml_collections.ConfigDict) -> optax.GradientTransformationExtraArgs:
    """Clipping, then AdamW or Muon; `update(grads, opt_state, params, learning_rate=...)` takes the rate.

    Muon is optax.contrib's, assembled as `optax.contrib.muon` assembles it (momentum and Newton–Schulz,
    then the RMS scaling) but with today's AdamW for the other group and the same decoupled weight decay and
    passed rate for both (`MUON_UPDATE_RMS` says why one rate serves both)."""
    o = config.optimizer
    adam = optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps)
    if o.name == "muon":
        direction = optax.partition({
            "muon": optax.chain(
                optax.contrib.scale_by_muon(ns_steps=int(o.muon_ns_steps), beta=o.muon_momentum, nesterov=True,
                                            weight_dimension_numbers=_muon_dimensions),
                _scale_to_adam_rms()),
            "adam": adam}, muon_groups)
    else:
        direction = adam
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip_norm),
        optax.chain(  # optax.adamw's three stages, the last one taking the rate it is given
            direction,
            optax.add_decayed_weights(o.weight_decay, mask=lambda params: weight_decay_mask(params, o.decay_embedding)),
            scale_by_passed_learning_rate()))
