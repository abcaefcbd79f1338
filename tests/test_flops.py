"""FLOP counts against the spec's figures."""

import pytest

from andrea_jax import flops
from andrea_jax.config import base_config


def test_andrea120m_flops_per_token_match_the_spec():
    m = base_config().model
    assert flops.non_embedding_params(m) == 92_331_264 - 786_432
    assert flops.flops_per_token(m, 1024) == pytest.approx(662.5e6, rel=1e-3)


def test_the_benches_exact_count_skips_the_causal_half_of_attention():
    from bench.harness import exact_flops_per_token
    assert exact_flops_per_token(base_config().model, 1024) == pytest.approx(605e6, rel=3e-3)


def test_device_peak_table():
    class Device:
        platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"
    assert flops.device_peak_flops(Device()) == 989e12
    assert flops.device_peak_flops(Device(), "float16") == 989e12
    Device.device_kind = "Tesla T4"  # MFU against the rate of the dtype that runs
    assert flops.device_peak_flops(Device(), "float16") == 65e12
    assert flops.device_peak_flops(Device(), "float32") == 8.1e12
    Device.device_kind = "TPU v4"
    assert flops.device_peak_flops(Device()) == 275e12
    Device.platform, Device.device_kind = "cpu", "cpu"
    assert flops.device_peak_flops(Device()) is None


def test_config_peak_wins():
    c = base_config()
    c.peak_flops = 1.5e12
    assert flops.peak_flops(c) == (1.5e12, "config.peak_flops")


def test_a_cpu_has_no_peak_and_so_no_mfu():
    # A matmul rate measured at start-up on a busy CPU is no peak: it gave MFUs above 100%.
    peak, why = flops.peak_flops(base_config())
    assert peak is None and "--config.peak_flops=" in why


@pytest.mark.parametrize("variant", [dict(activation="swiglu"), dict(mlp_ratio=2.0), dict(mlp_ratio=8.0),
                                     dict(activation="relu")])
def test_six_n_counts_every_parameter_of_the_variants(variant):
    from andrea_jax.tools import parameter_table
    m = base_config().model
    m.update(dict(n_layer=2, d_model=128, n_head=4, mlp_dim=512, vocab_size=101, max_len=64, **variant))
    assert flops.non_embedding_params(m) == parameter_table.count(parameter_table.param_shapes(m)) - 64 * 128
