"""bench/trace_step.py's reading of a profiler trace: which lines count, and each kernel's kind."""

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import trace_step  # noqa: E402


def write_trace(path, processes: dict[int, str], threads: dict[tuple[int, int], str], kernels) -> str:
    events = [dict(ph="M", name="process_name", pid=pid, args=dict(name=name)) for pid, name in processes.items()]
    events += [dict(ph="M", name="thread_name", pid=pid, tid=tid, args=dict(name=name))
               for (pid, tid), name in threads.items()]
    events += [dict(ph="X", pid=pid, tid=tid, name=name, ts=0, dur=dur) for pid, tid, name, dur in kernels]
    with gzip.open(path, "wt") as f:
        json.dump(dict(traceEvents=events), f)
    return str(path)


def test_a_gpus_streams_are_counted_once_and_its_derived_lines_and_the_host_not_at_all(tmp_path):
    trace = write_trace(
        tmp_path / "gpu.trace.json.gz",
        {1: "/device:GPU:0", 2: "/host:CPU"},
        {(1, 10): "Stream #14(Compute,Memset)", (1, 11): "Stream #16(MemcpyD2H)", (1, 12): "XLA Ops",
         (1, 13): "XLA Modules", (2, 20): "python"},
        [(1, 10, "nvjet_sm90_tst_128x128", 300), (1, 10, "nvjet_sm90_tst_128x128", 200),
         (1, 11, "Memcpy DtoH", 50), (1, 12, "dot.5", 500), (1, 13, "jit_train_step", 550),
         (2, 20, "PjitFunction(train_step)", 9000)])
    seconds = trace_step.device_kernel_seconds(trace)
    assert seconds == pytest.approx({"nvjet_sm90_tst_128x128": 500e-6, "Memcpy DtoH": 50e-6})


def test_a_device_without_streams_counts_its_xla_ops_and_a_trace_without_a_device_is_refused(tmp_path):
    tpu = write_trace(tmp_path / "tpu.trace.json.gz", {3: "/device:TPU:0"},
                      {(3, 1): "XLA Ops", (3, 2): "XLA Modules"},
                      [(3, 1, "fusion.12", 40), (3, 1, "splash_mha_fwd", 60), (3, 2, "jit_train_step", 100)])
    assert trace_step.device_kernel_seconds(tpu) == pytest.approx({"fusion.12": 40e-6, "splash_mha_fwd": 60e-6})
    cpu = write_trace(tmp_path / "cpu.trace.json.gz", {4: "/host:CPU"}, {(4, 1): "python"}, [(4, 1, "dot", 5)])
    with pytest.raises(SystemExit, match="holds no device kernels.*run this on an accelerator"):
        trace_step.device_kernel_seconds(cpu)


@pytest.mark.parametrize("kernel, kind", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>", "attention"),
    ("nvjet_sm90_tss_192x192_64x3_1x2_h_bz_coopB_splitK_NTN", "matrix product"),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize256x128x32", "matrix product"),
    ("gemm_fusion_dot_207", "matrix product"),
    ("input_convert_reduce_fusion_8", "other fusion"),
    ("Memcpy DtoH (Device -> Pinned)", "copy"),
    ("ncclDevKernel_AllReduce_Sum_bf16", "collective"),
])
def test_kernels_are_sorted_into_kinds_by_their_names(kernel, kind):
    assert trace_step.kind_of(kernel) == kind


def test_the_trace_is_set_beside_the_estimate_kind_by_kind_the_idle_time_against_the_launches():
    rows = trace_step.beside_the_estimate({"matrix product": 28.0, "attention": 8.6, "other fusion": 16.1,
                                           "copy": 0.1}, 2.4,
                                          {"matrix products": 28.1, "attention": 8.6, "other fusions": 16.2,
                                           "copies": 0.0, "launches": 2.44})
    assert rows == [["matrix product", "28.00", "28.10", "1.00"], ["attention", "8.60", "8.60", "1.00"],
                    ["other fusion", "16.10", "16.20", "1.01"], ["copy", "0.10", "0.00", "0.00"],
                    ["the device idle", "2.40", "2.44", "1.02"]]


def test_a_gpu_is_found_among_the_targets_by_the_kind_jax_names_it():
    from andrea_jax.compile import targets
    assert targets.gpu_for("NVIDIA H200") == "h200" and targets.gpu_for("NVIDIA H100 80GB HBM3") == "h100"
    assert targets.gpu_for("cpu") is None
