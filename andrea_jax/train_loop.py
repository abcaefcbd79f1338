"""The training loop: config + workdir -> a trained, checkpointed run.

Order of things: check the workdir, prepare data (tokenizer + token caches),
build the mesh, initialise or restore the state directly sharded, then step,
log, evaluate and checkpoint. The host only waits for the device to log.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from andrea_jax import (checkpoint, evaluate, fit, flops, loss_scale, metrics, optimizer, resolve, sharding,
                        train_step)
from andrea_jax import UserError
from andrea_jax.tools import hellaswag
from andrea_jax.tools import parameter_table
from andrea_jax import run_dir
from andrea_jax.config import validate
from andrea_jax.data import batcher, pipeline
from andrea_jax.data import tokenizer as tokenizers
from andrea_jax.runtime.leader_first import leader_first


class TrainingStopped(UserError):
    """The run stopped on purpose (non-finite loss); the message says what to do."""


class _StopSignal:
    """Remembers SIGTERM/SIGINT so the loop can finish the step and save first."""

    def __init__(self):
        self.received: str | None = None
        self.announced = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay with the caller
                pass
        return self

    def _handle(self, signum, frame):
        # Only a flag: printing here could re-enter a write the progress bar is in the middle of.
        self.received = signal.Signals(signum).name
        # A second Ctrl-C stops at once.
        signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))

    def __exit__(self, *exc_info):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


_held_locks: list[int] = []


def _barrier(name: str):
    if jax.process_count() == 1:
        return None
    return lambda: multihost_utils.sync_global_devices(name)


def prepare_run(config: ml_collections.ConfigDict, workdir: str, leader: bool, device: Any = None
                ) -> tuple[Any, ml_collections.ConfigDict, ml_collections.ConfigDict | None]:
    """Checks the workdir, prepares the data, fills in the tokenizer's vocabulary size and what
    "auto" stands for on `device` (`resolve.for_devices`; config validated). Returns (prepared data,
    config, the config the workdir's run was started with or None)."""
    saved = run_dir.load_saved_config(workdir)
    read_by_all = _barrier("andrea_config_read")
    if read_by_all is not None:
        read_by_all()  # every process has seen the directory as it was before the leader writes to it
    config = ml_collections.ConfigDict(config.to_dict())
    if saved is not None:  # the model's shape is checked here, once, before any data work
        tokenizer_path = os.path.join(workdir, pipeline.TOKENIZER_FILE)
        if config.model.vocab_size == 0 and os.path.exists(tokenizer_path):  # a resume keeps its tokenizer
            config.model.vocab_size = tokenizers.load(tokenizer_path).vocab_size
        run_dir.check_compatible(saved, config, workdir)

    def as_leader():
        lock = run_dir.hold(workdir)  # one run per workdir: before anything is written to it
        _held_locks.append(lock)
        if saved is None:
            run_dir.save_config(workdir, config)  # marks the directory as this run's before data lands in it
        return pipeline.prepare(config, workdir, is_leader=True)

    prepared = leader_first(leader, as_leader, lambda: pipeline.prepare(config, workdir, is_leader=False),
                            "prepare the data")
    if config.model.vocab_size == 0:
        config.model.vocab_size = prepared.tokenizer.vocab_size
    config = resolve.for_devices(config, device, saved)  # the record says what ran
    # An existing run's config.json is rewritten by `train` once its checkpoints are known to fit.
    return prepared, config, saved


def train(config: ml_collections.ConfigDict, workdir: str, devices: list | None = None) -> dict:
    """Runs (or resumes) the run in `workdir` on `devices` (default: all); returns the last logged record.

    Process 0 holds the workdir's lock (`workdir.hold`) from before anything is written until the end.
    """
    try:
        return _train(config, workdir, devices)
    finally:
        while _held_locks:
            os.close(_held_locks.pop())


def _train(config: ml_collections.ConfigDict, workdir: str, devices: list | None) -> dict:
    leader = jax.process_index() == 0
    validate(config)
    mesh = sharding.make_mesh(config, devices)  # a misfit mesh fails before minutes of data preparation
    hellaswag_examples = None
    if config.hellaswag.every:  # before the data work: offline, an unprepared TFDS HellaSwag stops in seconds
        read = lambda: hellaswag.load(config.hellaswag.source, config.data.tfds_data_dir)
        hellaswag_examples = leader_first(leader, read, read, "prepare the HellaSwag examples")
    prepared, config, saved = prepare_run(config, workdir, leader, device=mesh.devices.flat[0])
    hellaswag_rows = None if hellaswag_examples is None else \
        hellaswag.rows_of(hellaswag_examples, config.hellaswag.examples, prepared.tokenizer)
    axis_rules = sharding.rules(config)
    peak, peak_source = flops.peak_flops(config)
    if leader:
        print(parameter_table.format_table(config.model))
        mfu = f"no MFU: {peak_source}"
        if peak is not None:
            mfu = (f"MFU in the nanoGPT/PaLM convention ({flops.flops_per_token(config.model, config.seq_len) / 1e6:.1f}"
                   f" MFLOP a token) against {peak / 1e12:.2f} TFLOP/s per device ({peak_source})")
        print(f"mesh {sharding.describe(mesh)}; compute {config.model.dtype}; "
              f"{config.batch_size * config.seq_len:,} tokens a step; {mfu}", flush=True)

    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules):
        abstract, state_shardings = fit.abstract_state(config, mesh, axis_rules, jax.random.key(config.seed))
        # Compiled before any state exists, so that the choice of micro-batches sees the whole memory.
        steps = fit.fit(config, mesh, abstract, state_shardings, fit.device_memory_limit(),
                        report=print if leader else lambda line: None)
        config = steps.config
        init = partial(train_step.init_state, config=config, tx=optimizer.make(config))

        ckpt = checkpoint.Checkpointer(workdir, keep=config.keep_checkpoints)
        writer = None
        try:
            restored = ckpt.restore(abstract, tokenizer_sha256=prepared.tokenizer.sha256)
            carried_losses: list[float] = []
            if restored is None:
                # Built directly sharded: the full model never sits on one device.
                state = jax.jit(lambda rng: sharding.unbox(init(rng)), out_shardings=state_shardings)(
                    jax.random.key(config.seed))
                start_step = 0
            else:
                restored_state, meta = restored
                start_step = int(meta["step"])
                carried_losses = list(meta.get("log_interval_losses", []))
                state = {"step": jax.device_put(np.int32(start_step), state_shardings["step"]), **restored_state}
                if "loss_scale" in abstract and "loss_scale" not in state:  # saved computing in another dtype
                    state["loss_scale"] = jax.device_put(loss_scale.init(), state_shardings["loss_scale"])
                if leader:
                    print(f"resumed from step {start_step} of {ckpt.directory}", flush=True)
                    _report_schedule_change(saved, config, start_step)
            if leader:
                # Records past the start step come from a run that stopped before saving them
                # (also before its first checkpoint): they are logged again below.
                metrics.truncate_after(workdir, start_step)
                run_dir.save_config(workdir, config)
            # After the truncation, which replaces the file.
            writer = metrics.Writer(workdir, enabled=leader, start_step=start_step)
            return _loop(steps, state, start_step, carried_losses, prepared, hellaswag_rows, mesh, peak, ckpt,
                         writer)
        finally:
            ckpt.close()  # an async save not waited for is lost
            if writer is not None:
                writer.close()


