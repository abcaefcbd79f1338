"""The TPU splash kernel against the einsum path, run by Pallas's TPU interpreter on the CPU; the choice of kernel.

(cuDNN's kernel needs a GPU to run: tests/test_compile_check.py compiles it for one.)
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental.pallas import tpu as pltpu

from andrea_jax import attention, sharding
from andrea_jax.config import ConfigError, base_config, validate
from tests.test_model import forward, init, small_model


class FakeDevice:
    def __init__(self, platform, compute_capability=None):
        self.platform = platform
        if compute_capability is not None:
            self.compute_capability = compute_capability


def einsum_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK):
    """Causal attention in float32 from the same (bfloat16) inputs."""
    q, k, v = (x.astype(jnp.float32) for x in (q_BxLxHxK, k_BxLxHxK, v_BxLxHxK))
    length = q.shape[1]
    logits_BxHxLxL = jnp.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(q.shape[-1])
    logits_BxHxLxL = jnp.where(jnp.tril(jnp.ones((length, length), bool)), logits_BxHxLxL, -jnp.inf)
    return jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(logits_BxHxLxL, axis=-1), v)


def assert_close_in_bfloat16(ours, reference, relative=2e-2):
    """Within a few bfloat16 roundings of the reference's scale; a wrong mask, scale or padding is O(1)."""
    ours, reference = np.asarray(ours, np.float32), np.asarray(reference, np.float32)
    assert ours.shape == reference.shape
    assert np.abs(ours - reference).max() <= relative * np.abs(reference).max()


@pytest.mark.parametrize("keys_whole", [False, True])
def test_splash_forward_and_gradients_equal_the_einsum_path_at_odd_shapes(keys_whole):
    """3 rows, 3 heads of 32, length 200 padded to 256: two blocks of 128 each way, the kernels that
    context 1024 runs in blocks of 512; the backward in key blocks of 128 (q's gradient summed over
    them) or all keys at once, as a v6e takes them. (The mesh test below takes the one-block path.)"""
    q, k, v, cotangent = (jax.random.normal(key, (3, 200, 3, 32), jnp.bfloat16)
                          for key in jax.random.split(jax.random.key(0), 4))
    with pltpu.force_tpu_interpret_mode(True):  # Pallas's plain interpreter: the TPU one stops at splash's grid
        # The kernel takes q already scaled by 1/√K (the model folds it into q's projection).
        scaled = lambda q, k, v: attention.splash_attention(q / math.sqrt(q.shape[-1]), k, v, block=128,
                                                            keys_whole=keys_whole)
        out, backward = jax.vjp(scaled, q, k, v)
        grads = backward(cotangent)
    expected, expected_backward = jax.vjp(einsum_attention, q, k, v)
    assert out.dtype == jnp.bfloat16
    assert_close_in_bfloat16(out, expected)
    for grad, expected_grad in zip(grads, expected_backward(cotangent.astype(jnp.float32))):
        assert_close_in_bfloat16(grad, expected_grad)


def loss_and_grads(m, params, ids_BxL):
    def loss(p):
        logits = forward(m, p, ids_BxL[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids_BxL[:, 1:]).mean()
    return jax.jit(jax.value_and_grad(loss))(params)


def test_splash_model_on_a_data_fsdp_tensor_mesh_equals_the_einsum_model_on_one_device():
    """Each device runs the kernel on its own rows and heads; the loss and every gradient agree.

    Length 12, padded to one block of 128. Pallas's plain interpreter (`True`): the TPU
    interpreter, which simulates each device's memories, stalled on this 8-device backward.
    """
    m_xla = small_model(n_layer=1, dtype="bfloat16", attention="xla")
    m_splash = small_model(n_layer=1, dtype="bfloat16", attention="splash")
    params = init(m_xla, scale=4.0)
    ids = np.random.default_rng(0).integers(0, m_xla.vocab_size, (4, 13))
    expected_loss, expected_grads = loss_and_grads(m_xla, params, ids)

    config = base_config()
    config.batch_size = 4
    config.mesh.update(dict(data=2, fsdp=2, tensor=2))
    mesh = sharding.make_mesh(config, jax.devices()[:8])
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.rules(config)), pltpu.force_tpu_interpret_mode(True):
        lowered = jax.jit(lambda p, x: forward(m_splash, p, x)).lower(params, ids).as_text()
        loss, grads = loss_and_grads(m_splash, params, jax.device_put(ids, sharding.batch_sharding(mesh)))
    # Inside the shard_map each device holds 1 of the 4 rows and 2 of the 4 heads (of 16).
    assert "shard_map" in lowered or "sdy.manual_computation" in lowered
    assert "tensor<1x2x128x16xbf16>" in lowered
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=2e-2)
    # Splash programs leave k's bias unadded (softmax ignores it): its gradient is none, where the einsum
    # program's bfloat16 roundings give it a few percent of the other biases'. v's bias joins the output's
    # in float32, so the two programs round in different places: within 3% of each other (each is 1-7% from
    # the float32 program's gradients here).
    assert np.all(grads["block_0"]["attn"]["qkv_bias"][1] == 0)
    expected_grads["block_0"]["attn"]["qkv_bias"] = expected_grads["block_0"]["attn"]["qkv_bias"].at[1].set(0)
    jax.tree.map(lambda ours, reference: assert_close_in_bfloat16(ours, reference, 3e-2), grads, expected_grads)


