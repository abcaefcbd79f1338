"""Which windows a step reads: every window of the training split once an epoch, in a keyed order.

The split's token stream is cut into eras of `era_tokens` tokens (one era: the whole split) and each
era into windows of seq_len + 1 tokens at a stride of seq_len (neighbours share their edge token), from
an offset that is 0 in epoch 0 and moves in later epochs, so a small corpus is not cut the same way
every time. An epoch reads era 0's windows in a permuted order, then era 1's, ...: positions
step·B ... step·B + B − 1 of that sequence are the step's batch. Each era's permutation is keyed by
(seed, epoch, era) and evaluated one index at a time, a Feistel network over the next power of four
with cycle-walking, so a step costs a few vector operations on B indices and no table of the era's
windows is ever built. Everything here is a pure function of (seed, step) and the layout: nothing
to checkpoint, and a step needs only the eras its positions fall in.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from andrea_jax.data import DataError

_ROUNDS = 6
_MIX = np.uint64(0x9E3779B97F4A7C15)
_OFFSET, _PERMUTATION = 0, 1  # what a key is for, so that no two uses share one


def _keys(*words: int) -> np.ndarray:
    # SeedSequence is a fixed, documented hash: the same keys on every numpy and machine.
    return np.random.SeedSequence([int(word) for word in words]).generate_state(_ROUNDS, np.uint64)


def _round(half: np.ndarray, key: np.uint64, mask: np.uint64) -> np.ndarray:
    # splitmix64's finaliser over (half, key): every output bit depends on every input bit.
    z = (half + key) * _MIX
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) & mask


def permute(indices: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """Where `indices` (each in [0, n)) go under the keyed permutation of [0, n)."""
    half_bits = max(1, (int(n - 1).bit_length() + 1) // 2)
    mask, shift = np.uint64((1 << half_bits) - 1), np.uint64(half_bits)
    values = np.asarray(indices, np.uint64).copy()
    outside = np.ones(values.shape, bool)
    with np.errstate(over="ignore"):
        while outside.any():  # cycle-walking: a value that lands past n goes round again
            left, right = values[outside] >> shift, values[outside] & mask
            for key in keys:
                left, right = right, left ^ _round(right, key, mask)
            values[outside] = (left << shift) | right
            outside = values >= n
    return values.astype(np.int64)


def epoch_offset(seed: int, epoch: int, seq_len: int) -> int:
    """Where epoch `epoch`'s first window starts in each era: 0 in epoch 0, then a keyed shift."""
    return 0 if epoch == 0 else int(_keys(seed, epoch, _OFFSET)[0] % np.uint64(seq_len))


@dataclasses.dataclass
class Layout:
    """A training split of `total_tokens`, cut into eras of `era_tokens` (0: one era) and windows of seq_len + 1.

    `breaks` are the budgets a run had before it raised them: an era ends at each and the next begins there, so
    the eras (and the windows) of the smaller budget are those of the larger one's epoch 0, unchanged."""

    total_tokens: int
    seq_len: int
    era_tokens: int = 0
    seed: int = 0
    breaks: tuple = ()
    _epoch_starts: list = dataclasses.field(default_factory=lambda: [0], repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.era_tokens or self.era_tokens >= self.total_tokens:
            self.era_tokens = self.total_tokens
        starts, begin = [], 0
        for end in sorted({int(cut) for cut in self.breaks if 0 < cut < self.total_tokens}) + [self.total_tokens]:
            starts += range(begin, end, max(self.era_tokens, 1))
            begin = end
        self._era_edges = np.array(starts + [self.total_tokens], np.int64)  # era k: tokens edges[k] .. edges[k + 1]

    @property
    def num_eras(self) -> int:
        return len(self._era_edges) - 1

    def era_start(self, era: int) -> int:
        """Where era `era` starts in the split's token stream."""
        return int(self._era_edges[era])

    def era_length(self, era: int) -> int:
        return int(self._era_edges[era + 1] - self._era_edges[era])

    def _windows_of_eras(self, offset: int) -> np.ndarray:
        return np.maximum(0, (np.diff(self._era_edges) - 1 - offset) // self.seq_len)

    def windows_in_epoch(self, epoch: int) -> int:
        return int(self._windows_of_eras(epoch_offset(self.seed, epoch, self.seq_len)).sum())

    def _epochs_of(self, positions: np.ndarray) -> np.ndarray:
        starts = self._epoch_starts  # grown as steps reach later epochs: a few entries for real runs
        while starts[-1] <= positions.max():
            starts.append(starts[-1] + self.windows_in_epoch(len(starts) - 1))
        return np.searchsorted(starts, positions, side="right") - 1

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(epoch, era, token offset inside the era) of each window at `positions` of the whole run's order."""
        if self.windows_in_epoch(0) < 1:
            raise DataError(f"the training split has {self.total_tokens} tokens, fewer than seq_len + 1 = "
                            f"{self.seq_len + 1}; add text or lower seq_len")
        positions = np.asarray(positions, np.int64)
        epochs = self._epochs_of(positions)
        eras, offsets = np.empty_like(positions), np.empty_like(positions)
        for epoch in np.unique(epochs):
            rows = np.flatnonzero(epochs == epoch)
            offset = epoch_offset(self.seed, int(epoch), self.seq_len)
            in_epoch = positions[rows] - self._epoch_starts[epoch]
            windows = self._windows_of_eras(offset)
            before = np.concatenate([[0], np.cumsum(windows)])  # the epoch's windows before era k
            era = np.searchsorted(before, in_epoch, side="right") - 1
            for k in np.unique(era):
                at = era == k
                index = in_epoch[at] - before[k]
                window = permute(index, int(windows[k]), _keys(self.seed, int(epoch), _PERMUTATION, int(k)))
                eras[rows[at]] = k
                offsets[rows[at]] = offset + window * self.seq_len
        return epochs, eras, offsets

    def era_sequence_number(self, epoch: np.ndarray, era: np.ndarray) -> np.ndarray:
        """The order in which the run meets its eras, over epochs: era k of epoch e is e·num_eras + k."""
        return np.asarray(epoch) * self.num_eras + np.asarray(era)
