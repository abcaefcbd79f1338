"""Compile the run's exact train and eval steps for a named TPU slice or GPU, from any machine.

    python -m andrea_jax.compile.check --config configs/andrea120m.py --topology v5e-1 [--config.x=y]

XLA's own TPU and GPU compilers run on a host without the chip; the steps are lowered with the mesh,
shardings and micro-batch choice a run on that accelerator would use (`fit.py`), and the report says
what one device holds, the step's FLOPs, the device-memory bytes it moves by part of the model, the
roofline bound on MFU they give, and the step as the chip runs it, one kernel after another
(`kernel_time.py`). A step that does not fit exits with status 2 and one line naming the fix.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import ml_collections
from absl import flags
from ml_collections import config_flags

from andrea_jax import attention, fit, flops, resolve, sharding
from andrea_jax.compile import hbm_traffic, kernel_time, targets
from andrea_jax.runtime import cli
from andrea_jax.config import ConfigError, validate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/andrea120m.py",
                                          lock_config=False)
_TOPOLOGY = flags.DEFINE_string("topology", None, "A TPU slice (v5e-1, v6e-1, v5e-16, v4-32, ...) or a GPU "
                                                  "described in andrea_jax/compile/gpu_targets/ (t4, l4, a100_40gb, ...)")


def compiled_for(config: ml_collections.ConfigDict, target: targets.Target, report=print) -> fit.Steps:
    """The steps `config` compiles to on `target` (microbatches=0 chosen as a run would choose it)."""
    validate(config)
    if config.model.vocab_size == 0:
        raise ConfigError("model.vocab_size=0 is taken from the tokenizer when a run prepares its data; pass "
                          "--config.model.vocab_size with the tokenizer's size (8449 for the ANDREA BPE)")
    config = resolve.for_devices(config, target.devices[0])
    mesh = sharding.make_mesh(config, target.devices)
    axis_rules = sharding.rules(config)
    rng = jax.random.key(config.seed)  # made on this host: the target's devices cannot run it
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules):
        abstract, shardings = fit.abstract_state(config, mesh, axis_rules, rng)
        return fit.fit(config, mesh, abstract, shardings, target.memory_limit, report)


@dataclasses.dataclass(frozen=True)
class StepCost:
    model_flops: float  # a step, all devices, nanoGPT/PaLM convention
    xla_flops: float | None  # a step, all devices, by XLA's count; None where XLA gives none (GPUs)
    hbm_bytes: dict[str, float]  # device-memory bytes a step moves on one device, by part (`hbm_traffic`)
    optimizer_flops: float  # a step, one device: Muon's Newton–Schulz iterations (0 for AdamW)
    attention_fill: float  # the share of a TPU's matrix units attention's products fill (1 elsewhere)
    roofline_seconds: float | None  # max(model FLOPs at the fill they get / peak, bytes / bandwidth) of one device
    mfu_bound: float | None  # model_flops / (roofline_seconds × devices × the chip's peak)
    estimate: kernel_time.Estimate | None = None  # the step one kernel at a time, a micro-batch loop's trips and all
    estimate_missing: str = ""  # why there is no estimate: the kind of kernel the target has no rate for

    @property
    def estimated_mfu(self) -> float | None:
        """MFU at the estimated step: the bound's, scaled by how much longer the estimate is."""
        if self.estimate is None or self.mfu_bound is None:
            return None
        return self.mfu_bound * self.roofline_seconds / self.estimate.seconds


def step_cost(steps: fit.Steps, target: targets.Target) -> StepCost:
    """FLOPs a step by the model's formula (and XLA's count), its memory traffic, and the roofline bound on MFU.

    The traffic is counted from the optimized HLO (`hbm_traffic.py`) on every target: XLA gives no
    cost analysis for GPUs, and on TPUs its "bytes accessed" counts a loop body once and charges
    operands already in on-chip memory. The compute side is the model's FLOPs, which MFU is
    measured in: XLA's counts leave out custom kernels (the attention kernels). Attention's
    products have a head's width as one side (q·kᵀ contracts over it, p·v writes it), so on a
    TPU whose matrix units are wider they fill only that share of them and take that much longer.
    There the compute side is the larger of the model's FLOPs at peak and the FLOPs the chip runs
    (attention's as its kernel computes them, `attention.products_computed`) at the rate they get:
    the bound never reads better than the chip can do. Muon's orthogonalisations add their FLOPs on each
    device (each orthogonalises whole matrices) to the compute side.
    """
    config, devices = steps.config, len(target.devices)
    width, kind = config.model.d_model // config.model.n_head, target.devices[0].device_kind
    tokens = config.batch_size * config.seq_len
    model_flops = flops.flops_per_token(config.model, config.seq_len) * tokens
    attention_flops = flops.attention_flops_per_token(config.model, config.seq_len) * tokens
    fill = target.fill_of(width)
    optimizer_flops = (flops.newton_schulz_flops(config.model, int(config.optimizer.muon_ns_steps))
                       if config.optimizer.name == "muon" else 0.0)
    cost = steps.train.cost_analysis() or {}
    xla_flops = cost["flops"] * devices * config.microbatches if "flops" in cost else None
    hlo = steps.train.as_text()
    traffic = hbm_traffic.count(hlo)
    peak = flops.device_peak_flops(target.devices[0], config.model.dtype)
    estimate, missing = None, "" if target.kernel_rates else "any kind of kernel"
    if target.kernel_rates:
        shares = attention.kernel_shares(config.model.attention, config.seq_len, width, kind)
        try:
            estimate = kernel_time.estimate(hlo, target.kernel_rates, shares, fill)
        except kernel_time.MissingRate as error:
            missing = str(error)
    if not peak or not target.memory_bytes_per_second:
        return StepCost(model_flops, xla_flops, traffic, optimizer_flops, fill, None, None, estimate, missing)
    at_peak_flops = model_flops
    if fill < 1:
        computed = attention_flops * attention.products_computed(config.model.attention, config.seq_len, width, kind)
        at_peak_flops = max(model_flops, model_flops - attention_flops + computed / fill)
    seconds = max((at_peak_flops / devices + optimizer_flops) / peak,
                  sum(traffic.values()) / target.memory_bytes_per_second)
    return StepCost(model_flops, xla_flops, traffic, optimizer_flops, fill, seconds,
                    model_flops / (seconds * devices * peak), estimate, missing)