@pytest.mark.parametrize("kernel, platform, scale", [("cudnn", "gpu", None), ("splash", "tpu", 1.0)])
def test_fused_programs_leave_k_and_v_biases_to_softmax_with_the_einsum_programs_loss_and_gradients(
        monkeypatch, kernel, platform, scale):
    """With a fused kernel (here XLA's attention in its place: cuDNN needs a GPU and splash a TPU, or minutes
    in Pallas's interpreter), k's bias is not added (softmax ignores it) and v's joins the output's bias
    (softmax's rows sum to one): the loss and every gradient are the einsum program's, in float32, and k's
    bias gets exactly none. Splash takes q scaled in its projection (scale 1 here)."""
    m_xla, m_fused = (small_model(n_layer=1, attention=name) for name in ("xla", kernel))
    params = init(m_xla, scale=4.0)
    ids = np.random.default_rng(5).integers(0, m_xla.vocab_size, (2, 13))
    expected_loss, expected_grads = loss_and_grads(m_xla, params, ids)
    monkeypatch.setattr(sharding, "program_platform", lambda: platform)
    monkeypatch.setitem(attention.FUSED, kernel,
                        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True))
    loss, grads = loss_and_grads(m_fused, params, ids)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max()),
                 grads, expected_grads)
    k_bias_grad = grads["block_0"]["attn"]["qkv_bias"][1]
    assert np.all(k_bias_grad == 0) and np.abs(grads["block_0"]["attn"]["qkv_bias"][2]).max() > 1e-3

@pytest.mark.parametrize("name, device, width, dtype, expected", [
    ("auto", FakeDevice("tpu"), 64, "bfloat16", "splash"),
    ("auto", FakeDevice("tpu"), 192, "bfloat16", "xla"),  # wider than the kernel takes
    ("auto", FakeDevice("gpu", "9.0"), 64, "bfloat16", "cudnn"),
    ("auto", FakeDevice("gpu", "8.0"), 64, "float16", "cudnn"),
    ("auto", FakeDevice("gpu", "7.5"), 64, "float16", "xla"),  # a T4: no cuDNN flash attention
    ("auto", FakeDevice("gpu", "9.0"), 64, "float32", "xla"),  # cuDNN has no float32 kernel
    ("auto", FakeDevice("gpu", "8.0"), 60, "bfloat16", "xla"),  # not a multiple of 8
    ("auto", FakeDevice("gpu", "8.0"), 192, "bfloat16", "xla"),  # over 128 before Hopper
    ("auto", FakeDevice("gpu", "9.0"), 192, "bfloat16", "xla"),  # up to 256 on a Hopper only if it is this host's
    ("auto", FakeDevice("gpu", "9.0"), 384, "bfloat16", "xla"),
    ("auto", FakeDevice("cpu"), 64, "bfloat16", "xla"),
    ("xla", FakeDevice("tpu"), 64, "bfloat16", "xla"),
    ("splash", FakeDevice("tpu"), 128, "bfloat16", "splash"),
])
def test_auto_picks_each_chips_kernel_and_explicit_names_stay(name, device, width, dtype, expected):
    assert attention.resolve_name(name, width, dtype, device) == expected


def test_a_hopper_running_the_program_takes_cudnn_heads_up_to_256(monkeypatch):
    hopper = FakeDevice("gpu", "9.0")
    monkeypatch.setattr(jax, "devices", lambda *backend: [hopper])  # JAX's wrapper asks the GPU it runs on
    assert [attention.resolve_name("auto", width, "bfloat16", hopper) for width in (192, 256, 264)] == [
        "cudnn", "cudnn", "xla"]


