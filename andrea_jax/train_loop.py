"""The training loop: config + workdir -> a trained, checkpointed run.

Order of things: check the workdir, prepare data (tokenizer + token caches),
build the mesh, initialise or restore the state directly sharded, then step,
log, evaluate and checkpoint. The host only waits for the device to log.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from functools import partial
from typing import Any, Callable

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from andrea_jax import (UserError, checkpoint, evaluate, fit, flops, loss_scale, metrics, optimizer, resolve, run_dir,
                        sharding, trace, train_step, wandb_mirror)
from andrea_jax.tools import hellaswag, parameter_table
from andrea_jax.config import validate
from andrea_jax.data import batcher, eras, pipeline, sources
from andrea_jax.data import tokenizer as tokenizers
from andrea_jax.data.encoder import Encoder
from andrea_jax.runtime import stop, storage
from andrea_jax.runtime.leader_first import leader_first


# All a run writes before its first step: a new workdir holding no more has nothing to keep.
_START_UP_FILES = {run_dir.CONFIG_FILE, run_dir.LOCK_FILE, run_dir.IDENTITY_FILE, pipeline.TOKENIZER_FILE,
                   pipeline.RECORD_FILE, eras.RECORD_FILE, eras.POSITION_FILE}


# The record of the first HellaSwag score at or above GPT-2 124M's (its value); with it "target/tokens" and
# "target/hours" (of training, summed over the run's sessions).
TARGET_KEY = "target/hellaswag_acc_norm"


class TrainingStopped(UserError):
    """The run stopped on purpose (non-finite loss); the message says what to do."""


def prepare_run(config: ml_collections.ConfigDict, copy: storage.WorkingCopy, leader: bool, own_data: bool,
                held: contextlib.ExitStack, request: stop.StopRequest, device: Any = None
                ) -> tuple[Any, ml_collections.ConfigDict, ml_collections.ConfigDict | None]:
    """Checks the workdir, takes it and the run's identity (docs/lifecycle.md), prepares the data (`own_data`: in
    each process, else process 0's for all), fills in the tokenizer's vocabulary size and what "auto" stands for
    on `device` (`resolve.for_devices`; config validated). Returns (prepared data, config, the config the
    workdir's run was started with or None); the leader's locks are released with `held`, and a workdir it
    creates is removed again by a failure or a stop before the first step."""
    workdir = copy.local
    saved = run_dir.load_saved_config(workdir)
    if jax.process_count() > 1:  # every process has seen the directory as it was before the leader writes to it
        multihost_utils.sync_global_devices("andrea_config_read")
    config = ml_collections.ConfigDict(config.to_dict())
    if saved is not None:  # what may change on resume is checked here, once, before any data work
        tokenizer_path = os.path.join(workdir, pipeline.TOKENIZER_FILE)
        if config.model.vocab_size == 0 and os.path.exists(tokenizer_path):  # a resume keeps its tokenizer
            config.model.vocab_size = tokenizers.load(tokenizer_path).vocab_size
        run_dir.check_compatible(saved, config, storage.shown(workdir))

    def undo_if_unstarted(undo: Callable[[], None]) -> None:
        """`undo()` where the new run fails or stops at once before its first step: at the exit of `held`
        (before the lock is released), or in the stop's clean-up before the process ends; the latest first."""
        def if_unstarted(failure: type | None, *_) -> None:
            """After a failure, `undo()` (remove the workdir, its eras or its claim) if the failure came before
            the first step (the checkpoints, metrics and logs opened for it then hold nothing; a Ctrl-C while the
            first era is encoded lands there), or the workdir holds no more than the start-up writes (called
            while the run's lock is held, so no other run can be in it)."""
            with contextlib.suppress(OSError):
                if failure is not None and (not request.training or set(os.listdir(workdir)) <= _START_UP_FILES):
                    undo()
        held.push(if_unstarted)
        request.clean_ups.insert(0, partial(if_unstarted, KeyboardInterrupt))

    def as_leader():
        created = copy.created
        release = run_dir.hold(workdir)  # one run per workdir: before anything is written to it
        held.callback(release)
        request.clean_ups.append(release)  # a lease on a bucket outlives a process that ends at once
        held.callback(copy.close)  # a gs:// workdir's files are written back before the lock is released
        if created:
            undo_if_unstarted(partial(shutil.rmtree, workdir))
            if copy.remote is not None:
                undo_if_unstarted(partial(storage.remove_tree, copy.remote))
        if saved is None:
            run_dir.save_config(workdir, config)  # marks the directory as this run's before data lands in it
        run_id, descriptor = run_dir.claim_identity(workdir, sources.cache_dir_of(config.data))
        if descriptor is not None:
            held.callback(os.close, descriptor)
        if created:
            undo_if_unstarted(partial(run_dir.unclaim, sources.cache_dir_of(config.data), run_id))
        prepared = prepare_data(is_leader=True)
        if created and prepared.train.encoded_beside_training:  # the eras of a new run are its own, keyed by its id
            undo_if_unstarted(partial(shutil.rmtree, prepared.train.directory))
        # On a gs:// workdir, the run's identity and records are on the bucket from here on (a run killed before
        # its first log resumes as this run), and the other processes prepare their data from them.
        copy.push(wait=True)
        return prepared

    # The step it resumes at decides whether a larger stream budget can go on where the run's ended.
    prepare_data = lambda is_leader: pipeline.prepare(config, workdir, is_leader=is_leader or own_data,
                                                      first_step=max(checkpoint.saved_steps(workdir), default=0),
                                                      process=jax.process_index() if own_data else None)
    prepared = leader_first(leader, as_leader, lambda: copy.pull() or prepare_data(is_leader=False),
                            "prepare the data")
    if config.model.vocab_size == 0:
        config.model.vocab_size = prepared.tokenizer.vocab_size
    config = resolve.for_devices(config, device, saved)  # the record says what ran
    # An existing run's config.json is rewritten once a step has trained under this config.
    return prepared, config, saved


def train(config: ml_collections.ConfigDict, workdir: str, devices: list | None = None,
          exit_at_once: bool = False) -> dict:
    """Runs (or resumes) the run in `workdir` on `devices` (default: all); returns the latest logged figures.

    Process 0 holds the workdir's lock (`run_dir.hold`) from before anything is written until the end.
    A workdir the run created and stopped in before its first step is removed again: the disk is left
    as the run found it. A stop at once (before the first step, or a second Ctrl-C) ends the process in one
    line where `exit_at_once` (train.py), else raises StoppedAtOnce (a notebook's kernel lives on).
    """
    with stop.stop_requests(exit_at_once) as request:
        request.line_at_once = partial(_stopped_at_once, workdir)
        try:
            with contextlib.ExitStack() as held:
                copy = storage.WorkingCopy(workdir, owns=_written_here)  # of a gs:// workdir: pulled from it
                held.callback(copy.close)  # writes its files back; process 0's before it releases the lock
                return _train(config, copy, devices, held, request)
        except KeyboardInterrupt:  # a stop at once, where the process lives on; a save under way was finished
            name = request.received[-1] if request.received else "SIGINT"
            raise StoppedAtOnce(_stopped_at_once(workdir, stop.spoken(name), request.training)) from None


class StoppedAtOnce(UserError):
    """A stop at once: before the first step (nothing trained), or a second Ctrl-C (the step it came in is not
    saved)."""


def _stopped_at_once(workdir: str, name: str, training: bool) -> str:
    if not training:
        return (f"stopped by {name} before the first step: nothing was trained or left half-written; run the same "
                f"command to start again")
    newest = max(checkpoint.saved_steps(workdir), default=None)
    return (f"stopped at once by {name}; " + ("no checkpoint was saved yet" if newest is None else
                                              f"the newest checkpoint is step {newest}") +
            "; run the same command to resume")


def _written_here(name: str) -> bool:
    """Whether this process writes the working copy's file `name` back: process 0 all of its files, another
    its own traces."""
    return jax.process_index() == 0 or name.startswith(f"{trace.TRACE_DIR}/process_{jax.process_index()}/")


def _train(config: ml_collections.ConfigDict, copy: storage.WorkingCopy, devices: list | None,
           held: contextlib.ExitStack, request: stop.StopRequest) -> dict:
    leader, workdir = jax.process_index() == 0, copy.local
    validate(config)
    mesh = sharding.make_mesh(config, devices)  # a misfit mesh fails before minutes of data preparation
    hellaswag_examples = None
    if config.hellaswag.every:  # before the data work: offline, an unprepared TFDS HellaSwag stops in seconds
        read = lambda: hellaswag.load(config.hellaswag.source, config.data.tfds_data_dir)
        hellaswag_examples = leader_first(leader, read, read, "prepare the HellaSwag examples")
    # On a gs:// workdir each process keeps the data in its own data.cache_dir (docs/cloud_storage.md), where
    # no disk need be shared; else process 0 prepares them for all.
    own_data = copy.remote is not None and jax.process_count() > 1
    prepared, config, saved = prepare_run(config, copy, leader, own_data, held, request, device=mesh.devices.flat[0])
    if leader and copy.remote is not None:
        print(f"checkpoints go to {copy.remote} through Orbax; metrics, TensorBoard events and traces are written in "
              f"{copy.local} and copied there at each log and checkpoint (docs/cloud_storage.md)", flush=True)
    encoder = None
    if (leader or own_data) and prepared.train.encoded_beside_training:  # encodes while the step compiles
        with contextlib.suppress(FileNotFoundError):  # where an earlier run's steps were: the new one says anew
            os.remove(prepared.train.position_path)
        encoder = Encoder(config, workdir, max(checkpoint.saved_steps(workdir), default=0),
                          jax.process_index() if own_data else None)
        held.callback(encoder.stop)
    mesh = sharding.make_mesh(config, devices)  # again: a resume keeps its own micro-batches, which must split here
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
        held.callback(ckpt.close)  # an async save not waited for is lost
        restored = ckpt.restore(abstract, tokenizer_sha256=prepared.tokenizer.sha256)
        meta = {} if restored is None else restored[1]
        start_step = 0 if restored is None else int(meta["step"])
        carried_losses = list(meta.get("log_interval_losses", []))
        carried_seconds = float(meta.get("train_seconds", 0.0))  # the run's time in earlier sessions
        if restored is None:
            # Built directly sharded: the full model never sits on one device.
            state = jax.jit(lambda rng: sharding.unbox(init(rng)), out_shardings=state_shardings)(
                jax.random.key(config.seed))
            if config.init_params_from:  # a new run from another's parameters; its optimizer starts anew
                state["params"] = _params_from(config.init_params_from, abstract, prepared.tokenizer.sha256)
        else:
            state = {"step": jax.device_put(np.int32(start_step), state_shardings["step"]), **restored[0]}
            if "loss_scale" in abstract and "loss_scale" not in state:  # saved computing in another dtype
                state["loss_scale"] = jax.device_put(loss_scale.init(), state_shardings["loss_scale"])
            if leader:
                print(f"resumed from step {start_step} of {ckpt.directory}", flush=True)
                _report_schedule_change(saved, config, start_step)
        if leader:
            # Records past the start step come from a run that stopped before saving them
            # (also before its first checkpoint): they are logged again below.
            metrics.truncate_after(workdir, start_step)
            wandb_mirror.forget_after(workdir, start_step)  # with W&B off too: its steps past here are not the run's
        target_reached = any(TARGET_KEY in record for record in metrics.read(workdir))
        # After the truncation, which replaces the file.
        writer = metrics.Writer(workdir, enabled=leader, start_step=start_step, config=config)
        held.callback(writer.close)
        if encoder is not None and encoder.first_step != start_step:  # a newer checkpoint was unreadable
            encoder.restart(start_step)
        reader = eras.Reader(prepared.train, config.seed, config.seq_len, config.data.keep_eras,
                             delete_passed=leader or own_data, encoder=encoder and encoder.process,
                             log=lambda line: tqdm.write(line), order=config.data.order)
        make_batch = partial(reader.batch, batch_size=config.batch_size, process_index=jax.process_index(),
                             process_count=jax.process_count())  # this process's rows of a step
        step_trace = trace.StepTrace(workdir, config, start_step)
        held.callback(step_trace.close)
        if prepared.train.encoded_beside_training and start_step < config.steps:  # the wait for the first era in
            make_batch(start_step)  # this thread, where a stop is still a stop at once (one era: built already)
        request.training, request.saving = True, ckpt.saving
        return _loop(steps, state, start_step, carried_losses, carried_seconds, target_reached, prepared, make_batch,
                     reader, hellaswag_rows, mesh, peak, ckpt, writer, step_trace, copy, request)


def _params_from(workdir: str, abstract: dict, tokenizer_sha256: str) -> Any:
    """The parameters of the newest readable checkpoint in `workdir` (config.init_params_from)."""
    with contextlib.closing(checkpoint.Checkpointer(workdir, read_only=True)) as source:
        restored = source.restore({"params": abstract["params"]}, params_only=True, tokenizer_sha256=tokenizer_sha256)
    if restored is None:
        raise checkpoint.CheckpointError(f"init_params_from={workdir!r} holds no checkpoint; point it at a "
                                         f"workdir that train.py saved one in")
    print(f"the parameters start from step {restored[1]['step']} of {workdir} (init_params_from)", flush=True)
    return restored[0]["params"]


def _loop(steps: fit.Steps, state: dict, start_step: int, carried_losses: list[float], carried_seconds: float,
          target_reached: bool, prepared: pipeline.Prepared, make_batch, reader: eras.Reader,
          hellaswag_rows: hellaswag.Encoded | None, mesh: jax.sharding.Mesh, peak: float | None,
          ckpt: checkpoint.Checkpointer, writer: metrics.Writer, step_trace: trace.StepTrace,
          copy: storage.WorkingCopy, request: stop.StopRequest) -> dict:
    config, leader, workdir = steps.config, jax.process_index() == 0, copy.local
    session_start = time.perf_counter()
    train_seconds = lambda: carried_seconds + time.perf_counter() - session_start  # the run's, over its sessions
    batch_sharding = sharding.batch_sharding(mesh)
    flops_per_token = flops.flops_per_token(config.model, config.seq_len)
    val_windows = config.batch_size * min(config.eval_batches, batcher.num_val_batches(
        prepared.val.num_tokens, config.batch_size, config.seq_len))

    last_record: dict = {}  # the latest value of every logged figure
    compared_rates: list = []  # the encoder's rate against training's, said once
    pending: list[tuple[int, dict]] = []  # device metrics since the last host read
    # Host-side losses of the steps since the last log record. A checkpoint carries them,
    # so the first record after a resume averages the same steps as an unbroken run.
    interval_losses = [np.float32(loss) for loss in carried_losses]
    # When the throughput interval began, and its steps; each action restarts it, so its time is not counted.
    interval = [time.perf_counter(), 0]
    progress = tqdm(total=config.steps, initial=start_step, disable=not leader, dynamic_ncols=True, desc="train")

    def drain() -> list[tuple[int, dict]]:
        """Reads pending metrics (the one place the host waits) and stops on a non-finite step."""
        values = jax.device_get(pending)
        pending.clear()
        for at, record in values:
            if not record["finite"]:
                kept = ckpt.steps()
                what, fix = (
                    (f"float16 overflowed at step {at + 1} (loss {record['loss']}, loss scale {record['loss_scale']})",
                     "compute in bfloat16 where the hardware has it, or --config.model.dtype=float32, in a new run")
                    if "loss_scale" in record else
                    (f"loss or gradients became non-finite at step {at + 1} (loss {record['loss']}, grad norm "
                     f"{record['grad_norm']})",
                     "lower optimizer.learning_rate or raise optimizer.warmup_steps and resume"))
                raise TrainingStopped(f"{what}; nothing was saved after it, the last good checkpoint is "
                                      f"{'step ' + str(kept[-1]) if kept else 'none'}; {fix}")
        interval_losses.extend(np.float32(record["loss"]) for _, record in values)
        return values

    # The periodic actions: each takes (step done, state) and returns the record it logs ({}: none).
    def train_metrics(done: int, state: dict) -> dict:
        latest = drain()[-1][1]
        tokens_per_second = interval[1] * config.batch_size * config.seq_len / (time.perf_counter() - interval[0])
        record = {
            "loss": float(np.mean(interval_losses)), "lr": float(latest["lr"]), "grad_norm": float(latest["grad_norm"]),
            "tokens_per_second": tokens_per_second,
            **({} if peak is None else {"mfu": tokens_per_second * flops_per_token / (peak * mesh.devices.size)}),
            # config.diagnostics: the per-block figures of the interval's last step; float16: the loss
            # scale, and how many steps it has skipped since the start
            **{key: float(value) for key, value in latest.items()
               if key.startswith("diag/") or key in ("loss_scale", "skipped_steps")},
        }
        if prepared.train.encoded_beside_training:  # seconds the interval's steps waited for eras being encoded
            record["data_wait_seconds"], reader.wait_seconds = reader.wait_seconds, 0.0
            if not compared_rates:
                compared_rates.append(_compare_rates(reader, record["tokens_per_second"]))
        interval_losses.clear()
        progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_second']:,.0f}",
                             **({"mfu": f"{100 * record['mfu']:.1f}%"} if "mfu" in record else {}))
        return record

    def val_loss(done: int, state: dict) -> dict:
        loss = evaluate.mean_loss(steps.eval, state["params"], prepared.val.tokens, val_windows, config,
                                  batch_sharding)
        bits_per_byte = evaluate.bits_per_byte(loss, prepared.val)
        progress.write(f"step {done}: val_loss {loss:.4f} ({bits_per_byte:.3f} bits per byte)")
        return {"val_loss": loss, "val_bits_per_byte": bits_per_byte}

    def hellaswag_scores(done: int, state: dict) -> dict:
        scored = hellaswag.score(hellaswag_step, state["params"], hellaswag_rows, config, batch_sharding)
        progress.write(f"step {done}: hellaswag acc {scored['acc']:.4f} ± {scored['acc_stderr']:.4f}, acc_norm "
                       f"{scored['acc_norm']:.4f} ± {scored['acc_norm_stderr']:.4f} ({len(hellaswag_rows.labels)} "
                       f"examples)")
        return {f"hellaswag/{key}": scored[key] for key in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")}

    def first_at_target(done: int, state: dict) -> dict:
        """Right after a HellaSwag score: the first at or above GPT-2 124M's, said once and recorded apart."""
        nonlocal target_reached
        if target_reached or last_record["hellaswag/acc_norm"] < hellaswag.GPT2_124M_HELLASWAG:
            return {}
        target_reached, tokens, hours = True, done * config.batch_size * config.seq_len, train_seconds() / 3600
        progress.write(f"step {done}: HellaSwag acc_norm reached GPT-2 124M's {hellaswag.GPT2_124M_HELLASWAG} "
                       f"for the first time, after {tokens:,} tokens and {hours:.2f} hours of training")
        return {TARGET_KEY: hellaswag.GPT2_124M_HELLASWAG, "target/tokens": tokens, "target/hours": hours}

    actions = [(config.log_every, train_metrics), (config.eval_every, val_loss)]
    if hellaswag_rows is not None:
        hellaswag_step = hellaswag.make_step(config, mesh)  # per-token validation losses, compiled when first run
        actions += [(config.hellaswag.every, hellaswag_scores), (config.hellaswag.every, first_at_target)]

    def save(done: int, state: dict) -> None:
        drain()  # never save a state that followed a non-finite step
        copy.push(wait=True)  # a checkpoint on a bucket finds its metrics there
        ckpt.save(done, state, {"tokenizer_sha256": prepared.tokenizer.sha256, "config": config.to_dict(),
                                "data_step": done, "log_interval_losses": [float(loss) for loss in interval_losses],
                                "train_seconds": train_seconds()})

    stopping = False
    done = saved = start_step  # the last finished step, the last saved
    reader.stop_waiting = request.requested
    with contextlib.closing(batcher.prefetch(make_batch, start_step, batch_sharding, end_step=config.steps)) as batches:
        for step in range(start_step, config.steps):
            try:
                batch = next(batches)[1]
            except eras.WaitStopped:  # a stop request ended the wait for this step's era
                batch = None
            if stopping := request.agreed(done, waited_out=batch is None):
                break
            step_trace.before(step + 1)
            state, step_metrics = steps.train(state, batch)
            step_trace.after(step + 1, state)
            pending.append((step, step_metrics))
            done, interval[1] = step + 1, interval[1] + 1
            progress.update(1)
            if done == start_step + 1 and leader:  # the config this step trained under is now the run's
                run_dir.save_config(workdir, config)
            for every, action in actions:
                if done % every == 0 or done == config.steps:
                    record = action(done, state)
                    if record:  # an action may have nothing to say (first_at_target, mostly)
                        writer.write(done, record)
                        last_record.update(record)
                    interval[:] = time.perf_counter(), 0
                    copy.push()  # of a gs:// workdir, written back beside training
            if done % config.checkpoint_every == 0 or done == config.steps:
                save(done, state)
                saved, interval[:] = done, (time.perf_counter(), 0)
    if stopping:
        progress.write(f"{request.reason()} received: saving step {done}, then stopping")
        if done != saved:
            save(done, state)
    ckpt.wait()  # a second Ctrl-C meanwhile is noted: the stop's checkpoint is written first
    progress.close()
    if leader and stopping:
        print(f"stopped at step {done} on {request.reason()}; checkpoint saved in {ckpt.directory}; run the same "
              f"command to resume", flush=True)
    elif leader:
        print(f"finished step {config.steps}; the last checkpoint is "
              f"{os.path.join(ckpt.directory, str(ckpt.steps()[-1]))}", flush=True)
    return {**last_record, "stopped_at": done} if stopping else last_record


def _compare_rates(reader: eras.Reader, tokens_per_second: float) -> None:
    """One line at the first log: whether the era encoder keeps ahead of the steps (else they wait)."""
    if jax.process_index() != 0:
        return
    built = []
    for era in reader.cache.on_disk():
        with contextlib.suppress(OSError, ValueError):  # deleted meanwhile
            built.append(reader.cache.manifest(era))
    if not built:
        return
    rate = max(int(manifest["tokens_per_second"]) for manifest in built)
    verdict = "keeps ahead" if rate >= tokens_per_second else "falls behind: steps will wait for eras"
    tqdm.write(f"the era encoder builds {rate / 1e6:.2f} M tokens/s and training reads "
               f"{tokens_per_second / 1e6:.2f} M tokens/s: the encoder {verdict}")


def _report_schedule_change(saved: ml_collections.ConfigDict | None, config: ml_collections.ConfigDict,
                            start_step: int) -> None:
    """One line when a resume changes the learning-rate schedule's keys: the schedule is recomputed over
    the new values, so the rate jumps at the resumed step (`steps=1100` on a finished 1000-step run
    raises it again)."""
    if saved is None or not start_step:
        return
    keys = ("steps", *(f"optimizer.{key}" for key in ("learning_rate", "warmup_steps", "decay", "cooldown_steps",
                                                       "cooldown_shape", "min_learning_rate_ratio")))
    changes = [f"{key} {saved[key]} → {config[key]}" for key in keys if saved[key] != config[key]]
    if changes:
        now, before = (float(optimizer.learning_rate_schedule(c)(start_step)) for c in (config, saved))
        cooldown = optimizer.cooldown_start(config)
        if cooldown is not None and start_step < cooldown and now == before:
            what = f"step {start_step + 1} trains at {now:.3g} as before; the cooldown now starts at step {cooldown}"
        else:
            what = f"step {start_step + 1} trains at {now:.3g}, where the run's own schedule gave {before:.3g}"
        print(f"the learning-rate schedule changes on resume ({', '.join(changes)}): {what}", flush=True)
