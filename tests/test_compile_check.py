"""ANDREA-120M compiled for real accelerators on this host: XLA's TPU and GPU compilers need no chip.

The TPU cases need libtpu (`pip install "jax[tpu]==<the installed jax>"`), the GPU ones
JAX's CUDA plugin (requirements-gpu-compile.txt); without them they skip.
"""

import functools
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from andrea_jax import fit
from andrea_jax.compile import check, targets
from andrea_jax.config import ConfigError
from configs import andrea120m, andrea120m_fineweb10b

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu is not installed: pip install "jax[tpu]==<the installed jax>"')
_without_cuda_plugin = pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None,
                                          reason="JAX's CUDA plugin is not installed: "
                                                 "pip install -r requirements-gpu-compile.txt")


def needs_cuda_plugin(test):
    """A GPU compile: skipped without JAX's CUDA plugin, and marked `cuda_plugin`, which .ci/run's environment
    with the plugin selects (the marker, not a name, so that no such test is left out)."""
    return pytest.mark.cuda_plugin(_without_cuda_plugin(test))


def fitted(topology, **overrides):
    lines = []
    config = andrea120m.get_config()
    config.update_from_flattened_dict(overrides)
    target = targets.named(topology)
    steps = check.compiled_for(config, target, report=lines.append)
    return steps, target, lines


def assert_fits_with_the_fewest(steps, target, lines):
    """The chosen step fits with headroom, and every smaller count was tried and did not."""
    micro = steps.config.microbatches
    assert steps.peak <= fit.HEADROOM * target.memory_limit
    assert len(lines) == 1 and lines[0].endswith(f"using microbatches={micro}")
    smaller = [m for m in (1, 2, 4, 8, 16, 32) if m < micro]
    assert all(f"microbatches={m}: " in lines[0] for m in smaller)


@needs_libtpu
@pytest.mark.alone
@pytest.mark.parametrize("topology", ["v5e-1", "v6e-1"])
def test_andrea120m_as_typed_fits_one_colab_tpu_by_itself_in_one_microbatch(topology):
    steps, target, lines = fitted(topology)
    assert steps.config.model.dtype == "bfloat16" and steps.config.model.attention == "splash"
    # With the splash kernel and bf16 activations (libtpu 0.0.42) both take the whole batch at once.
    assert steps.config.microbatches == 1
    assert_fits_with_the_fewest(steps, target, lines)
    cost = check.step_cost(steps, target)
    # Heads of 64 fill half of a v5e's 128-wide matrix units and a quarter of a v6e's 256-wide ones.
    assert cost.attention_fill == {"v5e-1": 0.5, "v6e-1": 0.25}[topology]
    assert "attention's products fill" in check.describe(steps, target)
    # The estimate counts the products XLA writes as convolutions: 17.97 T, as the GPUs' programs count theirs.
    product_flops = sum(k.flops * k.times for k in cost.estimate.kernels if k.kind == "matrix products")
    assert product_flops == pytest.approx(17.97e12, rel=0.01)
    assert cost.estimate.seconds >= 0.95 * cost.roofline_seconds
    assert "not yet calibrated" in check.describe(steps, target).splitlines()[-1]
    if topology == "v5e-1":  # compute-bound: splash's 7/8 of attention's 113.2 M FLOPs a token at half the rate
        assert cost.mfu_bound == pytest.approx(662.5 / (662.5 - 113.2 + 113.2 * 0.875 / 0.5), abs=1e-3)
    else:  # bandwidth-bound: the backward takes the keys whole, so q's gradient has no partial sum per key block
        assert cost.mfu_bound >= 0.62
        assert "bf16[32,2,12,1024,64]" not in steps.train.as_text()


@needs_libtpu
@pytest.mark.alone
def test_the_fineweb10b_recipe_compiles_for_a_v6e_1_in_the_micro_batches_its_fit_takes():
    """524,288 tokens a step in 8 micro-batches of 64 (4 would need at least twice the activations: 39 GiB), each
    micro-batch's traffic counted: the TPU's loop has no known trip count, only its condition's bound."""
    config = andrea120m_fineweb10b.get_config()
    config.microbatches = 8  # what microbatches=0 finds, without the compile of 1 that the fit tries first
    target = targets.named("v6e-1")
    steps = check.compiled_for(config, target)
    memory = steps.train_memory
    assert steps.peak <= fit.HEADROOM * target.memory_limit
    assert memory.arguments + 2 * (memory.peak - memory.arguments) > fit.HEADROOM * target.memory_limit
    cost = check.step_cost(steps, target)
    assert sum(cost.hbm_bytes.values()) > 8 * 120e9  # counted once, the loop's 8 micro-batches gave 158 GB
    assert 0.5 <= cost.mfu_bound <= 0.65 and config.steps * cost.roofline_seconds / 3600 > 3.3  # hours, a bound


