"""The ANDREA model and train step in PyTorch: the reference the JAX step is timed against.

The same function as andrea_jax/model.py and train_step.py: pre-norm GPT-2
blocks, learned positions, tied output, biases everywhere, tanh-GELU, GPT-2's
init (residual projections scaled by 1/sqrt(2·n_layer)), AdamW with decay on
matrices only (and on the tied embedding when the config says so), global-norm
clipping and the warmup + cosine schedule of andrea_jax/optimizer.py.

Parameter names follow Hugging Face's GPT2LMHeadModel, so the state dict of
`andrea_jax.gpt2.interop.to_gpt2` loads directly (Conv1D weights are (in, out);
nn.Linear keeps (out, in), so they are transposed on the way in).

    python bench/torch_reference.py   # a few timed steps of the mid-size model
"""

from __future__ import annotations

import math
import time
from typing import Mapping

import ml_collections
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02
# GPT2LMHeadModel's block module names -> this Block's attributes.
GPT2_NAMES = {"ln_1": "ln_1", "ln_2": "ln_2", "attn.c_attn": "c_attn", "attn.c_proj": "attn_proj",
              "mlp.c_fc": "c_fc", "mlp.c_proj": "mlp_proj"}


class Block(nn.Module):
    def __init__(self, m: ml_collections.ConfigDict, attention: str):
        super().__init__()
        d = m.d_model
        self.n_head, self.attention = m.n_head, attention
        self.ln_1 = nn.LayerNorm(d, eps=m.layer_norm_epsilon)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d, eps=m.layer_norm_epsilon)
        self.c_fc = nn.Linear(d, m.mlp_dim)
        self.mlp_proj = nn.Linear(m.mlp_dim, d)
        causal = torch.tril(torch.ones(m.max_len, m.max_len, dtype=torch.bool))
        self.register_buffer("causal", causal, persistent=False)

    def attend(self, x_BxLxD: torch.Tensor) -> torch.Tensor:
        batch, length, d = x_BxLxD.shape
        head_dim = d // self.n_head
        # c_attn's columns are q | k | v, each split into heads: (B, L, 3, H, K).
        qkv = self.c_attn(x_BxLxD).view(batch, length, 3, self.n_head, head_dim)
        q_BxHxLxK, k_BxHxLxK, v_BxHxLxK = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        if self.attention == "sdpa":
            out_BxHxLxK = F.scaled_dot_product_attention(q_BxHxLxK, k_BxHxLxK, v_BxHxLxK, is_causal=True)
        else:  # the einsum form, as the JAX model's "xla" attention
            logits = (q_BxHxLxK @ k_BxHxLxK.transpose(-1, -2)).float() / math.sqrt(head_dim)
            logits = logits.masked_fill(~self.causal[:length, :length], torch.finfo(torch.float32).min)
            out_BxHxLxK = logits.softmax(-1).to(v_BxHxLxK.dtype) @ v_BxHxLxK
        out_BxLxD = out_BxHxLxK.transpose(1, 2).reshape(batch, length, d)
        return self.attn_proj(out_BxLxD)

    def forward(self, x_BxLxD: torch.Tensor) -> torch.Tensor:
        x_BxLxD = x_BxLxD + self.attend(self.ln_1(x_BxLxD))
        h = F.gelu(self.c_fc(self.ln_2(x_BxLxD)), approximate="tanh")
        return x_BxLxD + self.mlp_proj(h)


