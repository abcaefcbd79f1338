"""Shared pieces of the step benchmarks: the cases, the project's jitted step, timing, the table.

The JAX step is built exactly as `andrea_jax.train_loop.train` builds it: the
(data, fsdp, tensor) mesh (here of one device), state shardings from the logical
axis rules, the state initialised directly sharded, and the train step jitted
with in/out shardings and the state donated. Batches are synthetic random
tokens already on the device (the loop's prefetcher puts them there ahead).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import platform
import statistics
import subprocess
import time
from functools import partial
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from andrea_jax import fit, flops, optimizer, precision, sharding, train_step
from andrea_jax.config import ANDREA_VOCAB_SIZE, base_config, padded_vocab_size, validate
from andrea_jax.model import mlp_hidden_dim
from bench.synthetic import random_batches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project_config(name: str) -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location(f"configs.{name}", os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def make_case(name: str, **model_overrides) -> ml_collections.ConfigDict:
    """The benchmark cases; `model_overrides` change `config.model` (the levers)."""
    if name == "shakespeare":  # configs/shakespeare_char.py; 65 characters + end-of-text
        c = _project_config("shakespeare_char")
        c.model.vocab_size = 66
    elif name == "mid":
        c = base_config()
        m = c.model
        m.n_layer, m.d_model, m.n_head, m.mlp_dim, m.max_len = 6, 384, 6, 1536, 256
        m.vocab_size = ANDREA_VOCAB_SIZE
        c.seq_len, c.batch_size = 256, 8
    elif name in ("a120", "a120_f32", "a120_bf16"):  # configs/andrea120m.py on a CPU-sized batch
        c = _project_config("andrea120m")
        c.seq_len, c.batch_size = 128, 4
        c.model.dtype = {"a120": c.model.dtype, "a120_f32": "float32", "a120_bf16": "bfloat16"}[name]
    elif name == "gpu120m":  # the accelerator check: context 1024, bf16, no remat
        c = _project_config("andrea120m")
        c.model.dtype, c.model.remat = "bfloat16", False
        c.seq_len = 1024
    else:
        raise ValueError(f"unknown case {name!r}; pick one of shakespeare, mid, a120, a120_f32, a120_bf16, gpu120m")
    for key, value in model_overrides.items():
        c.model[key] = value
    c.model.dtype = precision.resolve_dtype_name(c.model.dtype)  # the table names what ran
    validate(c)
    return c


def describe_case(c: ml_collections.ConfigDict) -> str:
    m = c.model
    return (f"{m.n_layer}L d{m.d_model} h{m.n_head} mlp{m.mlp_dim} V{m.vocab_size} "
            f"seq{c.seq_len} B{c.batch_size} {m.dtype}")


class JaxStep:
    """The project's train step, jitted as the training loop jits it, with its state."""

    def __init__(self, config: ml_collections.ConfigDict, donate: bool = True, num_batches: int = 4,
                 sync_every_step: bool = False, compiler_options: dict | None = None):
        self.config = config
        self.sync_every_step = sync_every_step
        self._stack = contextlib.ExitStack()
        mesh = sharding.make_mesh(config, devices=jax.devices()[:1])
        axis_rules = sharding.rules(config)
        # The model's logical constraints read the rules at trace time: keep them active.
        self._stack.enter_context(jax.set_mesh(mesh))
        self._stack.enter_context(nn.logical_axis_rules(axis_rules))
        tx = optimizer.make(config)
        schedule = optimizer.learning_rate_schedule(config)
        init = partial(train_step.init_state, config=config, tx=tx)
        boxed = jax.eval_shape(init, jax.random.key(config.seed))
        state_shardings = sharding.logical_shardings(boxed, mesh, axis_rules)
        batch_sharding = sharding.batch_sharding(mesh)
        self.state = jax.jit(lambda rng: sharding.unbox(init(rng)), out_shardings=state_shardings)(
            jax.random.key(config.seed))
        self.step_fn = jax.jit(train_step.make_train_step(config, tx, schedule),
                               in_shardings=(state_shardings, batch_sharding),
                               out_shardings=(state_shardings, sharding.replicated(mesh)),
                               donate_argnums=0 if donate else (),
                               compiler_options={**fit.compiler_options(mesh), **(compiler_options or {})})
        self.batches = [jax.device_put(b, batch_sharding) for b in random_batches(config, num_batches)]
        self._next = 0
        self.compile_s = None

    def compile(self) -> float:
        """The first call: trace, lower, XLA compile and one step; returns its seconds."""
        started = time.perf_counter()
        self.run(1)
        self.compile_s = time.perf_counter() - started
        return self.compile_s

    def run(self, steps: int) -> float:
        """`steps` steps with the loop's host pattern (metrics read once at the end); seconds a step."""
        pending = []
        started = time.perf_counter()
        for _ in range(steps):
            self.state, metrics = self.step_fn(self.state, self.batches[self._next % len(self.batches)])
            self._next += 1
            if self.sync_every_step:
                jax.device_get(metrics)
            else:
                pending.append(metrics)
        jax.block_until_ready(self.state)
        values = jax.device_get(pending)
        elapsed = time.perf_counter() - started
        assert all(bool(v["finite"]) for v in values)
        return elapsed / steps

    def close(self):
        self._stack.close()


