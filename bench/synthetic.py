"""Synthetic token batches for the step benchmarks (numpy only: the PyTorch worker imports it too)."""

from __future__ import annotations

import ml_collections
import numpy as np


def random_batches(config: ml_collections.ConfigDict, count: int, seed: int = 0) -> list[np.ndarray]:
    """`count` int32 batches [batch_size, seq_len + 1] of uniform token ids."""
    rng = np.random.default_rng(seed)
    shape = (config.batch_size, config.seq_len + 1)
    return [rng.integers(0, config.model.vocab_size, size=shape, dtype=np.int32) for _ in range(count)]
