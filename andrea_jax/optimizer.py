"""AdamW or Muon, with linear warmup, a decay to a floor (cosine, linear, or warmup-stable-decay), and global-norm
clipping.

The train step passes each update its learning rate, the schedule at the state's step: a float16 step
skipped on overflow still moves the schedule on (PyTorch's GradScaler with a scheduler does the same), and the
rate logged is the rate applied.
"""

from __future__ import annotations

import itertools
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
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: the steepest at zero that converges

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


def _as_matrices(update: jax.Array, dims: optax.contrib.MuonDimensionNumbers) -> tuple[jax.Array, Any]:
    """The matrices `dims` names in `update` as [n, rows, cols] with rows ≤ cols (a tall one transposed), and the
    function that puts such a stack back into `update`'s shape."""
    axes = [tuple(a % update.ndim for a in ((axis,) if isinstance(axis, int) else axis))
            for axis in (dims.reduction_axis, dims.output_axis)]
    batch = tuple(a for a in range(update.ndim) if a not in axes[0] + axes[1])
    order = batch + axes[0] + axes[1]
    x = update.transpose(order).reshape([math.prod(update.shape[a] for a in group) for group in (batch, *axes)])
    tall = x.shape[1] > x.shape[2]

    def back(stack: jax.Array) -> jax.Array:
        stack = jnp.swapaxes(stack, 1, 2) if tall else stack
        return stack.astype(update.dtype).reshape([update.shape[a] for a in order]).transpose(
            sorted(range(update.ndim), key=order.__getitem__))

    return (jnp.swapaxes(x, 1, 2) if tall else x), back


def newton_schulz(x: jax.Array, steps: int, coefficients: jax.Array, dtype) -> jax.Array:
    """Newton–Schulz's quintic iteration towards the nearest semi-orthogonal matrix of each of x's
    [n, rows ≤ cols] matrices, in `dtype`, after a Frobenius normalisation in x's own:
    x ← a·x + (b·G + c·G·G)·x with G = x·xᵀ."""
    x = (x / (jnp.linalg.norm(x, axis=(1, 2), keepdims=True) + 1e-8)).astype(dtype)
    a, b, c = coefficients.astype(dtype)
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, 1, 2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def orthogonalise_all(updates: Any, steps: int, coefficients: jax.Array, dtype) -> Any:
    """`newton_schulz` of every matrix of the Muon group (`MUON_MATRICES`), those of one shape stacked into one
    batch: one run of kernels for the 12 blocks' MLP matrices, not 12 (an accelerator runs a kernel at a time,
    and a batch of 768 × 768 products fills its cores where one does not)."""
    # Inside optax.partition the other group's leaves are MaskedNodes, empty subtrees that have no leaves here.
    leaves, tree = jax.tree_util.tree_flatten_with_path(updates)
    stacks = [_as_matrices(leaf, MUON_MATRICES[parameter_name(path)]) for path, leaf in leaves]
    by_shape: dict[tuple, list[int]] = {}
    for i, (x, _) in enumerate(stacks):
        by_shape.setdefault(x.shape[1:], []).append(i)
    directions = [None] * len(leaves)
    for members in by_shape.values():
        together = newton_schulz(jnp.concatenate([stacks[i][0] for i in members]), steps, coefficients, dtype)
        sizes = [stacks[i][0].shape[0] for i in members]
        for i, part in zip(members, jnp.split(together, list(itertools.accumulate(sizes))[:-1])):
            directions[i] = stacks[i][1](part)
    return jax.tree_util.tree_unflatten(tree, directions)


def scale_by_muon(steps: int, momentum: float, dtype) -> optax.GradientTransformation:
    """Muon's direction: Nesterov momentum as optax.contrib's (debiased, in the parameters' dtype), then each
    matrix orthogonalised (`orthogonalise_all`) in `dtype`. Its state is optax.contrib.MuonState, so a checkpoint
    of either restores into the other. bfloat16 iterations take an accelerator's tensor cores at their full
    rate (modded-nanogpt and nanochat run them so); float32 is optax's own computation."""

    def init(params):
        return optax.contrib.MuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params),
                                       ns_coeffs=jnp.asarray(NEWTON_SCHULZ_COEFFICIENTS))

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, momentum, 1)
        count = optax.safe_increment(state.count)
        ahead = optax.tree.bias_correction(mu, momentum, optax.safe_increment(count))
        mu_hat = jax.tree.map(lambda m, g: momentum * m + (1 - momentum) * g, ahead,
                              optax.tree.bias_correction(updates, momentum, count))
        return (orthogonalise_all(mu_hat, steps, state.ns_coeffs, dtype),
                optax.contrib.MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs))

    return optax.GradientTransformation(init, update)


def _scale_to_adam_rms() -> optax.GradientTransformation:
    """Multiplies each orthogonalised update by MUON_UPDATE_RMS × sqrt(max(fan_in, fan_out)) of its matrices."""
    def scale(path, update):
        dims = MUON_MATRICES[parameter_name(path)]
        fans = [math.prod(update.shape[axis] for axis in (axes if isinstance(axes, tuple) else (axes,)))
                for axes in (dims.reduction_axis, dims.output_axis)]
        return update * jnp.asarray(MUON_UPDATE_RMS * math.sqrt(max(fans)), update.dtype)

    return optax.stateless(lambda updates, params: jax.tree_util.tree_map_with_path(scale, updates))


def _decided(dtype_name: str) -> jnp.dtype:
    if dtype_name == "auto":
        raise ValueError("optimizer.muon_ns_dtype='auto' is decided for the devices by resolve.for_devices first")
    return jnp.dtype(dtype_name)


def make(config: ml_collections.ConfigDict) -> optax.GradientTransformationExtraArgs:
    """Clipping, then AdamW or Muon; `update(grads, opt_state, params, learning_rate=...)` takes the rate.

    Muon is assembled as `optax.contrib.muon` assembles it (momentum and Newton–Schulz, then the RMS scaling),
    with its iterations in `optimizer.muon_ns_dtype`, today's AdamW for the other group and the same decoupled
    weight decay and passed rate for both (`MUON_UPDATE_RMS` says why one rate serves both)."""
    o = config.optimizer
    adam = optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps)
    if o.name == "muon":
        direction = optax.partition({
            "muon": optax.chain(
                scale_by_muon(int(o.muon_ns_steps), o.muon_momentum, _decided(o.muon_ns_dtype)),
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