def describe(steps: fit.Steps, target: targets.Target) -> str:
    """What one device holds, the step's FLOPs and bytes by part, and the roofline bound, as lines of text."""
    config, cost = steps.config, step_cost(steps, target)
    train, evaluate = steps.train_memory, steps.eval_memory
    gib = lambda n: f"{n / targets.GIB:.2f} GiB"
    flops_text = (f"FLOPs a step: the model's formula {cost.model_flops / 1e12:.2f} T "
                  f"({cost.model_flops / (config.batch_size * config.seq_len) / 1e6:.1f} M a token, nanoGPT/PaLM "
                  f"convention)")
    if cost.xla_flops is not None:
        flops_text += f"; XLA counts {cost.xla_flops / 1e12:.2f} T without the custom kernels"
    if cost.optimizer_flops:
        flops_text += (f"\nMuon's Newton–Schulz iterations: {cost.optimizer_flops / 1e12:.2f} T a step on each device "
                       f"({100 * cost.optimizer_flops * len(target.devices) / cost.model_flops:.1f}% of the model's), "
                       f"counted at the chip's peak; their bytes are in the optimizer's row below")
    total = sum(cost.hbm_bytes.values())
    lines = [
        f"{target.name}: {len(target.devices)} × {target.devices[0].device_kind} over {target.num_hosts} host(s), "
        f"{gib(target.memory_limit)} a device ({target.memory_source})",
        f"config: microbatches={config.microbatches}, remat={config.model.remat}, compute {config.model.dtype}, "
        f"attention {config.model.attention}, mesh {sharding.describe(sharding.make_mesh(config, target.devices))}",
        f"train step, one device: arguments {gib(train.arguments)}, temporaries {gib(train.temporaries)}, "
        f"outputs {gib(train.outputs)} ({gib(train.aliased)} of them in donated arguments); peak {gib(train.peak)}",
        f"eval step, one device (optimizer state beside it): peak {gib(evaluate.peak)}",
        f"peak {gib(steps.peak)} of {gib(target.memory_limit)} "
        f"({100 * steps.peak / target.memory_limit:.0f}%; the fit plans for {fit.HEADROOM:.0%})",
        flops_text,
        f"HBM traffic a step on one device, counted from the optimized HLO: {total / 1e9:.1f} GB",
    ]
    lines += [f"  {part:<28} {size / 1e9:7.1f} GB  {100 * size / total:3.0f}%" for part, size in cost.hbm_bytes.items()]
    if cost.attention_fill < 1:
        width = config.model.d_model // config.model.n_head
        lines.append(f"attention's products fill {100 * cost.attention_fill:.0f}% of the "
                     f"{target.matrix_unit_width}-wide matrix units with heads of {width}: the roofline counts "
                     f"them, as {config.model.attention} computes them, at that share of the peak")
    if cost.mfu_bound is not None:
        lines.append(f"roofline from the model's FLOPs and the HLO's bytes: {cost.roofline_seconds * 1e3:.0f} ms a "
                     f"step, so MFU can be at most {100 * cost.mfu_bound:.0f}% (a bound from the compiler's program, "
                     f"not a measurement)")
    lines.append(estimate_line(cost, target))
    return "\n".join(lines)


def estimate_line(cost: StepCost, target: targets.Target) -> str:
    """The step one kernel at a time, by kind, with the rates' source; or why there is no estimate."""
    if cost.estimate is None:
        return (f"estimated step, one kernel at a time: none, {target.name} has no rate for {cost.estimate_missing} "
                f"(targets.py); the bound above stands alone")
    mfu = f" (MFU {100 * cost.estimated_mfu:.0f}%)" if cost.estimated_mfu else ""
    kinds = ", ".join(f"{kind} {1e3 * value:.1f}" for kind, value in cost.estimate.seconds_by_kind.items())
    rates = target.kernel_rates
    return (f"estimated step, one kernel at a time: {1e3 * cost.estimate.seconds:.1f} ms{mfu}: {kinds} (ms; rates "
            f"{rates.source}{'' if rates.calibrated else ', not yet calibrated against a measured step'})")


def main(argv):
    del argv

    def check() -> None:
        target = targets.named(_TOPOLOGY.value)
        print(describe(compiled_for(_CONFIG.value, target), target), flush=True)

    cli.run(check, join_cluster=False)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "topology"])
    cli.run_app(main)