def test_a_kernel_off_its_chip_or_at_a_width_it_cannot_take_is_refused_with_the_fix():
    assert attention.for_device(small_model(attention="splash"), FakeDevice("tpu")) == "splash"
    with pytest.raises(ConfigError, match="'splash' runs on TPUs and this run's devices are gpu; use 'auto'"):
        attention.for_device(small_model(attention="splash"), FakeDevice("gpu", "9.0"))
    with pytest.raises(ConfigError, match="'cudnn' runs on GPUs and this run's devices are cpu"):
        attention.for_device(small_model(attention="cudnn"), FakeDevice("cpu"))
    with pytest.raises(ConfigError, match="'cudnn' needs compute capability 8.0 or newer and this GPU has 7.5"):
        attention.for_device(small_model(attention="cudnn"), FakeDevice("gpu", "7.5"))
    with pytest.raises(ConfigError, match=r"^model.attention='cudnn' computes in bfloat16 or float16, not "
                                          r"model.dtype='float32'; use 'auto' or 'xla'$"):
        attention.for_device(small_model(attention="cudnn", dtype="float32"), FakeDevice("gpu", "9.0"))
    with pytest.raises(ConfigError, match="'cudnn' takes heads of a multiple of 8 up to 128 wide on this GPU, not 12"):
        attention.for_device(small_model(attention="cudnn", dtype="bfloat16", n_head=2, d_model=24),
                             FakeDevice("gpu", "8.0"))
    config = base_config()
    config.model.attention, config.model.n_head = "splash", 4  # heads of 192
    with pytest.raises(ConfigError, match="not 192 .*change n_head or use 'auto'"):
        validate(config)


def test_a_run_recorded_with_a_kernel_this_machine_lacks_evaluates_with_this_machines_choice():
    assert attention.for_saved_run(small_model(attention="splash"), FakeDevice("cpu")) == "xla"
    assert attention.for_saved_run(small_model(attention="splash", dtype="bfloat16"), FakeDevice("gpu", "9.0")) == "cudnn"
    assert attention.for_saved_run(small_model(attention="cudnn", dtype="bfloat16"), FakeDevice("gpu", "9.0")) == "cudnn"
    # A float32 run trained on a TPU, evaluated on an H100: cuDNN has no float32 kernel.
    assert attention.for_saved_run(small_model(attention="splash", dtype="float32"), FakeDevice("gpu", "9.0")) == "xla"


def test_the_roofline_counts_the_products_each_tpu_attention_computes():
    # Splash at 1024 in blocks of 512: 3 of the 4 blocks, and the fused backward's second q·kᵀ (7 of 6).
    assert attention.products_computed("splash", 1024, 64, "TPU v5 lite") == pytest.approx(3 / 4 * 7 / 6)
    # A v6e's backward takes the keys whole: its 5 products compute all 4 blocks, the forward's 2 still 3.
    assert attention.products_computed("splash", 1024, 64, "TPU v6 lite") == pytest.approx((2 * 3 / 4 + 5) / 6)
    # ... but not 8192 keys (its VMEM): the backward skips the blocks above the diagonal too, 136 of 256.
    assert attention.products_computed("splash", 8192, 64, "TPU v6 lite") == pytest.approx(17 / 32 * 7 / 6)
    assert attention.products_computed("splash", 512, 64, "TPU v5 lite") == pytest.approx(7 / 6)  # one block: all
    # 200 queries pad to one block of 256: the padded square is computed whole.
    assert attention.products_computed("splash", 200, 64, "TPU v5 lite") == pytest.approx((256 / 200) ** 2 * 7 / 6)
    assert attention.products_computed("xla", 1024, 64, "TPU v6 lite") == 1.0  # on a TPU: the whole square


def test_a_v6e_takes_the_keys_whole_only_where_its_kernel_fits_the_on_chip_memory():
    whole = lambda length, width, kind="TPU v6 lite": attention.keys_whole_in_backward(kind, length, width)
    # Compiled for v6e-1: all 4096 keys of heads up to 128 wide fit 32 MiB of VMEM, 4608 and 8192 did not.
    assert whole(1024, 64) and whole(4096, 64) and whole(4096, 128) and whole(4000, 64)  # 4000 pads to 4096
    assert not whole(4097, 64) and not whole(4608, 64) and not whole(8192, 64)
    # Heads 256 wide take twice the lanes: 2048 keys fit, 4096 (41.3 MiB) did not.
    assert whole(2048, 256) and not whole(2560, 256) and not whole(4096, 256)
    assert not whole(1024, 64, "TPU v5 lite")  # a v5e's backward takes key blocks at every length
