"""The pure functions that run under `jit`: state init, the train step, the eval step (row or token losses).

The training state is a plain dict pytree {"step", "params", "opt_state"}; the
loop (`train_loop.py`) jits these with explicit shardings.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import PartitionSpec as P

from andrea_jax import diagnostics, loss_scale, model, precision
from andrea_jax.sharding import BATCH_AXES

State = dict[str, Any]


def init_state(rng: jax.Array, config: ml_collections.ConfigDict, tx: optax.GradientTransformation) -> State:
    """Boxed state: params and their optimizer moments carry logical axis names; float16 compute adds the
    dynamic loss scale ("loss_scale", see loss_scale.py)."""
    params = model.init_params(config.model, rng)
    # optax maps over the boxes, so mu and nu inherit the params' axis names.
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
    if precision.resolve_dtype_name(config.model.dtype) == "float16":
        state["loss_scale"] = loss_scale.init()
    return state


def token_losses(params: Any, model_config: ml_collections.ConfigDict, batch_BxLp1: jax.Array,
                 dropout_rng: jax.Array | None = None, diagnose: bool = False) -> tuple[jax.Array, dict]:
    """The one place the loss is asked for (the model's head computes it: `model.next_token_losses`): each
    target token's next-token loss [B, L] (float32) over a [B, L+1] window batch, and with `diagnose` the
    pass's per-depth stream statistics (`diagnostics.stream_stats`; else {}). Dropout runs when
    `dropout_rng` is given."""
    inputs_BxL, targets_BxL = batch_BxLp1[:, :-1], batch_BxLp1[:, 1:]
    deterministic = dropout_rng is None
    out = model.Transformer(model_config).apply(
        {"params": params}, inputs_BxL, deterministic=deterministic, targets_BxL=targets_BxL,
        rngs=None if deterministic else {"dropout": dropout_rng}, mutable=[model.DIAGNOSTICS] if diagnose else False)
    losses_BxL, variables = out if diagnose else (out, {})
    return losses_BxL, diagnostics.stream_stats(variables[model.DIAGNOSTICS], model_config) if diagnose else {}


def split_microbatches(batch_BxLp1: jax.Array, num_micro: int) -> jax.Array:
    """[B, L+1] -> [M, B/M, L+1]. Micro-batch m takes rows m, m+M, m+2M...: every device keeps its
    own rows in every micro-batch, so the split moves no data."""
    batch_size, width = batch_BxLp1.shape
    micro_MxBxLp1 = batch_BxLp1.reshape(batch_size // num_micro, num_micro, width).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(micro_MxBxLp1, P(None, BATCH_AXES, None))


def make_train_step(config: ml_collections.ConfigDict, tx: optax.GradientTransformationExtraArgs,
                    schedule: optax.Schedule) -> Callable[[State, jax.Array], tuple[State, dict]]:
    """train_step(state, batch [B, L+1]) -> (state, metrics); gradients accumulated over micro-batches.

    `tx` is `optimizer.make`'s, whose update takes the rate `schedule` gives the state's step.
    With config.diagnostics the metrics also hold the "diag/..." keys of `diagnostics.py`."""
    num_micro = max(1, int(config.microbatches))  # 0 (automatic) is resolved by `fit.fit`; alone it means 1
    use_dropout = config.model.dropout > 0.0
    diagnose = bool(config.diagnostics)

    def grads_of(params, micro_BxLp1, rng, scale):
        """(loss, grads of scale × loss, stream stats); the stats are {} unless diagnosing."""
        def scaled_loss(params):
            losses_BxL, stats = token_losses(params, config.model, micro_BxLp1, rng if use_dropout else None, diagnose)
            loss = losses_BxL.mean()
            return scale * loss, (loss, stats)

        (_, (loss, stats)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        return loss, grads, stats

    def train_step(state: State, batch_BxLp1: jax.Array) -> tuple[State, dict]:
        params = state["params"]
        scaling = "loss_scale" in state
        scale = state["loss_scale"]["scale"] if scaling else jnp.float32(1)
        # Dropout keys fold the step in: a resumed run draws the same masks.
        step_rng = jax.random.fold_in(jax.random.key(config.seed), state["step"])
        if num_micro == 1:
            loss, grads, stats = grads_of(params, batch_BxLp1, step_rng, scale)
        else:
            micro_MxBxLp1 = split_microbatches(batch_BxLp1, num_micro)

            def accumulate(carry, inputs):
                index, micro_BxLp1 = inputs
                loss, grads, stats = grads_of(params, micro_BxLp1, jax.random.fold_in(step_rng, index), scale)
                loss_sum, grad_sum = carry
                return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), stats

            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss_sum, grads), stats_M = jax.lax.scan(accumulate, zeros, (jnp.arange(num_micro), micro_MxBxLp1))
            loss = loss_sum / num_micro
            stats = jax.tree.map(lambda s: s.mean(0), stats_M)
        grads = jax.tree.map(lambda g: g / (num_micro * scale), grads)  # float32: unscaled exactly

        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # The rate of step k is schedule(k) whatever came before: one number, applied and logged.
        learning_rate = schedule(state["step"])
        updates, new_opt_state = tx.update(grads, state["opt_state"], params, learning_rate=learning_rate)
        new_params = optax.apply_updates(params, updates)
        # A non-finite step leaves params and moments as they were; its batch is spent and the
        # schedule moves on with the step. float32 and bfloat16 runs stop on the `finite` flag
        # before anything is saved; float16 skips the step (below).
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_state = {"step": state["step"] + 1,
                     "params": keep(new_params, params),
                     "opt_state": keep(new_opt_state, state["opt_state"])}
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": learning_rate, "finite": finite}
        if scaling:
            # Gradients that overflowed the scaled backward skip the step and halve the scale;
            # the run stops only on a non-finite loss or once halving cannot help (scale below 1).
            new_state["loss_scale"] = loss_scale.update(state["loss_scale"], finite)
            metrics["finite"] = jnp.isfinite(loss) & (finite | (new_state["loss_scale"]["scale"] >= 1))
            metrics.update(loss_scale=scale, skipped_steps=new_state["loss_scale"]["skipped_steps"])
        if diagnose:
            metrics.update(diagnostics.metrics(stats, diagnostics.block_grad_norms(grads, config.model)))
        return new_state, metrics

    return train_step


def make_eval_step(config: ml_collections.ConfigDict, per_token: bool = False) -> Callable[[Any, jax.Array], jax.Array]:
    """eval_step(params, batch [B, L+1]) -> each row's mean loss [B], or with `per_token` each target token's
    loss [B, L] (float32, for scoring parts of a row: HellaSwag's endings); one micro-batch at a time as in training."""
    num_micro = max(1, int(config.microbatches))

    def per_micro(params: Any, micro_BxLp1: jax.Array) -> jax.Array:
        losses_BxL = token_losses(params, config.model, micro_BxLp1)[0]
        return losses_BxL if per_token else losses_BxL.mean(1)

    def step(params: Any, batch_BxLp1: jax.Array) -> jax.Array:
        if num_micro == 1:
            return per_micro(params, batch_BxLp1)
        out_MxBm = jax.lax.map(lambda micro_BxLp1: per_micro(params, micro_BxLp1),
                               split_microbatches(batch_BxLp1, num_micro))
        # micro-batch m held rows m, m+M, ...: back in row order
        return out_MxBm.swapaxes(0, 1).reshape(-1, *out_MxBm.shape[2:])
    return step
