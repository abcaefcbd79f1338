"""bench/torch_reference.py computes what the JAX model and step compute, for the same weights.

The benchmark's JAX/PyTorch ratio only means something if both sides train the
same model with the same optimizer; these checks fail when either drifts.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from andrea_jax import optimizer, train_step  # noqa: E402
from andrea_jax.gpt2 import interop
from andrea_jax.config import base_config  # noqa: E402
from bench import torch_reference  # noqa: E402


def small_config(**model_overrides):
    c = base_config()
    m = c.model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim, m.vocab_size, m.max_len = 2, 64, 4, 256, 101, 16
    m.update(model_overrides)
    c.seq_len, c.batch_size, c.steps = 16, 4, 10
    c.optimizer.warmup_steps = 1  # step 0 has lr 0 (both sides), steps 1 and 2 move the weights
    c.optimizer.learning_rate = 1e-2  # large, so that a wrong decay mask or clip shows in the loss
    c.optimizer.grad_clip_norm = 0.5
    c.optimizer.weight_decay = 5.0  # lr × decay = 5% a step: a wrong decay mask moves the loss
    return c


def weights(c):
    """GPT-2-layout weights from the reference's own init, LayerNorms and biases moved off 1 and 0.

    (JAX's threefry init takes seconds to compile on a CPU; the reference's costs nothing.)
    """
    torch.manual_seed(3)
    sd = torch_reference.Transformer(c.model).gpt2_state_dict()
    rng = np.random.default_rng(0)
    for name, value in sd.items():
        if "ln" in name or name.endswith("bias"):
            value += 0.1 * rng.standard_normal(value.shape).astype(np.float32)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd


def jax_state(c):
    tx = optimizer.make(c)
    params = jax.tree.map(jnp.asarray, interop.from_gpt2(weights(c), c.model))
    return {"step": jnp.int32(0), "params": params, "opt_state": jax.jit(tx.init)(params)}, tx


def jax_loss_of(c, params, batch):
    return float(jax.jit(lambda p, b: train_step.token_losses(p, c.model, b)[0].mean())(params, jnp.asarray(batch)))


def torch_step_from(c, params):
    step = torch_reference.TrainStep(c, attention="einsum")
    step.model.load_gpt2(interop.to_gpt2(params, c.model))  # back through the project's own export
    return step


@pytest.mark.parametrize("pad", [1, 128])
def test_same_loss_for_the_same_weights(pad):
    c = small_config(vocab_pad_multiple=pad)
    state, _ = jax_state(c)
    batch = np.random.default_rng(1).integers(0, c.model.vocab_size, (c.batch_size, c.seq_len + 1))
    jax_loss = jax_loss_of(c, state["params"], batch)
    step = torch_step_from(c, state["params"])
    with torch.no_grad():
        torch_loss = step.forward_loss(torch.from_numpy(batch)).item()
    assert abs(jax_loss - np.log(101)) < 0.5  # near uniform at init, so the check is not vacuous
    assert torch_loss == pytest.approx(jax_loss, abs=2e-5)


def test_sdpa_attention_equals_the_einsum_form():
    c = small_config()
    state, _ = jax_state(c)
    batch = torch.from_numpy(np.random.default_rng(2).integers(0, 101, (4, 17)))
    sdpa = torch_reference.TrainStep(c, attention="sdpa")
    sdpa.model.load_gpt2(interop.to_gpt2(state["params"], c.model))
    einsum = torch_step_from(c, state["params"])
    with torch.no_grad():
        assert sdpa.forward_loss(batch).item() == pytest.approx(einsum.forward_loss(batch).item(), abs=1e-5)


def test_same_losses_over_three_train_steps():
    """AdamW hyper-parameters, decay mask, clipping and schedule agree: the losses stay equal."""
    c = small_config()
    state, tx = jax_state(c)
    step_fn = jax.jit(train_step.make_train_step(c, tx, optimizer.learning_rate_schedule(c)))
    torch_step = torch_step_from(c, state["params"])
    batch = np.random.default_rng(4).integers(0, 101, (c.batch_size, c.seq_len + 1))
    jax_losses, torch_losses = [], []
    for _ in range(3):
        state, metrics = step_fn(state, jnp.asarray(batch))
        jax_losses.append(float(metrics["loss"]))
        torch_losses.append(torch_step(torch.from_numpy(batch)).item())
    final_jax = jax_loss_of(c, state["params"], batch)
    with torch.no_grad():
        final_torch = torch_step.forward_loss(torch.from_numpy(batch)).item()
    assert jax_losses[0] == jax_losses[1]  # the warmup's first step has lr 0
    assert final_jax < jax_losses[0] - 0.1  # the steps did move the weights
    np.testing.assert_allclose(torch_losses, jax_losses, atol=1e-4)
    assert final_torch == pytest.approx(final_jax, abs=1e-4)
