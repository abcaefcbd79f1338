import contextlib
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from andrea_jax.data import DataError, batcher

# Token i has value i % 65536, so a window's position in the stream is visible.
TOKENS = np.arange(100_000, dtype=np.int64).astype(np.uint16)


def train_batch(tokens, *, batch_size, process_index=0, process_count=1, **kwargs):
    """data.order="random": this process's rows of the step's batch."""
    return batcher.random_windows(tokens, batch_size=batch_size,
                                  rows=batcher.local_rows(batch_size, process_index, process_count), **kwargs)


def batch_sharding():
    mesh = jax.make_mesh((jax.device_count(),), ("data",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    return NamedSharding(mesh, PartitionSpec("data"))


def test_train_batch_rows_are_contiguous_windows():
    batch = train_batch(TOKENS, seed=3, step=7, batch_size=16, seq_len=64)
    assert batch.shape == (16, 65) and batch.dtype == np.int32
    for row in batch:
        np.testing.assert_array_equal(row, TOKENS[row[0]:row[0] + 65])
    assert len({int(row[0]) for row in batch}) > 1


def test_batch_is_a_pure_function_of_seed_and_step():
    def batch(seed, step):
        return train_batch(TOKENS, seed=seed, step=step, batch_size=8, seq_len=32)

    uninterrupted = [batch(0, step) for step in range(20)]
    resumed_at_13 = [batch(0, step) for step in range(13, 20)]
    for step, resumed in zip(range(13, 20), resumed_at_13):
        np.testing.assert_array_equal(resumed, uninterrupted[step])
    assert not np.array_equal(uninterrupted[0], uninterrupted[1])  # no replay
    assert not np.array_equal(batch(1, 0), uninterrupted[0])


def test_two_processes_build_the_halves_of_the_single_process_batch():
    kwargs = dict(seed=5, step=11, batch_size=8, seq_len=16)
    whole = train_batch(TOKENS, **kwargs)
    halves = [train_batch(TOKENS, process_index=i, process_count=2, **kwargs)
              for i in range(2)]
    assert halves[0].shape == (4, 17)
    np.testing.assert_array_equal(np.concatenate(halves), whole)
    val_whole = batcher.val_batch(TOKENS, index=2, batch_size=8, seq_len=16)
    val_halves = [batcher.val_batch(TOKENS, index=2, batch_size=8, seq_len=16, process_index=i,
                                    process_count=2) for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(val_halves), val_whole)


def test_validation_batches_are_sequential_and_fixed():
    seq_len, batch_size = 100, 4
    count = batcher.num_val_batches(len(TOKENS), batch_size, seq_len)
    assert count == (100_000 - 1) // 100 // 4 == 249
    first = batcher.val_batch(TOKENS, index=0, batch_size=batch_size, seq_len=seq_len)
    np.testing.assert_array_equal(first[:, 0], [0, 100, 200, 300])
    last = batcher.val_batch(TOKENS, index=count - 1, batch_size=batch_size, seq_len=seq_len)
    assert int(last[-1, -1]) == (count * batch_size * seq_len) % 65536
    partial = batcher.val_batch(TOKENS, index=count, batch_size=batch_size, seq_len=seq_len)
    np.testing.assert_array_equal(partial[:, 0], [99_600 % 65536, 99_700 % 65536, 99_800 % 65536, 0])  # 999 windows
    with pytest.raises(DataError, match="validation batch 250 does not exist"):
        batcher.val_batch(TOKENS, index=count + 1, batch_size=batch_size, seq_len=seq_len)
    assert batcher.num_val_batches(400, 4, 100) == 0


def test_bad_shapes_name_the_fix():
    with pytest.raises(DataError, match="fewer than seq_len \\+ 1 = 65"):
        train_batch(TOKENS[:64], seed=0, step=0, batch_size=2, seq_len=64)
    with pytest.raises(DataError, match="make batch_size a multiple of 3"):
        train_batch(TOKENS, seed=0, step=0, batch_size=8, seq_len=8, process_count=3)


def test_short_stream_uses_its_only_window():
    batch = train_batch(TOKENS[:9], seed=0, step=0, batch_size=3, seq_len=8)
    np.testing.assert_array_equal(batch, np.tile(np.arange(9), (3, 1)))


def test_to_global_places_the_batch_on_all_devices():
    local = train_batch(TOKENS, seed=0, step=0, batch_size=2 * jax.device_count(), seq_len=8)
    sharding = batch_sharding()
    array = batcher.to_global(local, sharding)
    assert isinstance(array, jax.Array) and array.sharding == sharding
    np.testing.assert_array_equal(np.asarray(array), local)


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("batch-prefetch") and t.is_alive()]


def test_prefetcher_yields_the_batches_of_consecutive_steps():
    sharding = batch_sharding()
    size = 2 * jax.device_count()

    def make_batch(step):
        return train_batch(TOKENS, seed=1, step=step, batch_size=size, seq_len=16)

    with contextlib.closing(batcher.prefetch(make_batch, start_step=40, sharding=sharding)) as batches:
        for expected_step in range(40, 46):
            step, array = next(batches)
            assert step == expected_step
            np.testing.assert_array_equal(np.asarray(array), make_batch(step))


def test_prefetcher_raises_the_error_of_make_batch_and_closes():
    def make_batch(step):
        if step == 2:
            raise DataError("bad step")
        return np.zeros((jax.device_count(), 4), np.int32)

    batches = batcher.prefetch(make_batch, 0, batch_sharding(), depth=1)
    assert next(batches)[0] == 0
    assert next(batches)[0] == 1
    with pytest.raises(DataError, match="bad step"):
        next(batches)
    assert not prefetch_threads()  # the error ended the generator, and its thread with it


def test_prefetcher_close_stops_a_full_queue():
    started = []

    def make_batch(step):
        started.append(step)
        time.sleep(0.3 if step else 0)
        return np.zeros((jax.device_count(), 4), np.int32)

    batches = batcher.prefetch(make_batch, 0, batch_sharding(), depth=2)
    assert next(batches)[0] == 0
    time.sleep(0.1)  # step 1 is being built, step 2 waits its turn
    batches.close()
    assert started == [0, 1] and not prefetch_threads()  # step 2 was dropped, not built
    with pytest.raises(StopIteration):
        next(batches)


def test_batcher_delivers_far_more_than_a_million_tokens_per_second():
    tokens = np.random.default_rng(0).integers(0, 8449, 5_000_000).astype(np.uint16)
    train_batch(tokens, seed=0, step=0, batch_size=32, seq_len=1024)
    started = time.perf_counter()
    for step in range(20):
        train_batch(tokens, seed=0, step=step, batch_size=32, seq_len=1024)
    tokens_per_second = 20 * 32 * 1024 / (time.perf_counter() - started)
    assert tokens_per_second > 10e6
