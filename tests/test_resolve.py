"""The one place a run's "auto"s are decided for its devices."""

import pytest

from andrea_jax import resolve
from andrea_jax.config import ConfigError, base_config
from tests.test_attention import FakeDevice


def auto_config():
    config = base_config()
    config.model.dtype, config.model.attention = "auto", "auto"
    return config


@pytest.mark.parametrize("device, dtype, attention", [
    (FakeDevice("tpu"), "bfloat16", "splash"),
    (FakeDevice("gpu", "9.0"), "bfloat16", "cudnn"),
    (FakeDevice("gpu", "7.5"), "float16", "xla"),  # a T4
])
def test_auto_becomes_each_chips_dtype_and_attention(device, dtype, attention):
    resolved = resolve.for_devices(auto_config(), device)
    assert (resolved.model.dtype, resolved.model.attention) == (dtype, attention)


def test_a_resumed_run_keeps_computing_as_it_did_and_the_input_is_left_alone():
    saved = base_config()
    saved.model.dtype, saved.microbatches, saved.model.remat = "float16", 4, True
    config = auto_config()
    resolved = resolve.for_devices(config, FakeDevice("tpu"), saved)
    assert (resolved.model.dtype, resolved.microbatches, resolved.model.remat) == ("float16", 4, True)
    assert config.model.dtype == "auto" and config.microbatches == 0


def test_a_kernel_this_machine_lacks_stops_training_and_gives_way_in_evaluation():
    config = base_config()
    config.model.attention = "splash"
    with pytest.raises(ConfigError, match="'splash' runs on TPUs"):
        resolve.for_devices(config, FakeDevice("cpu"))
    assert resolve.for_devices(config, FakeDevice("cpu"), evaluating=True).model.attention == "xla"
