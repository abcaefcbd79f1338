"""Batches of `seq_len + 1` token windows, as pure functions of (seed, step); `order.py` says which.

The batch of a step depends on nothing else, so a run resumed at step k sees
the batches an uninterrupted run would have seen, with no replay. Each process
builds only its rows of the global batch; `to_global` assembles the `jax.Array`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
from typing import Callable, Iterator

import jax
import numpy as np

from andrea_jax.data import DataError


def local_rows(batch_size: int, process_index: int, process_count: int) -> slice:
    """The rows of a global batch that process `process_index` (jax.process_index()) builds."""
    if batch_size % process_count:
        raise DataError(f"batch_size={batch_size} does not split over {process_count} processes; "
                        f"make batch_size a multiple of {process_count}")
    local = batch_size // process_count
    return slice(process_index * local, (process_index + 1) * local)


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    # One contiguous slice a row: far faster on a memmap than a 2-D fancy index.
    batch_BxLp1 = np.empty((len(starts), seq_len + 1), np.int32)
    for row, start in enumerate(starts):
        batch_BxLp1[row] = tokens[start:start + seq_len + 1]
    return batch_BxLp1


def read_windows(tokens_of_era, eras: np.ndarray, offsets: np.ndarray, seq_len: int) -> np.ndarray:
    """Rows of seq_len + 1 tokens at `offsets` of the eras `tokens_of_era[era]`: int32 [len(eras), seq_len + 1]."""
    batch_BxLp1 = np.empty((len(eras), seq_len + 1), np.int32)
    for era in np.unique(eras):
        rows = np.flatnonzero(eras == era)
        batch_BxLp1[rows] = _windows(tokens_of_era[int(era)], offsets[rows], seq_len)
    return batch_BxLp1


def random_starts(seed: int, step: int, num_windows: int, batch_size: int) -> np.ndarray:
    """data.order="random": the first tokens of the step's whole batch, drawn with replacement."""
    return np.random.default_rng([int(seed), int(step)]).integers(0, num_windows, size=batch_size)


def random_windows(tokens: np.ndarray, *, seed: int, step: int, batch_size: int, seq_len: int,
                   rows: slice = slice(None)) -> np.ndarray:
    """data.order="random" (runs started before data.order): `rows` of the step's batch, windows at random
    offsets drawn with replacement: int32 [len(rows), seq_len + 1]."""
    num_windows = len(tokens) - seq_len
    if num_windows < 1:
        raise DataError(f"the training split has {len(tokens)} tokens, fewer than seq_len + 1 = "
                        f"{seq_len + 1}; lower seq_len or add text")
    # The whole global batch's offsets are drawn (cheap) and the rows kept, so the rows of all
    # processes concatenate to the single-process batch.
    return _windows(tokens, random_starts(seed, step, num_windows, batch_size)[rows], seq_len)


def num_val_windows(num_tokens: int, seq_len: int) -> int:
    """Consecutive, non-overlapping windows of seq_len + 1 tokens (sharing their edge tokens) in the split."""
    return max(0, (num_tokens - 1) // seq_len)


def num_val_batches(num_tokens: int, batch_size: int, seq_len: int) -> int:
    return num_val_windows(num_tokens, seq_len) // batch_size


def val_batch(tokens: np.ndarray, *, index: int, batch_size: int, seq_len: int,
              process_index: int = 0, process_count: int = 1) -> np.ndarray:
    """Validation batch `index`: windows index*batch_size ... in order, this process's rows.

    In the split's last, partial batch the rows past its last window repeat window 0 (padding to drop)."""
    available = num_val_windows(len(tokens), seq_len)
    if not 0 <= index * batch_size < available:
        raise DataError(f"validation batch {index} does not exist: the split has {available} windows "
                        f"of {seq_len} tokens; ask for fewer eval batches")
    rows = local_rows(batch_size, process_index, process_count)
    windows = index * batch_size + np.arange(batch_size)
    starts = np.where(windows < available, windows, 0) * seq_len
    return _windows(tokens, starts[rows], seq_len)


def to_global(local_batch: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """The global batch from every process's rows (one process: the batch itself)."""
    return jax.make_array_from_process_local_data(sharding, local_batch)


def prefetch(make_batch: Callable[[int], np.ndarray], start_step: int, sharding: jax.sharding.Sharding,
             depth: int = 2, end_step: int | None = None) -> Iterator[tuple[int, jax.Array]]:
    """Yields (step, global batch) from start_step until end_step (None: on), each built and put on the
    devices `depth` steps ahead by a background thread, so the accelerator does not wait for the host.
    An error in `make_batch` is raised by `next`; closing the generator stops the thread and drops the
    batches it had ready."""
    build = lambda step: (step, to_global(make_batch(step), sharding))
    steps = itertools.count(start_step) if end_step is None else iter(range(start_step, end_step))
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batch-prefetch")
    ahead = collections.deque(pool.submit(build, step) for step in itertools.islice(steps, max(1, depth)))
    try:
        while ahead:
            ahead.extend(pool.submit(build, step) for step in itertools.islice(steps, 1))
            yield ahead.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
