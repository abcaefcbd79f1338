"""Compile the run's exact train and eval steps for a named TPU slice or GPU, from any machine.

    python -m andrea_jax.compile_check --config configs/andrea120m.py --topology v5e-1 [--config.x=y]

XLA's own TPU and GPU compilers run on a host without the chip; the steps are
lowered with the mesh, shardings and micro-batch choice a run on that
accelerator would use (`fit.py`), and the report says what one device holds,
the FLOPs XLA counts and, for TPUs, XLA's roofline time for the step. A step that
does not fit exits with status 2 and one line naming the fix.
"""

from __future__ import annotations

import sys

import flax.linen as nn
import jax
import ml_collections
from absl import app, flags
from ml_collections import config_flags

from andrea_jax import fit, flops, precision, sharding, targets
from andrea_jax.config import ConfigError, validate

GIB = 2 ** 30

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/andrea120m.py",
                                          lock_config=False)
_TOPOLOGY = flags.DEFINE_string("topology", None, "A TPU slice (v5e-1, v6e-1, v5e-16, v4-32, ...) or a GPU "
                                                  "described in andrea_jax/gpu_targets/ (t4, l4, a100_40gb, ...)")


def check(config: ml_collections.ConfigDict, target: targets.Target,
          report=print) -> tuple[ml_collections.ConfigDict, fit.Steps]:
    """The steps `config` compiles to on `target` (microbatches=0 chosen as a run would choose it)."""
    validate(config)
    if config.model.vocab_size == 0:
        raise ConfigError("model.vocab_size=0 is taken from the tokenizer when a run prepares its data; pass "
                          "--config.model.vocab_size with the tokenizer's size (8449 for the ANDREA BPE)")
    config = ml_collections.ConfigDict(config.to_dict())
    config.model.dtype = precision.resolve_dtype_name(config.model.dtype, target.devices[0])
    mesh = sharding.make_mesh(config, target.devices)
    axis_rules = sharding.rules(config)
    rng = jax.random.key(config.seed)  # made on this host: the target's devices cannot run it
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules):
        abstract, shardings = fit.abstract_state(config, mesh, axis_rules, rng)
        steps = fit.fit(config, mesh, abstract, shardings, target.memory_limit, report)
    return steps.config, steps


def describe(config: ml_collections.ConfigDict, steps: fit.Steps, target: targets.Target) -> str:
    """What one device holds, the step's FLOPs and XLA's roofline bound, as lines of text."""
    train, evaluate = steps.train_memory, steps.eval_memory
    gib = lambda n: f"{n / GIB:.2f} GiB"
    lines = [
        targets.describe(target),
        f"config: microbatches={config.microbatches}, remat={config.model.remat}, compute {config.model.dtype}, "
        f"mesh {sharding.describe(sharding.make_mesh(config, target.devices))}",
        f"train step, one device: arguments {gib(train.arguments)}, temporaries {gib(train.temporaries)}, "
        f"outputs {gib(train.outputs)} ({gib(train.aliased)} of them in donated arguments); "
        f"peak {gib(train.peak)}",
        f"eval step, one device (optimizer state beside it): peak {gib(evaluate.peak)}",
        f"peak {gib(steps.peak)} of {gib(target.memory_limit)} "
        f"({100 * steps.peak / target.memory_limit:.0f}%; the fit plans for {fit.HEADROOM:.0%})",
    ]
    tokens = config.batch_size * config.seq_len
    model_flops = flops.flops_per_token(config.model, config.seq_len) * tokens
    cost = steps.train.cost_analysis()
    if isinstance(cost, list):  # older jax: one dict per program
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        lines.append(f"FLOPs: {model_flops / 1e12:.2f} TFLOP a step by the model's formula; XLA gives no cost "
                     f"analysis for this platform")
        return "\n".join(lines)
    devices = len(target.devices)
    xla_flops = cost["flops"] * devices
    lines.append(f"FLOPs a step: XLA counts {xla_flops / 1e12:.2f} T ({xla_flops / tokens / 1e6:.0f} M a token), the "
                 f"model's formula {model_flops / 1e12:.2f} T ({model_flops / tokens / 1e6:.1f} M a token, "
                 f"nanoGPT/PaLM convention)")
    seconds = cost.get("optimal_seconds", -1)
    peak = flops.device_peak_flops(target.devices[0])
    if seconds > 0 and peak:
        lines.append(f"XLA's roofline time {seconds * 1e3:.0f} ms a step: an upper bound on MFU of "
                     f"{100 * model_flops / (seconds * devices * peak):.0f}% (a bound from the compiler's cost "
                     f"model, not a measurement)")
    return "\n".join(lines)


def main(argv):
    del argv
    try:
        target = targets.named(_TOPOLOGY.value)
        config, steps = check(_CONFIG.value, target)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(describe(config, steps, target), flush=True)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "topology"])
    app.run(main)
