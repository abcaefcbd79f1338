"""A run's config with every "auto" decided for the devices it runs on: the one place they are decided.

Training, evaluation, the export and the compile check all call `for_devices`; what it returns is
what ran, and a run's `config.json` records it. (The micro-batch count, `microbatches=0`, needs the
compiled step and is decided by `fit.fit`; `model.vocab_size=0` needs the tokenizer.)
"""

from __future__ import annotations

import ml_collections

from andrea_jax import attention, precision


def for_devices(config: ml_collections.ConfigDict, device, saved: ml_collections.ConfigDict | None = None,
                evaluating: bool = False) -> ml_collections.ConfigDict:
    """`config` with the compute dtype, attention and Muon's iteration dtype decided for `device` (the mesh's
    first).

    `saved` is the config a resumed run started with: it keeps computing as it did (its dtypes
    and micro-batches), so that its losses stay exact. `evaluating` a saved run lets a kernel
    this machine lacks give way to this machine's choice (the kernel belongs to the machine that
    trained, not to the model); training stops with one line instead.
    """
    config = ml_collections.ConfigDict(config.to_dict())
    if saved is not None:
        if config.model.dtype == "auto":
            config.model.dtype = saved.model.dtype
        if config.microbatches == 0 and saved.microbatches:
            config.microbatches, config.model.remat = saved.microbatches, saved.model.remat
    config.model.dtype = precision.resolve_dtype_name(config.model.dtype, device)
    if saved is not None and config.optimizer.muon_ns_dtype == "auto":
        config.optimizer.muon_ns_dtype = saved.optimizer.muon_ns_dtype
    if config.optimizer.muon_ns_dtype == "auto":  # bfloat16 where an accelerator's products run in it (not a T4)
        accelerated = device.platform != "cpu" and config.model.dtype == "bfloat16"
        config.optimizer.muon_ns_dtype = "bfloat16" if accelerated else "float32"
    choose = attention.for_saved_run if evaluating else attention.for_device
    config.model.attention = choose(config.model, device)
    return config
