"""Fitting the step to a device's memory: the choice of micro-batches, remat, and the refusals."""

import json
import os
import shutil

import flax.linen as nn
import jax
import pytest

from andrea_jax import fit, sharding, train_loop
from andrea_jax.compile.program_text import without_source_info
from andrea_jax.config import ConfigError, base_config
from tests.test_train_loop import loop_config, losses

VOCAB = 128


def small_config(**overrides):
    c = base_config()
    m = c.model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim, m.vocab_size, m.max_len = 2, 64, 4, 256, VOCAB, 64
    c.seq_len, c.batch_size = 64, 16
    c.mesh.data = 2
    c.update_from_flattened_dict(overrides)
    return c


def fit_on_cpu(config, limit, devices=None, report=lambda line: None):
    mesh = sharding.make_mesh(config, devices or jax.devices()[:2])
    rules = sharding.rules(config)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract, shardings = fit.abstract_state(config, mesh, rules, jax.random.key(0))
        return fit.fit(config, mesh, abstract, shardings, limit, report)


@pytest.fixture(scope="module")
def peaks():
    """The compiled peak of each micro-batch count of small_config on 2 devices."""
    return {m: fit_on_cpu(small_config(microbatches=m), None).peak for m in (1, 2, 4, 8)}


def test_choices_keep_each_microbatch_split_over_the_data_devices():
    config = small_config()
    mesh = sharding.make_mesh(config, jax.devices()[:2])
    assert fit.microbatch_choices(config, mesh) == [1, 2, 4, 8]  # 16 rows: 16 would leave one row for 2 devices
    config.mesh.data = 4
    assert fit.microbatch_choices(config, sharding.make_mesh(config, jax.devices()[:4])) == [1, 2, 4]


def test_memory_falls_with_more_microbatches(peaks):
    assert peaks[1] > peaks[2] > peaks[4] > peaks[8]


def test_automatic_choice_is_the_fewest_that_fit(peaks):
    lines = []
    limit = int(peaks[2] / fit.HEADROOM) + 1  # room for 2 micro-batches, not for 1
    steps = fit_on_cpu(small_config(microbatches=0), limit, report=lines.append)
    assert steps.config.microbatches == 2 and steps.config.model.remat is False
    assert steps.peak <= fit.HEADROOM * limit
    assert len(lines) == 1 and "microbatches=1:" in lines[0] and "using microbatches=2" in lines[0]


def test_the_eval_step_is_compiled_only_for_the_count_that_fits(peaks, monkeypatch):
    from andrea_jax import train_step
    compiled_evals, make_eval_step = [], train_step.make_eval_step
    monkeypatch.setattr(train_step, "make_eval_step",
                        lambda config: compiled_evals.append(config.microbatches) or make_eval_step(config))
    lines = []
    steps = fit_on_cpu(small_config(microbatches=0), int(peaks[4] / fit.HEADROOM) + 1, report=lines.append)
    assert steps.config.microbatches == 4 and compiled_evals == [4]
    assert "microbatches=1: the train step needs" in lines[0] and "microbatches=2: " in lines[0]


def test_no_limit_means_one_microbatch():
    assert fit_on_cpu(small_config(microbatches=0), None).config.microbatches == 1


def test_the_automatic_step_equals_the_same_count_set_by_hand(peaks):
    """The fit only picks a number: its compiled step is the step `microbatches=N` compiles."""
    automatic = fit_on_cpu(small_config(microbatches=0), int(peaks[4] / fit.HEADROOM) + 1)
    by_hand = fit_on_cpu(small_config(microbatches=4), None)
    assert automatic.config.microbatches == 4
    # The whole programs, without the source locations (the two were traced from different lines).
    assert without_source_info(automatic.train.as_text()) == without_source_info(by_hand.train.as_text())


def test_a_set_count_that_does_not_fit_is_refused_with_the_fix(peaks):
    with pytest.raises(ConfigError, match=r"does not fit .*set a larger --config.microbatches"):
        fit_on_cpu(small_config(microbatches=1), int(peaks[2] / fit.HEADROOM))


def test_nothing_fits_names_what_to_lower(peaks):
    with pytest.raises(ConfigError, match=r"even with one sequence per device .* remat.*lower seq_len"):
        fit_on_cpu(small_config(microbatches=0), int(peaks[8] / 2))


def test_remat_comes_after_the_last_microbatch_count(monkeypatch):
    """When one sequence per device does not fit, remat is turned on and the search starts again."""
    tried = []

    def fake_compile(config, mesh, abstract, shardings, usable=None):
        tried.append((config.microbatches, config.model.remat))
        remat_saving = 0.4 if config.model.remat else 1.0
        peak = int(1000 * remat_saving / config.microbatches)
        if peak > usable:
            raise fit.OutOfMemory(f"the train step needs {peak} bytes")
        memory = fit.Memory(arguments=0, temporaries=peak, outputs=0, aliased=0)
        return fit.Steps(config, None, None, memory, memory)

    monkeypatch.setattr(fit, "compile_steps", fake_compile)
    steps = fit_on_cpu(small_config(microbatches=0), int(110 / fit.HEADROOM) + 1)  # 1000/8 > 110, 400/4 fits
    assert tried == [(1, False), (2, False), (4, False), (8, False), (1, True), (2, True), (4, True)]
    assert (steps.config.microbatches, steps.config.model.remat) == (4, True)