class Transformer(nn.Module):
    """ids [B, L] -> float32 logits [B, L, padded vocab]; padded rows masked as in the JAX model."""

    def __init__(self, m: ml_collections.ConfigDict, attention: str = "sdpa"):
        super().__init__()
        multiple = max(1, int(m.vocab_pad_multiple))
        self.vocab_size = int(m.vocab_size)
        self.vocab_rows = -(-self.vocab_size // multiple) * multiple
        self.wte = nn.Embedding(self.vocab_rows, m.d_model)
        self.wpe = nn.Embedding(m.max_len, m.d_model)
        self.h = nn.ModuleList(Block(m, attention) for _ in range(m.n_layer))
        self.ln_f = nn.LayerNorm(m.d_model, eps=m.layer_norm_epsilon)
        residual_std = INIT_STD / math.sqrt(2 * m.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, residual_std)
            elif name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, 0.0, INIT_STD)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        if self.vocab_rows > self.vocab_size:
            self.register_buffer("padding_V", torch.arange(self.vocab_rows) >= self.vocab_size, persistent=False)

    def forward(self, ids_BxL: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids_BxL.shape[1], device=ids_BxL.device)
        x = self.wte(ids_BxL) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        logits = (self.ln_f(x) @ self.wte.weight.t()).float()  # tied output
        if self.vocab_rows > self.vocab_size:
            logits = logits.masked_fill(self.padding_V, torch.finfo(torch.float32).min)
        return logits

    def gpt2_state_dict(self) -> dict[str, np.ndarray]:
        """This model's weights in the GPT2LMHeadModel layout (for andrea_jax.gpt2.interop.from_gpt2)."""
        wte = self.wte.weight.detach().numpy()[: self.vocab_size]
        sd = {"transformer.wte.weight": wte, "lm_head.weight": wte,
              "transformer.wpe.weight": self.wpe.weight.detach().numpy(),
              "transformer.ln_f.weight": self.ln_f.weight.detach().numpy(),
              "transformer.ln_f.bias": self.ln_f.bias.detach().numpy()}
        for i, block in enumerate(self.h):
            for gpt2_name, our_name in GPT2_NAMES.items():
                module = getattr(block, our_name)
                weight = module.weight.detach().numpy()
                sd[f"transformer.h.{i}.{gpt2_name}.weight"] = weight.T if weight.ndim == 2 else weight
                sd[f"transformer.h.{i}.{gpt2_name}.bias"] = module.bias.detach().numpy()
        return {k: np.array(v, dtype=np.float32) for k, v in sd.items()}

    def load_gpt2(self, sd: Mapping[str, np.ndarray]) -> None:
        """Loads a GPT2LMHeadModel-layout state dict (e.g. from andrea_jax.gpt2.interop.to_gpt2)."""
        t = lambda a: torch.tensor(np.asarray(a), dtype=torch.float32)  # noqa: E731 (a copy)
        with torch.no_grad():
            wte = sd["transformer.wte.weight"]
            self.wte.weight.zero_()
            self.wte.weight[: wte.shape[0]] = t(wte)
            self.wpe.weight.copy_(t(sd["transformer.wpe.weight"]))
            self.ln_f.weight.copy_(t(sd["transformer.ln_f.weight"]))
            self.ln_f.bias.copy_(t(sd["transformer.ln_f.bias"]))
            for i, block in enumerate(self.h):
                for gpt2_name, our_name in GPT2_NAMES.items():
                    module = getattr(block, our_name)
                    weight = sd[f"transformer.h.{i}.{gpt2_name}.weight"]
                    # Conv1D is (in, out); nn.Linear is (out, in). LayerNorm weights are vectors.
                    module.weight.copy_(t(weight.T if weight.ndim == 2 else weight))
                    module.bias.copy_(t(sd[f"transformer.h.{i}.{gpt2_name}.bias"]))


def learning_rate(config: ml_collections.ConfigDict, step: int) -> float:
    """andrea_jax.optimizer.learning_rate_schedule, written out."""
    o = config.optimizer
    peak = o.learning_rate
    warmup = min(int(o.warmup_steps), int(config.steps))
    if step < warmup:
        return peak * step / warmup
    decay_steps = max(1, int(config.steps) - warmup)
    done = min(step - warmup, decay_steps) / decay_steps
    if o.decay == "cosine":
        alpha = o.min_learning_rate_ratio
        return peak * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * done)) + alpha)
    if o.decay == "linear":
        return peak + (peak * o.min_learning_rate_ratio - peak) * done
    return peak


def make_optimizer(model: Transformer, config: ml_collections.ConfigDict) -> torch.optim.AdamW:
    """AdamW over two groups: matrices decay, biases / LayerNorm / positions do not."""
    o = config.optimizer
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if name == "wte.weight":
            (decay if o.decay_embedding else no_decay).append(p)
        elif name != "wpe.weight" and p.dim() == 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=learning_rate(config, 0), betas=(o.b1, o.b2), eps=o.eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)  # one kernel per step on CPU too (torch >= 2.4)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, **kwargs)


class TrainStep:
    """step(batch [B, L+1] int64) -> loss tensor; eager, or through torch.compile with `compile=True`."""

    def __init__(self, config: ml_collections.ConfigDict, attention: str = "sdpa", compile: bool = False,
                 seed: int = 0):
        torch.manual_seed(seed)
        self.config = config
        self.model = Transformer(config.model, attention)
        self.optimizer = make_optimizer(self.model, config)
        self.autocast = config.model.dtype == "bfloat16"
        self.step_count = 0
        self.forward_loss = torch.compile(self._forward_loss) if compile else self._forward_loss

    def _forward_loss(self, batch_BxLp1: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch_BxLp1[:, :-1], batch_BxLp1[:, 1:]
        # bfloat16: matmuls in bf16 with float32 accumulation (oneDNN), like the JAX model.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def __call__(self, batch_BxLp1: torch.Tensor) -> torch.Tensor:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.config, self.step_count)
        loss = self.forward_loss(batch_BxLp1)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optimizer.grad_clip_norm)
        self.optimizer.step()
        self.step_count += 1
        return loss.detach()


if __name__ == "__main__":
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from bench.harness import make_case  # noqa: E402

    config = make_case("mid")
    step = TrainStep(config)
    batch = torch.randint(0, config.model.vocab_size, (config.batch_size, config.seq_len + 1))
    for i in range(4):
        started = time.perf_counter()
        loss = step(batch)
        print(f"step {i}: loss {loss.item():.4f}, {time.perf_counter() - started:.3f} s")