def _loop(steps: fit.Steps, state: dict, start_step: int, carried_losses: list[float], prepared: pipeline.Prepared,
          hellaswag_rows: hellaswag.Encoded | None, mesh: jax.sharding.Mesh, peak: float | None,
          ckpt: checkpoint.Checkpointer, writer: metrics.Writer) -> dict:
    config, leader = steps.config, jax.process_index() == 0
    batch_sharding = sharding.batch_sharding(mesh)
    tokens_per_step = config.batch_size * config.seq_len
    flops_per_step = flops.flops_per_token(config.model, config.seq_len) * tokens_per_step
    val_windows = config.batch_size * min(config.eval_batches, batcher.num_val_batches(
        prepared.val.num_tokens, config.batch_size, config.seq_len))
    # The per-token losses of the validation step's batch shape: compiled at the first HellaSwag score.
    hellaswag_step = hellaswag.make_step(config, mesh) if hellaswag_rows is not None else None

    def make_batch(step: int) -> np.ndarray:
        return batcher.train_batch(prepared.train.tokens, seed=config.seed, step=step, batch_size=config.batch_size,
                                   seq_len=config.seq_len, process_index=jax.process_index(),
                                   process_count=jax.process_count())

    meta = {"tokenizer_sha256": prepared.tokenizer.sha256, "config": config.to_dict()}
    last_record: dict = {}
    pending: list[tuple[int, dict]] = []  # device metrics since the last host read
    # Host-side losses of the steps since the last log record. A checkpoint carries them,
    # so the first record after a resume averages the same steps as an unbroken run.
    interval_losses = [np.float32(loss) for loss in carried_losses]
    interval_start, interval_steps = time.perf_counter(), 0

    def drain() -> list[tuple[int, dict]]:
        """Reads pending metrics (the one place the host waits) and stops on a non-finite step."""
        values = jax.device_get(pending)
        pending.clear()
        for at, record in values:
            if not record["finite"]:
                kept = ckpt.steps()
                if "loss_scale" in record:
                    raise TrainingStopped(
                        f"float16 overflowed at step {at + 1} (loss {record['loss']}, loss scale "
                        f"{record['loss_scale']}); nothing was saved after it, the last good checkpoint is "
                        f"{'step ' + str(kept[-1]) if kept else 'none'}; compute in bfloat16 where the hardware "
                        f"has it, or --config.model.dtype=float32, in a new run")
                raise TrainingStopped(
                    f"loss or gradients became non-finite at step {at + 1} (loss {record['loss']}, grad norm "
                    f"{record['grad_norm']}); nothing was saved after it, the last good checkpoint is "
                    f"{'step ' + str(kept[-1]) if kept else 'none'}; lower optimizer.learning_rate or raise "
                    f"optimizer.warmup_steps and resume")
        interval_losses.extend(np.float32(record["loss"]) for _, record in values)
        return values

    progress = tqdm(total=config.steps, initial=start_step, disable=not leader, dynamic_ncols=True,
                    desc="train")
    with _StopSignal() as stop, batcher.Prefetcher(make_batch, start_step, batch_sharding) as batches:
        for step in range(start_step, config.steps):
            _, batch = next(batches)
            state, step_metrics = steps.train(state, batch)
            pending.append((step, step_metrics))
            interval_steps += 1
            done = step + 1
            progress.update(1)

            if done % config.log_every == 0 or done == config.steps:
                values = drain()
                elapsed = time.perf_counter() - interval_start
                tokens_per_second = interval_steps * tokens_per_step / elapsed
                last_record = {
                    "loss": float(np.mean(interval_losses)),
                    "lr": float(values[-1][1]["lr"]), "grad_norm": float(values[-1][1]["grad_norm"]),
                    "tokens_per_second": tokens_per_second,
                    **({} if peak is None else
                       {"mfu": flops_per_step * interval_steps / elapsed / (peak * mesh.devices.size)}),
                    # config.diagnostics: the per-block figures of the interval's last step
                    **{key: float(value) for key, value in values[-1][1].items() if key.startswith("diag/")},
                    # float16: the loss scale, and how many steps it has skipped since the start
                    **{key: float(values[-1][1][key]) for key in ("loss_scale", "skipped_steps")
                       if key in values[-1][1]},
                }
                writer.write(done, last_record)
                interval_losses.clear()
                progress.set_postfix(loss=f"{last_record['loss']:.3f}", tok_s=f"{tokens_per_second:,.0f}",
                                     **({"mfu": f"{100 * last_record['mfu']:.1f}%"} if "mfu" in last_record else {}))
                interval_start, interval_steps = time.perf_counter(), 0

            if done % config.eval_every == 0 or done == config.steps:
                val_loss = evaluate.mean_loss(steps.eval, state["params"], prepared.val.tokens, val_windows, config,
                                              batch_sharding)
                writer.write(done, {"val_loss": val_loss})
                last_record = {**last_record, "val_loss": val_loss}
                progress.write(f"step {done}: val_loss {val_loss:.4f}")
                interval_start, interval_steps = time.perf_counter(), 0

            if hellaswag_step is not None and (done % config.hellaswag.every == 0 or done == config.steps):
                scored = hellaswag.metrics_of(hellaswag.score(hellaswag_step, state["params"], hellaswag_rows,
                                                              config, batch_sharding))
                writer.write(done, scored)
                last_record = {**last_record, **scored}
                progress.write(f"step {done}: hellaswag acc {scored['hellaswag/acc']:.4f} ± "
                               f"{scored['hellaswag/acc_stderr']:.4f}, acc_norm {scored['hellaswag/acc_norm']:.4f} ± "
                               f"{scored['hellaswag/acc_norm_stderr']:.4f} ({len(hellaswag_rows.labels)} examples)")
                interval_start, interval_steps = time.perf_counter(), 0

            if stop.received and not stop.announced:
                stop.announced = True
                progress.write(f"{stop.received} received: saving a checkpoint, then stopping "
                               f"(with several processes, at the next log step)", file=sys.stderr)
            stopping = _agreed(stop.received is not None, done, config)
            if done % config.checkpoint_every == 0 or done == config.steps or stopping:
                drain()  # never save a state that followed a non-finite step
                ckpt.save(done, state, {**meta, "data_step": done,
                                        "log_interval_losses": [float(loss) for loss in interval_losses]})
                interval_start, interval_steps = time.perf_counter(), 0
            if stopping:
                ckpt.wait()
                progress.close()
                if leader:
                    print(f"stopped at step {done} on {stop.received or 'a signal to another process'}; "
                          f"checkpoint saved in {ckpt.directory}; run the same command to resume", flush=True)
                return {**last_record, "stopped_at": done}
    progress.close()
    ckpt.wait()
    if leader:
        print(f"finished step {config.steps}; the last checkpoint is "
              f"{os.path.join(ckpt.directory, str(ckpt.steps()[-1]))}", flush=True)
    return last_record


def _report_schedule_change(saved: ml_collections.ConfigDict | None, config: ml_collections.ConfigDict,
                            start_step: int) -> None:
    """One line when a resume recomputes the learning-rate schedule: the rate jumps at the resumed step."""
    changes = run_dir.schedule_changes(saved, config) if saved is not None and start_step else []
    if changes:
        now, before = (float(optimizer.learning_rate_schedule(c)(start_step)) for c in (config, saved))
        print(f"the learning-rate schedule changes on resume ({', '.join(changes)}): step {start_step + 1} "
              f"trains at {now:.3g}, where the run's own schedule gave {before:.3g}", flush=True)


def _agreed(local_stop: bool, done: int, config) -> bool:
    """Whether to stop now; with several processes, any one's signal stops all at a log step."""
    if jax.process_count() == 1:
        return local_stop
    if done % config.log_every:
        return False
    flags = multihost_utils.process_allgather(np.array(local_stop))
    return bool(np.any(flags))
