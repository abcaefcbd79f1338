"""Evaluating a saved run: restore its params onto the devices present, score the validation split.

Loss is the mean next-token loss over consecutive, non-overlapping windows of the
split (the windows the training loop evaluates, in the same order); bits per
byte divide the evaluated tokens' loss by the UTF-8 bytes they stand for, taken
from the token cache's measured byte count in proportion to the tokens evaluated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from functools import partial
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding

from andrea_jax import UserError, checkpoint, model, resolve, run_dir, sharding, train_step
from andrea_jax.runtime import atomic, storage
from andrea_jax.tools import sampling
from andrea_jax.config import ConfigError, validate
from andrea_jax.data import batcher, pipeline
from andrea_jax.data import tokenizer as tokenizers
from andrea_jax.data.token_cache import TokenSplit


class EvalError(UserError):
    """A run that cannot be evaluated as asked; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Restored:
    params: Any
    step: int
    config: ml_collections.ConfigDict  # vocab_size resolved
    tokenizer: tokenizers.Tokenizer
    mesh: Mesh


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a run was trained with, from its config.json; EvalError when there is none."""
    if not os.path.isfile(os.path.join(workdir, run_dir.CONFIG_FILE)):
        raise EvalError(f"{workdir} holds no {run_dir.CONFIG_FILE}; pass the directory train.py wrote, "
                        f"or --config with the run's config file")
    return run_dir.load_saved_config(workdir)


def restore(workdir: str, config: ml_collections.ConfigDict | None = None, step: int | None = None) -> Restored:
    """The params of `step` (default: the newest readable), sharded over the devices present; `config`
    replaces the run's own."""
    workdir = os.fspath(workdir)
    if not os.path.isdir(workdir):
        raise EvalError(f"--workdir {workdir} does not exist; pass the directory train.py wrote")
    if config is None:
        config = run_config(workdir)
    elif os.path.exists(os.path.join(workdir, run_dir.CONFIG_FILE)):  # another config must build the run's model
        run_dir.check_compatible(run_dir.load_saved_config(workdir), config, workdir, only="model.")
    tokenizer_path = os.path.join(workdir, pipeline.TOKENIZER_FILE)
    if not os.path.isfile(tokenizer_path):
        raise EvalError(_without_tokenizer(workdir))
    tokenizer = tokenizers.load(tokenizer_path)
    config = ml_collections.ConfigDict(config.to_dict())
    if config.model.vocab_size == 0:
        config.model.vocab_size = tokenizer.vocab_size
    validate(config)
    directory = checkpoint.directory_of(workdir)
    ckpt = checkpoint.Checkpointer(workdir, read_only=True) if storage.exists(directory) else None
    try:
        if ckpt is None or not ckpt.steps():
            raise EvalError(f"no checkpoint in {directory} yet; train first (python train.py --workdir "
                            f"{workdir} ...), a checkpoint is written every checkpoint_every steps and at the end")
        try:
            mesh = sharding.make_mesh(config)
        except ConfigError:
            # The run's mesh does not fit the devices here: every usable one on the data axis, and one
            # micro-batch (which splits over any of them).
            devices, run_mesh = jax.devices(), dict(config.mesh)
            count = max(n for n in range(1, len(devices) + 1) if config.batch_size % n == 0)
            config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
            config.microbatches = 1
            mesh = sharding.make_mesh(config, devices[:count])
            print(f"note: the run's mesh {run_mesh} does not fit the {len(devices)} device(s) here; "
                  f"evaluating on {sharding.describe(mesh)}", flush=True)
        config = resolve.for_devices(config, mesh.devices.flat[0], evaluating=True)
        axis_rules = sharding.rules(config)
        with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules):
            boxed = jax.eval_shape(partial(model.init_params, config.model), jax.random.key(0))
            shardings = sharding.logical_shardings(boxed, mesh, axis_rules)
        abstract = {"params": checkpoint.abstract_like(sharding.unbox(boxed), shardings)}
        state, meta = ckpt.restore(abstract, step=step, params_only=True, tokenizer_sha256=tokenizer.sha256)
    finally:
        if ckpt is not None:
            ckpt.close()
    return Restored(state["params"], int(meta["step"]), config, tokenizer, mesh)


def _without_tokenizer(workdir: str) -> str:
    """What a workdir without tokenizer.json is, and what to do: train.py writes config.json first, then the
    tokenizer while it prepares the data, then checkpoints."""
    if not os.path.isfile(os.path.join(workdir, run_dir.CONFIG_FILE)):
        return f"{workdir} has no {pipeline.TOKENIZER_FILE}; pass the directory train.py wrote"
    if checkpoint.saved_steps(workdir):
        return (f"{workdir} has checkpoints but no {pipeline.TOKENIZER_FILE}; put the run's own "
                f"{pipeline.TOKENIZER_FILE} back (its checkpoints record its SHA-256)")
    return (f"the run in {workdir} never finished preparing its data (it has no {pipeline.TOKENIZER_FILE} and no "
            f"checkpoint): there is nothing to evaluate; run train.py with this --workdir to prepare the data and train")


