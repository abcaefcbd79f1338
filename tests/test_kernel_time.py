"""The one-kernel-at-a-time estimate of a step, on a hand-written GPU module."""

import pytest

from andrea_jax.compile import hbm_traffic, kernel_time, targets
from tests import test_hbm_traffic

# A large bf16 product (Triton's GEMM fusion), a small float32 one in a loop of 5 trips, causal cuDNN
# attention forward and backward, a reduction fusion and a layout copy.
MODULE = """HloModule step

%gemm_large (a: bf16[4096,768], b: bf16[768,3072]) -> bf16[4096,3072] {
  %a = bf16[4096,768]{1,0} parameter(0)
  %b = bf16[768,3072]{1,0} parameter(1)
  ROOT %d = bf16[4096,3072]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gemm_small (a: f32[768,768], b: f32[768,768]) -> f32[768,768] {
  %a = f32[768,768]{1,0} parameter(0)
  %b = f32[768,768]{1,0} parameter(1)
  ROOT %d = f32[768,768]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused_reduce (p: bf16[4096,3072]) -> f32[3072] {
  %p = bf16[4096,3072]{1,0} parameter(0)
  %c = f32[4096,3072]{1,0} convert(%p)
  %z = f32[] constant(0)
  ROOT %r = f32[3072]{0} reduce(%c, %z), dimensions={0}, to_apply=%sum
}

%body (state: (s32[], f32[768,768])) -> (s32[], f32[768,768]) {
  %state = (s32[], f32[768,768]{1,0}) parameter(0)
  %x = f32[768,768]{1,0} get-tuple-element(%state), index=1
  %xx = f32[768,768]{1,0} fusion(%x, %x), kind=kCustom, calls=%gemm_small, metadata={op_name="jit(step)/muon/dot_general"}
  %i = s32[] get-tuple-element(%state), index=0
  ROOT %out = (s32[], f32[768,768]{1,0}) tuple(%i, %xx)
}

%cond (state: (s32[], f32[768,768])) -> pred[] {
  %state = (s32[], f32[768,768]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: bf16[4096,768], b: bf16[768,3072], q: bf16[2,1024,12,64], m: f32[768,768]) -> f32[3072] {
  %a = bf16[4096,768]{1,0} parameter(0)
  %b = bf16[768,3072]{1,0} parameter(1)
  %q = bf16[2,1024,12,64]{3,2,1,0} parameter(2)
  %m = f32[768,768]{1,0} parameter(3)
  %gemm_fusion_dot.1 = bf16[4096,3072]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_large
  %fwd = (bf16[2,12,1024,64]{3,1,2,0}, f32[2,12,1024]{2,1,0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": {"mask_type": "CAUSAL"}}
  %bwd = (bf16[2,1024,12,64]{3,2,1,0}, bf16[2,1024,12,64]{3,2,1,0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config": {"mask_type": "CAUSAL"}}
  %copy.3 = bf16[2,1024,12,64]{1,3,2,0} copy(%q)
  %zero = s32[] constant(0)
  %init = (s32[], f32[768,768]{1,0}) tuple(%zero, %m)
  %loop = (s32[], f32[768,768]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %input_reduce_fusion.2 = f32[3072]{0} fusion(%gemm_fusion_dot.1), kind=kInput, calls=%fused_reduce
}
"""

RATES = targets.KernelRates(products={"16-bit": 800e12, "float32": 200e12}, attention=250e12,
                            memory_bytes_per_second=2.5e12, launch_seconds=2e-6, cores=132, source="a test",
                            calibrated=False)


def test_each_kernel_costs_its_flops_at_its_kind_s_rate_or_its_bytes_and_a_launch():
    estimate = kernel_time.estimate(MODULE, RATES)
    by_name = {kernel.name: kernel for kernel in estimate.kernels}
    assert len(estimate.kernels) == 6 and sum(k.times for k in estimate.kernels) == 10
    large = by_name["gemm_fusion_dot.1"]
    # 32 × 24 = 768 tiles of 128 × 128 in 6 waves of 132 (the last one 108 of 132): 97% of the cores' time.
    assert kernel_time.wave_efficiency(1, 4096, 3072, 768, 132) == pytest.approx(768 / 792)
    assert large.flops == 2 * 4096 * 3072 * 768
    assert large.seconds == pytest.approx(large.flops / (800e12 * 768 / 792))
    # 36 tiles of a 768 × 768 product, K split once into 384s is too short: one wave, 36 of 132 cores busy.
    small = by_name["xx"]
    assert small.times == 5 and small.seconds == pytest.approx(2 * 768 ** 3 / (200e12 * 36 / 132))
    # Causal attention: the forward's 4·B·H·L²·D halved; the backward 2.5 times that.
    forward = 4 * 2 * 12 * 1024 * 1024 * 64 / 2
    assert by_name["fwd"].flops == forward and by_name["bwd"].flops == 2.5 * forward
    assert by_name["fwd"].seconds == pytest.approx(forward / 250e12)
    # Memory-bound: a bf16 [4096, 3072] read and 3072 floats written, at the fusions' bandwidth.
    reduce = by_name["input_reduce_fusion.2"]
    assert reduce.kind == "other fusions" and reduce.seconds == pytest.approx((4096 * 3072 * 2 + 3072 * 4) / 2.5e12)
    assert by_name["copy.3"].kind == "copies"
    kinds = estimate.seconds_by_kind
    assert kinds["matrix products"] == pytest.approx(large.seconds + 5 * small.seconds)
    assert kinds["launches"] == pytest.approx(10 * 2e-6)
    assert estimate.seconds == pytest.approx(sum(kinds.values()))