@needs_libtpu
def test_one_microbatch_forced_on_v5e_1_is_refused_with_the_fix():
    # XLA's own attention keeps [B, H, L, L] scores: its compiler refuses the step outright.
    with pytest.raises(ConfigError, match=r"does not fit .*XLA refused it.*set a larger --config.microbatches"):
        fitted("v5e-1", microbatches=1, **{"model.attention": "xla"})


@needs_libtpu
def test_a_multi_host_slice_compiles_with_its_mesh_across_hosts():
    # A one-block model of width 128 over 256 positions: the mesh across hosts is the point here, not the
    # size (the whole model's rows on each slice come from bench/fit_table.py); two full-width blocks
    # took this module's fourth-longest compile.
    steps, target, lines = fitted("v5e-16", **{"model.n_layer": 1, "model.d_model": 128, "model.n_head": 2,
                                               "model.vocab_size": 256, "seq_len": 256})
    assert target.num_hosts == 4 and len(target.devices) == 16
    assert steps.train.input_shardings[0][0]["params"]["token_embed"].mesh.size == 16
    assert_fits_with_the_fewest(steps, target, lines)


def test_slice_names_map_to_the_chips_and_hosts_of_cloud_tpu():
    assert targets._torus(1, 2) == [1, 1] and targets._torus(8, 2) == [2, 4] and targets._torus(16, 2) == [4, 4]
    assert targets._torus(4, 3) == [2, 2, 1] and targets._torus(16, 3) == [2, 2, 4]
    assert targets._torus(64, 3) == [4, 4, 4]
    with pytest.raises(ConfigError, match="powers of two"):
        targets.tpu("v5e-6")
    with pytest.raises(ConfigError, match="not a known accelerator; use a TPU slice such as v5e-1"):
        targets.named("v9-1")
    assert targets.TPU_GENERATIONS["v6e"][3] == 256 and targets.TPU_GENERATIONS["v5e"][3] == 128
    wide = targets.Target("v6e-1", [], 1, "", 1, 1.6e12, matrix_unit_width=256)
    assert wide.fill_of(64) == 0.25 and wide.fill_of(512) == 1.0
    assert targets.Target("v5e-1", [], 1, "", 1, 8.2e11, matrix_unit_width=128).fill_of(192) == 0.75  # 2 units
    assert targets.Target("h100", [], 1, "", 1, 3.35e12).fill_of(64) == 1.0  # GPUs: no matrix-unit width


