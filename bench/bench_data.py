"""Data pipeline speed on this machine: tokenizer, token cache, batcher.

    python bench/bench_data.py [--megabytes 4] [--runs 5]

Corpus: the standard library's source (the offline `stdlib` source), so the
figures are comparable across machines with no download. Prints one table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from andrea_jax.data import batcher, local_files, sources, token_cache  # noqa: E402
from andrea_jax.data import tokenizer as tokenizers  # noqa: E402


def stdlib_texts(megabytes: float) -> list[str]:
    """About `megabytes` of standard-library source, files spread over the tree."""
    _, files = local_files.list_stdlib_files()
    texts, size, limit = [], 0, megabytes * 1e6
    for path in files[::2] + files[1::2]:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
        size += len(texts[-1].encode())
        if size >= limit:
            break
    return texts


def timed(function, *args):
    started = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=4.0, help="text for the tokenizer runs")
    parser.add_argument("--runs", type=int, default=5, help="batcher runs (the median is shown)")
    args = parser.parse_args()
    rows = []

    texts = stdlib_texts(args.megabytes)
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    bpe, seconds = timed(tokenizers.train_bpe, texts)
    rows.append(("BPE training (8192 merges)", f"{seconds:.2f} s",
                 f"{megabytes:.1f} MB, {megabytes / seconds:.2f} MB/s, vocab {bpe.vocab_size}"))
    for tokenizer in (bpe, tokenizers.ByteTokenizer()):
        arrays, seconds = timed(tokenizer.encode_arrays, texts)
        num_tokens = sum(a.size for a in arrays)
        rows.append((f"{tokenizer.kind} encode_batch", f"{megabytes / seconds:.2f} MB/s",
                     f"{num_tokens / seconds / 1e6:.2f} Mtok/s, "
                     f"{megabytes * 1e6 / num_tokens:.2f} bytes/token"))

    with tempfile.TemporaryDirectory() as scratch:
        documents = sources.ListDocuments(texts)
        split, seconds = timed(token_cache.load_or_build, scratch, "train", documents, bpe, "train")
        rows.append(("token cache build (bpe)", f"{seconds:.2f} s",
                     f"{split.num_bytes / seconds / 1e6:.2f} MB/s, "
                     f"{split.num_tokens / seconds / 1e6:.2f} Mtok/s, {split.num_tokens:,} tokens"))

        # The batcher on a 100M-token memmap, as a real cache is read.
        path = os.path.join(scratch, "big.bin")
        np.random.default_rng(0).integers(0, 8449, 100_000_000, dtype=np.uint16).tofile(path)
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        batch_size, seq_len, steps = 32, 1024, 100
        rates = []
        for run in range(args.runs):
            started = time.perf_counter()
            for step in range(steps):
                batcher.random_windows(tokens, seed=run, step=step, batch_size=batch_size,
                                       seq_len=seq_len)
            rates.append(steps * batch_size * (seq_len + 1) / (time.perf_counter() - started))
        rows.append(("random_windows 32x1025 (memmap)", f"{statistics.median(rates) / 1e6:.1f} Mtok/s",
                     f"median of {args.runs} x {steps} batches, "
                     f"range {min(rates) / 1e6:.1f}-{max(rates) / 1e6:.1f}"))

        mesh = jax.make_mesh((jax.device_count(),), ("data",),
                             axis_types=(jax.sharding.AxisType.Auto,))
        sharding = NamedSharding(mesh, PartitionSpec("data"))
        make_batch = lambda step: batcher.random_windows(  # noqa: E731
            tokens, seed=0, step=step, batch_size=batch_size, seq_len=seq_len)
        with contextlib.closing(batcher.prefetch(make_batch, 0, sharding)) as prefetched:
            next(prefetched)
            started = time.perf_counter()
            for _ in range(steps):
                _, array = next(prefetched)
            array.block_until_ready()
            rate = steps * batch_size * (seq_len + 1) / (time.perf_counter() - started)
        rows.append(("prefetch (device_put)", f"{rate / 1e6:.1f} Mtok/s",
                     f"{steps} batches onto {jax.device_count()} {jax.devices()[0].platform} device(s)"))
        del tokens

    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'result':>14}  detail")
    for name, result, detail in rows:
        print(f"{name:<{width}}  {result:>14}  {detail}")


if __name__ == "__main__":
    main()