def test_the_costliest_kernels_come_first_a_loop_s_runs_summed():
    top = kernel_time.estimate(MODULE, RATES).top(3)
    assert [name for name, *_ in top] == ["xx", "bwd", "gemm_fusion_dot.1"]
    assert top[0][3] == 5


def test_a_kind_of_kernel_without_a_rate_is_refused_by_name():
    no_attention = targets.KernelRates(**{**RATES.__dict__, "attention": None})
    with pytest.raises(kernel_time.MissingRate, match="attention"):
        kernel_time.estimate(MODULE, no_attention)
    no_float32 = targets.KernelRates(**{**RATES.__dict__, "products": {"16-bit": 800e12}})
    with pytest.raises(kernel_time.MissingRate, match="float32 products"):
        kernel_time.estimate(MODULE, no_float32)


def test_every_gpu_target_has_rates_and_the_h200_s_are_its_own_measurements():
    for name in targets.gpu_names():
        rates = targets.gpu_rates(name, 1e12, 100)
        assert rates is not None and rates.products["16-bit"] > 0 and rates.launch_seconds > 0
    h200 = targets.gpu_kernel_rates("h200")
    assert h200.cores == 132
    assert h200.calibrated and h200.products["16-bit"] == 790e12 and h200.memory_bytes_per_second == 2.6e12
    a100 = targets.gpu_rates("a100_40gb", 1.555e12, 108)
    assert not a100.calibrated and a100.products["16-bit"] == pytest.approx(312e12 * 790 / 989)


def test_a_tpu_s_convolution_is_counted_as_the_product_it_stands_for():
    """XLA's TPU compiler writes x[B·L, 16] · w[16, 3·4] as a convolution whose padded window slides over a
    size-1 input: one tap lands inside it for each output position, so its FLOPs are the product's."""
    shapes = {"a": "bf16[2,8,16,1]{3,2,1,0}", "w": "bf16[16,3,4,1]{3,2,1,0}"}
    conv = hbm_traffic.Instruction(
        "convolution.1", "convolution", "bf16[2,8,3,4]{3,2,1,0}", ("a", "w"),
        ", window={size=1x3 pad=0_0x2_2 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f", "")
    assert kernel_time.convolution_flops(conv, shapes) == 2 * (2 * 8) * 16 * (3 * 4)
    # A window as long as its input and no padding (a weight gradient summed over a spatial batch): every tap.
    shapes = {"a": "bf16[32,16,8]{2,1,0}", "w": "bf16[32,8,4]{2,1,0}"}
    wgrad = hbm_traffic.Instruction("convolution.2", "convolution", "bf16[1,16,4]{2,1,0}", ("a", "w"),
                                    ", window={size=32}, dim_labels=0bf_0io->0bf", "")
    assert kernel_time.convolution_flops(wgrad, shapes) == 2 * 16 * 4 * 8 * 32


def test_splash_s_backward_kernel_is_costed_as_a_backward():
    """On a TPU the splash kernels are custom calls named by their phase; the forward's serialized body may
    hold any letters, so only names and targets tell a backward."""
    module = """HloModule step

ENTRY %main (q: bf16[2,12,1024,64]) -> bf16[2,12,1024,64] {
  %q = bf16[2,12,1024,64]{3,2,1,0} parameter(0)
  %splash_mha_fwd_no_residuals.1 = bf16[2,12,1024,64]{3,2,1,0} custom-call(%q, %q, %q), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "TUxJUmdkkvDq"}}
  ROOT %splash_mha_dkv_no_residuals.1 = (bf16[2,12,1024,64]{3,2,1,0}, bf16[2,12,1024,64]{3,2,1,0}) custom-call(%q, %q, %q), custom_call_target="tpu_custom_call"
}
"""
    by_name = {k.name: k for k in kernel_time.estimate(module, RATES, (0.6, 0.9), attention_fill=0.5).kernels}
    forward = 4 * 2 * 12 * 1024 * 1024 * 64
    assert by_name["splash_mha_fwd_no_residuals.1"].flops == forward * 0.6
    dkv = by_name["splash_mha_dkv_no_residuals.1"]
    assert dkv.flops == forward * 2.5 * 0.9 and dkv.seconds == pytest.approx(dkv.flops / (250e12 * 0.5))
    assert kernel_time.BACKWARD.search("splash_mha_dq_no_residuals.2")
    assert not kernel_time.BACKWARD.search("splash_mha_fwd_no_residuals.2")


def test_a_conditional_s_costliest_branch_runs_once():
    kernels = kernel_time.estimate(test_hbm_traffic.CONDITIONAL, RATES).kernels
    assert [(k.name, k.times) for k in kernels] == [("update", 1), ("update2", 1)]
    assert sum(k.bytes for k in kernels) == sum(hbm_traffic.count(test_hbm_traffic.CONDITIONAL).values())


def test_the_estimate_s_copies_are_the_bytes_table_s_layout_copies():
    """A TPU names a fused transpose `fusion.N`: its contents, not its name, make it a layout copy."""
    module = test_hbm_traffic.MODULE.replace("%yt =", "%fusion.7 =")
    computations, _ = hbm_traffic.parse(module)
    parts = {i.name: hbm_traffic.part_of(i, computations) for body in computations.values() for i in body}
    kinds = {k.name: k.kind for k in kernel_time.estimate(module, RATES).kernels}
    assert kinds["fusion.7"] == "copies"
    assert {name for name, kind in kinds.items() if kind == "copies"} == {
        name for name in kinds if parts[name] == "layout copies"}