def test_counts_that_cannot_fit_by_the_first_try_memory_are_not_compiled(monkeypatch):
    """A try's activations shrink at best in proportion to the micro-batch: counts still above the limit
    by that bound are skipped, and the fewest that fit is still the one chosen."""
    compiled, lines = [], []

    def fake_compile(config, mesh, abstract, shardings, usable=None):
        compiled.append(config.microbatches)
        # 100 bytes of arguments, 1000 of activations and 40 of a gradient buffer that does not shrink.
        memory = fit.Memory(arguments=100, temporaries=1000 // config.microbatches + 40, outputs=0, aliased=0)
        if memory.peak > usable:
            raise fit.OutOfMemory(f"the train step needs {memory.peak} bytes", memory)
        return fit.Steps(config, None, None, memory, memory)

    monkeypatch.setattr(fit, "compile_steps", fake_compile)
    steps = fit_on_cpu(small_config(microbatches=0), int(270 / fit.HEADROOM) + 1, report=lines.append)
    # microbatches=1 needs 1140, so 2 and 4 need at least 100 + 1040/2 and 100 + 1040/4 > 270: skipped;
    # 8, at least 230, is compiled and fits (265).
    assert compiled == [1, 8] and steps.config.microbatches == 8
    assert "microbatches=2: at least 0.00 GiB, scaled from microbatches=1" in lines[0]
    assert "microbatches=4: at least " in lines[0] and lines[0].endswith("using microbatches=8")
    compiled.clear()
    # Within 380, 4 (at least 360) is compiled and needs 390; then 8 (at least 100 + 290 × 4/8) fits.
    steps = fit_on_cpu(small_config(microbatches=0), int(380 / fit.HEADROOM) + 1)
    assert compiled == [1, 4, 8] and steps.config.microbatches == 8


def test_a_tpu_compile_that_runs_out_of_memory_says_what_its_temporaries_need():
    refusal = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
               "(17.54G) exceeds available HBM (15.75G).")  # libtpu 0.0.42's words
    assert fit.refused_memory(refusal) == fit.Memory(0, int(17.54 * 2 ** 30), 0, 0)
    assert fit.refused_memory("RESOURCE_EXHAUSTED: out of memory") is None


# libtpu 0.0.42's words for splash's backward over 8192 keys taken whole on a v6e (shortened).
VMEM_REFUSAL = ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\nRan out of memory in memory space vmem while "
                "allocating on stack for %splash_mha_dkv_no_residuals.1 = (f32[2,8192,64]{2,1,0:T(8,128)}) "
                "custom-call(%copy-done.2), custom_call_target=\"tpu_custom_call\". Scoped allocation with size 32.50M "
                "and limit 32.00M exceeded scoped vmem limit by 512.0K. It should not be possible to run out of scoped "
                "vmem - \nSee https://openxla.org/xla/errors/error_1001 for more details.")


def test_a_kernel_out_of_on_chip_memory_is_refused_in_one_line_without_trying_more_microbatches(monkeypatch):
    traced = []

    def refused_step(config, tx, schedule):
        def step(state, batch):
            traced.append(config.microbatches)
            raise RuntimeError(VMEM_REFUSAL)
        return step

    monkeypatch.setattr(fit.train_step, "make_train_step", refused_step)
    with pytest.raises(ConfigError) as refused:
        fit_on_cpu(small_config(microbatches=0), 2 ** 30)
    assert str(refused.value) == (
        "the TPU kernel splash_mha_dkv_no_residuals.1 needs more on-chip memory (VMEM) than the compiler lets a "
        "kernel take (32.50M > 32.00M), which is not the device memory micro-batches save; lower seq_len, or set "
        "--config.model.attention=xla")
    assert traced == [1]  # no further micro-batch count compiled
    assert fit.on_chip_memory_refusal("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
                                      "HLO temporaries (17.54G) exceeds available HBM (15.75G).") is None


def test_a_run_records_its_choice_and_a_resume_keeps_it(tmp_path, monkeypatch):
    """The chosen count lands in config.json; a resume where one micro-batch would fit keeps it, exactly."""
    devices = jax.devices()[:1]
    sized = loop_config(tmp_path, microbatches=2, **{"model.vocab_size": 257})  # the byte tokenizer's size
    limit = int(fit_on_cpu(sized, None, devices).peak / fit.HEADROOM) + 1  # room for 2 micro-batches, not 1
    unbroken, resumed = str(tmp_path / "unbroken"), str(tmp_path / "resumed")
    train_loop.train(loop_config(tmp_path, microbatches=2), unbroken, devices=devices)

    monkeypatch.setattr(fit, "device_memory_limit", lambda: limit)
    train_loop.train(loop_config(tmp_path), resumed, devices=devices)
    saved = lambda: json.load(open(os.path.join(resumed, "config.json")))["config"]["microbatches"]
    assert saved() == 2
    shutil.rmtree(os.path.join(resumed, "checkpoints", "8"))  # as if the run had stopped after step 4
    monkeypatch.setattr(fit, "device_memory_limit", lambda: None)  # alone, 0 would mean 1 here
    train_loop.train(loop_config(tmp_path), resumed, devices=devices)
    assert saved() == 2
    assert losses(resumed) == losses(unbroken)
    assert losses(resumed, "val_loss") == losses(unbroken, "val_loss")