def flops_per_step(config: ml_collections.ConfigDict) -> tuple[float, float]:
    """(nanoGPT/PaLM convention, exact causal matmul count) FLOPs of one train step."""
    tokens = config.batch_size * config.seq_len
    return (flops.flops_per_token(config.model, config.seq_len) * tokens,
            exact_flops_per_token(config.model, config.seq_len) * tokens)



def exact_flops_per_token(model_config: ml_collections.ConfigDict, seq_len: int) -> float:
    """Training matmul FLOPs per token with the causal mask's half of attention skipped."""
    m = model_config
    d, f = m.d_model, mlp_hidden_dim(m)
    mlp_in = 2 if m.activation == "swiglu" else 1
    matmul_weights = m.n_layer * (3 * d * d + d * d + (mlp_in + 1) * d * f) + padded_vocab_size(m) * d
    # q·kᵀ and probs·v: 2 matmuls of 2·d FLOPs per (query, key) pair, on average (T+1)/2 keys.
    attention = m.n_layer * 2 * 2 * d * (seq_len + 1) / 2
    return 3 * (2 * matmul_weights + attention)

class Matmul:
    """A square matmul through jit, float32 or bfloat16 inputs with float32 accumulation."""

    def __init__(self, dtype: str, size: int = 2048, repeats: int = 4):
        jdtype = jnp.float32 if dtype == "float32" else jnp.bfloat16
        keys = jax.random.split(jax.random.key(1))
        self.a = jax.random.normal(keys[0], (size, size), jdtype)
        self.b = jax.random.normal(keys[1], (size, size), jdtype)
        self.fn = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
        self.flops = 2 * size ** 3
        self.repeats = repeats
        self.fn(self.a, self.b).block_until_ready()

    def run(self) -> float:
        """FLOP/s of this repetition."""
        started = time.perf_counter()
        for _ in range(self.repeats):
            out = self.fn(self.a, self.b)
        out.block_until_ready()
        return self.flops * self.repeats / (time.perf_counter() - started)


def interleave(reps: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Runs one repetition of each entry per round, the order rotating, so that load hits all alike."""
    names = list(reps)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(reps[name]())
    return samples


def median(values: list[float]) -> float:
    return statistics.median(values)


def steps_per_rep(seconds_per_step: float, target_s: float = 1.0) -> int:
    return max(1, round(target_s / max(seconds_per_step, 1e-6)))


def git_commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "andrea_jax")
    return commit + (" + uncommitted changes in andrea_jax/" if dirty else "")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    device = jax.devices()[0]
    accelerator = "" if device.platform == "cpu" else f", {jax.device_count()}× {device.device_kind}"
    return f"{os.cpu_count()} CPU cores ({cpu}){accelerator}"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def header(command: str) -> str:
    return (f"command: {command}\ndate: {datetime.datetime.now().isoformat(timespec='minutes')}  "
            f"commit: {git_commit()}\nmachine: {machine()}; load average at start {load_average()}\n"
            f"jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")


def format_table(columns: list[str], rows: list[list[str]]) -> str:
    """A Markdown table, so that it pastes into RESULTS.md as it is."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
