"""data.order="epochs": every window once an epoch, in a keyed order that is a pure function of (seed, step)."""

import json

import jax
import numpy as np
import pytest

from andrea_jax.data import DataError, batcher, eras, order, token_cache
from tests.test_data_batcher import batch_sharding

# Token i has value i % 65536, so a window's position in the stream is visible.
TOKENS = np.arange(60_000, dtype=np.int64).astype(np.uint16)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097, 65536])
def test_the_keyed_permutation_is_a_bijection_evaluated_an_index_at_a_time(n):
    keys = order._keys(0, 0, order._PERMUTATION, 0)
    whole = order.permute(np.arange(n), n, keys)
    assert sorted(whole.tolist()) == list(range(n))
    one_by_one = [int(order.permute(np.array([i]), n, keys)[0]) for i in range(0, n, max(1, n // 50))]
    assert one_by_one == whole[::max(1, n // 50)].tolist()
    if n >= 64:  # another key, another order; not the identity
        assert not np.array_equal(whole, order.permute(np.arange(n), n, order._keys(1, 0, order._PERMUTATION, 0)))
        assert not np.array_equal(whole, np.arange(n))


def windows_of_epoch(layout, epoch):
    start = sum(layout.windows_in_epoch(e) for e in range(epoch))
    epochs, eras, offsets = layout.locate(np.arange(start, start + layout.windows_in_epoch(epoch)))
    assert set(epochs.tolist()) == {epoch}
    return list(zip(eras.tolist(), offsets.tolist()))


@pytest.mark.parametrize("era_tokens", [0, 40 * 32 + 1, 1000])
def test_an_epoch_reads_every_window_exactly_once(era_tokens):
    layout = order.Layout(total_tokens=10_000, seq_len=32, era_tokens=era_tokens, seed=3)
    first = windows_of_epoch(layout, 0)
    length = layout.era_tokens
    # Epoch 0 cuts each era at 0, seq_len, 2·seq_len, ...: all of them, each once.
    expected = {(era, start) for era in range(layout.num_eras)
                for start in range(0, min(length, 10_000 - era * length) - 32, 32)}
    assert len(first) == len(set(first)) and set(first) == expected
    # Eras are read in turn: every window of era k before any of era k + 1.
    assert [era for era, _ in first] == sorted(era for era, _ in first)
    second = windows_of_epoch(layout, 1)
    assert len(second) == len(set(second)) == layout.windows_in_epoch(1)
    shift = {start % 32 for _, start in second}
    assert len(shift) == 1 and shift != {0}  # the cut moved, the same for every window of the epoch
    assert [start for _, start in second[:20]] != sorted(start for _, start in second[:20])  # shuffled


def test_the_order_depends_on_the_seed_and_nothing_else():
    a, b = (order.Layout(total_tokens=30_000, seq_len=64, seed=seed) for seed in (0, 1))
    again = order.Layout(total_tokens=30_000, seq_len=64, seed=0)
    positions = np.arange(100, 164)
    assert np.array_equal(a.locate(positions)[2], again.locate(positions)[2])
    assert not np.array_equal(a.locate(positions)[2], b.locate(positions)[2])
    # A layout that had to grow its epoch table first gives the same answer.
    again.locate(np.arange(5000, 5010))
    assert np.array_equal(a.locate(positions)[2], again.locate(positions)[2])


def test_a_raised_budget_keeps_the_smaller_one_as_the_start_of_its_first_epoch():
    small = order.Layout(total_tokens=3209, seq_len=32, era_tokens=385, seed=1)  # 8 eras of 385 and one of 129
    raised = order.Layout(total_tokens=6200, seq_len=32, era_tokens=385, seed=1, breaks=(3209,))
    assert [raised.era_length(era) for era in range(raised.num_eras)] == [385] * 8 + [129] + [385] * 7 + [296]
    assert raised.era_start(9) == 3209 and small.windows_in_epoch(0) == 100 and raised.windows_in_epoch(0) == 193
    before = np.arange(small.windows_in_epoch(0))
    for got, want in zip(raised.locate(before), small.locate(before)):
        np.testing.assert_array_equal(got, want)
    _, eras_of, offsets = raised.locate(np.arange(100, 193))  # the rest of epoch 0: the new eras, each window once
    assert eras_of.min() == 9 and len(set(zip(eras_of.tolist(), offsets.tolist()))) == 93


def one_era_reader(directory, tokens, seq_len, seed, data_order="epochs"):
    """The reader of a finite training split (one era) that holds `tokens`."""
    cache = eras.EraCache(str(directory), str(directory / "eras.json"), 0, len(tokens))
    tokens.astype(np.uint16).tofile(cache.paths(0)[0])
    with open(cache.paths(0)[1], "w") as f:
        json.dump({"num_tokens": len(tokens), "crc32": token_cache.crc32(tokens.astype(np.uint16))}, f)
    return eras.Reader(cache, seed, seq_len, keep_eras=4, delete_passed=True, order=data_order)


def test_epoch_batches_are_windows_of_the_stream_and_split_over_processes(tmp_path):
    reader = one_era_reader(tmp_path, TOKENS, seq_len=16, seed=5)
    whole = reader.batch(step=11, batch_size=8)
    assert whole.shape == (8, 17) and whole.dtype == np.int32
    for row in whole:
        assert row[0] % 16 == 0  # epoch 0: windows at multiples of seq_len
        np.testing.assert_array_equal(row, TOKENS[row[0]:row[0] + 17])
    halves = [reader.batch(step=11, batch_size=8, process_index=i, process_count=2) for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), whole)
    # On 8 devices the global array is the same batch.
    size = jax.device_count()
    local = reader.batch(step=3, batch_size=size)
    on_devices = batcher.to_global(local, batch_sharding())
    assert len(on_devices.sharding.device_set) == size
    np.testing.assert_array_equal(np.asarray(on_devices), local)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.bin", "train.json"]  # one era: kept, nothing recorded


def test_random_batches_are_windows_drawn_with_replacement_and_split_over_processes(tmp_path):
    reader = one_era_reader(tmp_path, TOKENS, seq_len=16, seed=5, data_order="random")
    whole = reader.batch(step=11, batch_size=8)
    starts = batcher.random_starts(5, 11, len(TOKENS) - 16, 8)
    np.testing.assert_array_equal(whole, np.stack([TOKENS[s:s + 17] for s in starts]).astype(np.int32))
    halves = [reader.batch(step=11, batch_size=8, process_index=i, process_count=2) for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), whole)
    # A split of one era that went missing has no encoder to wait for: one line.
    (tmp_path / "train.json").unlink()
    fresh = eras.Reader(reader.cache, 5, 16, keep_eras=0, delete_passed=False, order="random")
    with pytest.raises(DataError, match=r"^the training split's .*train\.bin is gone; run the same command to resume"):
        fresh.batch(step=0, batch_size=8)


def test_the_steps_of_a_run_cross_epochs_without_repeating_within_one(tmp_path):
    reader = one_era_reader(tmp_path, TOKENS[:3_000], seq_len=32, seed=0)  # 93 windows an epoch
    layout = reader.layout()
    batch_size, steps = 8, 40  # 320 windows: three epochs and a part
    starts = np.concatenate([reader.batch(step=s, batch_size=batch_size)[:, 0]
                             for s in range(steps)]).astype(np.int64)
    epochs = layout.locate(np.arange(steps * batch_size))[0]
    for epoch in range(3):
        within = starts[epochs == epoch]
        assert len(within) == len(set(within.tolist())) == layout.windows_in_epoch(epoch)