def test_the_command_refuses_an_unknown_topology_with_one_line():
    result = subprocess.run([sys.executable, "-m", "andrea_jax.compile.check", "--config", "configs/andrea120m.py",
                             "--topology", "v5e-3"], capture_output=True, text=True, cwd=ROOT,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "v5e-3" in errors[0] and "Traceback" not in result.stderr


@needs_libtpu
@pytest.mark.parametrize("platforms", ["cpu", None])
def test_a_tpu_check_on_a_host_without_a_tpu_prints_none_of_libtpu_s_start_up_errors(platforms):
    """libtpu loads for the compile-only v5e-1 before the config is found wrong: the error is all stderr holds,
    with JAX_PLATFORMS=cpu or none asked for (as the README types the command)."""
    env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS" and not key.startswith("TPU_")}
    result = subprocess.run([sys.executable, "-m", "andrea_jax.compile.check", "--config", "configs/tiny.py",
                             "--topology", "v5e-1", "--config.model.n_head=3"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120, env=dict(env, **({"JAX_PLATFORMS": platforms} if platforms else {})))
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("error: model.n_head=3 does not divide"), lines[0]


@needs_cuda_plugin
@pytest.mark.parametrize("gpu", ["t4", "l4", "a100_40gb", "a100_80gb", "h100"])
def test_andrea120m_as_typed_fits_each_colab_gpu_by_itself(gpu):
    steps, target, lines = fitted(gpu)
    # A T4's tensor cores have float16 only: "auto" computes in it there, with loss scaling, and
    # it has no cuDNN flash attention.
    assert steps.config.model.dtype == ("float16" if gpu == "t4" else "bfloat16")
    assert steps.config.model.attention == ("xla" if gpu == "t4" else "cudnn")
    assert target.memory_limit == int(targets.gpu_memory_fraction() * {"t4": 15_843_721_216, "l4": 23_670_554_624,
                                              "a100_40gb": 42_331_013_120, "a100_80gb": 85_100_068_864,
                                              "h100": 84_942_979_072}[gpu])
    assert_fits_with_the_fewest(steps, target, lines)
    if gpu == "t4":  # its attention keeps each row's log-sum-exp, not the probabilities: 2 micro-batches, not 4
        assert steps.config.microbatches == 2
        # ... and writes its [B, H, 256, S] score products in float16: no float32 one is left.
        hlo = steps.train.as_text()
        assert re.search(r"f16\[192,256,1024\]", hlo) and not re.search(r"f32\[192,256,1024\]", hlo)
        assert check.step_cost(steps, target).mfu_bound >= 0.45
    else:
        assert steps.config.microbatches == 1
        hlo = steps.train.as_text()
        # cuDNN's fused attention, forward and backward, in every block; no [B, H, L, L] scores anywhere.
        assert hlo.count('custom_call_target="__cudnn$fmhaSoftmax"') == 12
        assert hlo.count('custom_call_target="__cudnn$fmhaSoftmaxBackward"') == 12
        assert not re.search(r"\[32,12,1024,1024\]", hlo)
        # The stream stays batch-major: the position embedding's gradient is a scatter-add, not a reduction
        # over the batch that had XLA lay every [B, L, D] array out as [L, D, B].
        assert not re.search(r"\[1024,768,32\]", hlo)
        # The norms' scale gradients are summed from x and d y as read: no d y · normed written in float32.
        assert not re.search(r"f32\[32,1024,768\]\{[^}]*\} fusion\(", hlo)
        assert sum(check.step_cost(steps, target).hbm_bytes.values()) <= 87e9
    if gpu == "h100":
        cost = check.step_cost(steps, target)
        assert cost.mfu_bound >= 0.8
    if gpu == "l4":
        assert check.step_cost(steps, target).mfu_bound >= 0.62
        assert "MFU can be at most" in check.describe(steps, target)


@needs_cuda_plugin
def test_a_gpu_in_float32_leaves_cudnn_to_auto_and_refuses_it_by_name():
    # cuDNN's fused attention has no float32 kernel: "auto" takes XLA's attention instead ...
    steps = tiny_step_for("a100_40gb", **{"model.dtype": "float32", "model.attention": "auto"})
    assert steps.config.model.attention == "xla" and "__cudnn$fmha" not in steps.train.as_text()
    assert "__cudnn$fmha" in tiny_step_for("a100_40gb", **{"model.attention": "auto"}).train.as_text()
    # ... and a run that names it stops before compiling, in one line.
    with pytest.raises(ConfigError, match=r"^model.attention='cudnn' computes in bfloat16 or float16, not "
                                          r"model.dtype='float32'; use 'auto' or 'xla'$"):
        tiny_step_for("a100_40gb", **{"model.dtype": "float32", "model.attention": "cudnn"})


@needs_cuda_plugin
@pytest.mark.parametrize("d_model, n_head", [(768, 4), (640, 32), (80, 4)])
def test_a_gpu_compiles_heads_that_are_not_a_power_of_two_wide(d_model, n_head):
    """Heads of 192 and of 20 take XLA's attention on an A100, whose output projection, and the product of q, k
    and v's stacked cotangents into x's gradient, crashed XLA's GPU compiler ("Couldn't find output tile
    sizes"); each is a 2-D product over the merged heads instead."""
    steps = tiny_step_for("a100_40gb", **{"model.d_model": d_model, "model.n_head": n_head, "model.attention": "auto"})
    hlo = steps.train.as_text()
    assert steps.config.model.attention == "xla"
    assert re.search(rf"bf16\[512,{d_model}\]\S* dot\([^)]*\).*attn/blc,cd->bld/dot_general", hlo)
    assert "attn/blc,dc->bld/dot_general" in hlo  # in one product or split over its contraction
    assert "attn/blhk,hkd->bld" not in hlo and "attn/blchk,dchk->bld" not in hlo


@needs_cuda_plugin
def test_a_gpu_program_for_an_h100_compiled_on_this_host_holds_cudnn_to_heads_of_128():
    """JAX's cuDNN wrapper takes Hopper's heads of up to 256 only on a Hopper GPU itself: compiled here for an
    H100, heads of 192 take XLA's attention under "auto", and a run that names cuDNN stops in one line."""
    wide = {"model.d_model": 768, "model.n_head": 4}
    assert tiny_step_for("h100", **wide, **{"model.attention": "auto"}).config.model.attention == "xla"
    with pytest.raises(ConfigError, match=r"^model.attention='cudnn' takes heads of a multiple of 8 up to 128 wide "
                                          r"when compiled without a Hopper GPU, not 192; use 'auto' or 'xla'$"):
        tiny_step_for("h100", **wide, **{"model.attention": "cudnn"})


@needs_libtpu
def test_muon_s_newton_schulz_shows_in_a_v5e_1_step_s_flops_and_optimizer_bytes():
    """A one-block step (andrea120m's full one takes minutes to compile here): Muon's iterations are the
    optimizer's products, their FLOPs a line of the report and part of the roofline, their bytes the optimizer's."""
    from andrea_jax import flops
    target = targets.named("v5e-1")
    adamw, muon = tiny_step_for("v5e-1"), tiny_step_for("v5e-1", **{"optimizer.name": "muon"})
    assert adamw.config.optimizer.name == "adamw"  # every config's default
    adamw_cost, muon_cost = check.step_cost(adamw, target), check.step_cost(muon, target)
    assert adamw_cost.optimizer_flops == 0
    assert muon_cost.optimizer_flops == flops.newton_schulz_flops(muon.config.model, 5) == \
        5 * (4 * 6 * 128 ** 3 + 2 * (4 * 128 ** 2 * 3072 + 2 * 128 ** 3))  # q, k, v, out; fc, proj
    # The products XLA counts grow by the iterations' (TPU cost analysis counts a step's FLOPs).
    assert muon_cost.xla_flops - adamw_cost.xla_flops == pytest.approx(muon_cost.optimizer_flops, rel=0.05)
    # Muon reads one moment where AdamW reads two; its iterations' matrices are small enough to stay on the chip.
    assert 0 < muon_cost.hbm_bytes["optimizer"] < adamw_cost.hbm_bytes["optimizer"]
    assert "Muon's Newton–Schulz iterations: 0.00 T a step on each device" in check.describe(muon, target)
    # One moment, not two, for the matrices Muon takes: less optimizer state on the chip.
    assert muon.train_memory.arguments < adamw.train_memory.arguments


# The H200's AdamW step as `bench/gpu.sh` timed it and `bench/trace_step.py` split it by kind (ms; bench/RESULTS.md,
# 2026-12-04): the device idle between kernels is what the estimate calls launches. (Muon's program has changed
# since it was measured: its calibration is in RESULTS.)
H200_ADAMW_MEASURED = 54.2, {"matrix products": 28.0, "attention": 8.6, "other fusions": 16.1, "launches": 2.4}


@needs_cuda_plugin
def test_the_h200_estimate_is_the_step_the_h200_measured_and_muon_s_within_a_tenth_of_it():
    """The one-kernel-at-a-time estimate of the AdamW program an H200 ran, against its measured step and trace:
    within 10% of the step, each kind within 20%. Muon fits in the micro-batches AdamW takes, its iterations
    in bfloat16 products, one run of kernels a matrix shape: its step within 10% of AdamW's."""
    estimates = {}
    for optimizer in ("adamw", "muon"):
        steps, target, lines = fitted("h200", **{"optimizer.name": optimizer})
        assert_fits_with_the_fewest(steps, target, lines)
        assert steps.config.microbatches == 1
        estimates[optimizer] = check.step_cost(steps, target).estimate
    step_ms, kinds_ms = H200_ADAMW_MEASURED
    assert estimates["adamw"].seconds * 1e3 == pytest.approx(step_ms, rel=0.10)
    for kind, measured in kinds_ms.items():
        assert estimates["adamw"].seconds_by_kind[kind] * 1e3 == pytest.approx(measured, rel=0.20), kind
    line = check.describe(steps, target).splitlines()[-1]
    assert re.fullmatch(r"estimated step, one kernel at a time: [\d.]+ ms \(MFU \d+%\): matrix products [\d.]+, "
                        r"attention [\d.]+, other fusions [\d.]+, copies [\d.]+, launches [\d.]+ \(ms; .*\)", line)
    assert estimates["muon"].seconds <= 1.1 * estimates["adamw"].seconds
    cost, hlo = check.step_cost(steps, target), steps.train.as_text()
    assert steps.config.optimizer.muon_ns_dtype == "bfloat16"
    assert cost.optimizer_flops == pytest.approx(12 * 5 * (4 * 6 * 768 ** 3 + 2 * (4 * 768 ** 2 * 3072 + 2 * 768 ** 3)))
    # The 24 MLP matrices in one batch of bfloat16 Gram products every iteration, and q, k, v and the output
    # projections (48 of 768 × 768) in another.
    assert len(re.findall(r"bf16\[24,768,768\]\S* dot\(", hlo)) >= 5
    assert len(re.findall(r"bf16\[48,768,768\]\S* dot\(", hlo)) >= 5
    assert "Muon's Newton–Schulz iterations" in check.describe(steps, target)


def test_a_target_without_rates_says_the_estimate_needs_them_in_one_line():
    target = targets.Target("v5e-1", [], 1, "a test", 1)
    cost = check.StepCost(1.0, None, {}, 0.0, 1.0, 1.0, 0.5, None, "attention")
    assert check.estimate_line(cost, target) == (
        "estimated step, one kernel at a time: none, v5e-1 has no rate for attention (targets.py); the bound "
        "above stands alone")


def tiny_step_for(devices_or_topology, **overrides):
    if isinstance(devices_or_topology, str):  # a program for a chip is compiled once for the module
        return _tiny_step_for_chip(devices_or_topology, tuple(sorted(overrides.items())))
    return _tiny_step(devices_or_topology, overrides)


@functools.cache
def _tiny_step_for_chip(topology, overrides):
    return _tiny_step(topology, dict(overrides))


def _tiny_step(devices_or_topology, overrides):
    config = andrea120m.get_config()
    config.update_from_flattened_dict({"model.n_layer": 1, "model.d_model": 128, "model.n_head": 2,
                                       "model.vocab_size": 256, "model.dtype": "bfloat16", "batch_size": 2,
                                       "seq_len": 256, "microbatches": 1, "model.attention": "xla", **overrides})
    if isinstance(devices_or_topology, str):
        return check.compiled_for(config, targets.named(devices_or_topology), report=lambda line: None)
    target = targets.Target("cpu", devices_or_topology, 2 ** 40, "host", 1)
    return check.compiled_for(config, target, report=lambda line: None)


@needs_libtpu
def test_a_step_compiled_for_a_tpu_holds_none_of_the_cpu_only_choices():
    """On a compile-only host the default backend is the CPU; the program for the chip must not see it.

    The CPU step traces the matmul backward's optimization barrier and compiles attention in
    blocks of 128 queries; the TPU step has neither (its scores are one [B, H, 256, 256] product).
    (XLA:CPU removes barriers once it has scheduled, so they are looked for in the traced step.)"""
    import jax
    cpu, tpu = tiny_step_for(jax.devices()[:1]), tiny_step_for("v5e-1")
    assert "[2,2,256,256]" not in cpu.train.as_text() and "[2,2,256,256]" in tpu.train.as_text()
    assert "optimization_barrier" in traced(cpu, jax.devices()[:1])
    assert "optimization_barrier" not in traced(tpu, targets.named("v5e-1").devices)


def traced(steps, devices):
    """The train step of `steps.config` as a jaxpr traced under a mesh of `devices`."""
    import flax.linen as nn
    import jax
    from andrea_jax import optimizer, sharding, train_step

    config = steps.config
    mesh, rules, rng = sharding.make_mesh(config, devices), sharding.rules(config), jax.random.key(0)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract, _ = fit.abstract_state(config, mesh, rules, rng)
        step = train_step.make_train_step(config, optimizer.make(config), optimizer.learning_rate_schedule(config))
        batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jax.numpy.int32,
                                     sharding=sharding.batch_sharding(mesh))
        return str(jax.make_jaxpr(step)(abstract, batch))