def validation_split(config: ml_collections.ConfigDict, tokenizer: tokenizers.Tokenizer,
                     build: bool = True) -> TokenSplit:
    """The validation tokens of `config.data`, from the token cache (built if missing, with `build`)."""
    return pipeline.validation_split(config, pipeline.open_splits(config), tokenizer, build)


def scored_batches(step: Callable, params: Any, local_batch: Callable[[int], np.ndarray], batches: int,
                   batch_sharding: NamedSharding) -> Iterator[np.ndarray]:
    """step(params, batch) of batches 0 .. batches - 1 on the host, in order, each fetched while the next runs: the
    one scoring loop of validation and HellaSwag; `local_batch(index=i)` is this process's rows of batch i."""
    in_flight = None
    for index in range(batches):
        output = step(params, batcher.to_global(local_batch(index=index), batch_sharding))
        if in_flight is not None:
            yield np.asarray(jax.device_get(in_flight))
        in_flight = output
    yield np.asarray(jax.device_get(in_flight))


def mean_loss(eval_step: Callable, params: Any, tokens: np.ndarray, windows: int,
              config: ml_collections.ConfigDict, batch_sharding: NamedSharding) -> float:
    """Mean loss of the first `windows` validation windows, scored in batches of config.batch_size
    (`eval_step` is `train_step.make_eval_step`'s)."""
    local_batch = partial(batcher.val_batch, tokens, batch_size=config.batch_size, seq_len=config.seq_len,
                          process_index=jax.process_index(), process_count=jax.process_count())
    row_losses = scored_batches(eval_step, params, local_batch, -(-windows // config.batch_size), batch_sharding)
    return float(np.mean(np.concatenate(list(row_losses))[:windows], dtype=np.float64))


def bits_per_byte(loss: float, split: TokenSplit) -> float:
    """A mean token loss of `split`'s windows in bits a UTF-8 byte, at the split's measured bytes a token."""
    return loss * split.num_tokens / (split.num_bytes * math.log(2))


def score(restored: Restored, split: TokenSplit, batches: int) -> dict:
    """Loss, perplexity and bits per byte over the first `batches` batches (0 = every window)."""
    config, mesh = restored.config, restored.mesh
    batch_size, seq_len = int(config.batch_size), int(config.seq_len)
    available = batcher.num_val_windows(split.num_tokens, seq_len)
    if available < 1:
        raise EvalError(f"the validation split has {split.num_tokens} tokens, fewer than seq_len + 1 = "
                        f"{seq_len + 1}; lower --config.seq_len")
    windows = available if batches == 0 else min(available, batches * batch_size)
    if 0 < batches and batches * batch_size > available:
        print(f"note: the validation split has {available} windows, fewer than {batches} batches of "
              f"{batch_size}; evaluating all of them", flush=True)
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.rules(config)):
        eval_step = jax.jit(train_step.make_eval_step(config), out_shardings=sharding.replicated(mesh))
        loss = mean_loss(eval_step, restored.params, split.tokens, windows, config, sharding.batch_sharding(mesh))
    tokens = windows * seq_len
    fraction = tokens / split.num_tokens
    num_bytes = split.num_bytes * fraction  # the bytes the evaluated tokens stand for
    return {
        "step": restored.step, "split": "val", "loss": loss, "perplexity": math.exp(loss),
        "bits_per_byte": bits_per_byte(loss, split),
        "tokens": tokens, "bytes": num_bytes, "fraction_of_split": fraction,
        "batches": -(-windows // batch_size), "batch_size": batch_size, "seq_len": seq_len,
        "split_tokens": split.num_tokens, "split_bytes": split.num_bytes,
        "mesh": sharding.describe(mesh), "dtype": config.model.dtype, "attention": config.model.attention,
    }


def write_report(workdir: str, report: dict) -> str:
    """eval_step<N>.json in the workdir, written atomically; returns its path."""
    path = os.path.join(workdir, f"eval_step{report['step']}.json")
    atomic.write(path, json.dumps(report, indent=1))
    return path


def continue_text(restored: Restored, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int,
                  top_p: float, seed: int) -> str:
    """The prompt's continuation (KV-cached sampling), stopping at end-of-text if the tokenizer has it."""
    tokenizer, model_config = restored.tokenizer, restored.config.model
    if tokenizer.eot_id is None:
        if not prompt:
            raise EvalError("this tokenizer has no end-of-text token to start a new document from; "
                            "pass a --prompt with some text, e.g. a newline")
        print(f"note: the {tokenizer.kind} tokenizer has no end-of-text token, so the sample cannot stop "
              f"early: it runs to --max_new_tokens={max_new_tokens} or the end of the context", flush=True)
    prompt_ids = tokenizer.encode(prompt) if prompt else [tokenizer.eot_id]  # "": a new document
    room = int(model_config.max_len) - 1
    if len(prompt_ids) > room:
        print(f"note: the prompt has {len(prompt_ids)} tokens; keeping the last {room} "
              f"(model.max_len={model_config.max_len})", flush=True)
        prompt_ids = prompt_ids[-room:]
    with jax.set_mesh(restored.mesh), nn.logical_axis_rules(sharding.rules(restored.config)):
        new_ids = sampling.generate(restored.params, model_config, prompt_ids, max_new_tokens=max_new_tokens,
                                    temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                    eot_id=tokenizer.eot_id)
    return tokenizer.decode(new_ids)
