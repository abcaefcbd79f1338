"""The epoch order's cost a step, opening an era, and the era encoder's text rate on 1 and on all cores.

    python bench/bench_eras.py [--megabytes 16] [--runs 5]

Corpus: the standard library's source (offline, on every machine). The BPE tokenizer (8192 merges) is
trained on it once; the encoder (`eras.build_era`) then encodes the same text into an era in a process
whose tokenizer may use 1 core (RAYON_NUM_THREADS=1), then all of them. Prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from andrea_jax.data import batcher, eras, order, token_cache  # noqa: E402

ENCODE = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
os.makedirs(sys.argv[4])
from bench.bench_data import stdlib_texts
from andrea_jax.data import eras, sources, tokenizer as tokenizers
texts = stdlib_texts(float(sys.argv[3]))
tokenizer = tokenizers.load(sys.argv[2])
documents = sources.StreamedDocuments(lambda state=None: iter(texts))
cache = eras.EraCache(sys.argv[4], sys.argv[4] + "/eras.json", 1 << 40, 1 << 40)
rates = []
for run in range(int(sys.argv[5])):
    started = time.perf_counter()
    _, tokens = eras.build_era(cache, run, documents, tokenizer,
                               {"document": 0, "token": 0, "state_position": 0, "state": None}, 0, 1 << 40,
                               log=lambda line: None)
    rates.append(sum(len(t.encode()) for t in texts) / (time.perf_counter() - started))
print(json.dumps(rates))
"""


def step_cost(runs: int) -> list[tuple[str, str, str]]:
    """Median seconds to find and read a 512-window step of the 10B recipe: the order, then the batch."""
    layout = order.Layout(10_000_000_000, 1024, 65536 * 1024 + 1)
    era = np.zeros(65536 * 1024 + 1, np.uint16)

    def epoch_batch(step: int) -> np.ndarray:  # what `eras.Reader.batch` does with its eras open
        _, eras_of_step, offsets = layout.locate(np.arange(step * 512, step * 512 + 512))
        return batcher.read_windows({int(k): era for k in np.unique(eras_of_step)}, eras_of_step, offsets, 1024)

    rows = []
    for name, work in (("order: positions -> windows", lambda step: layout.locate(np.arange(step * 512, step * 512 + 512))),
                       ("epoch batch 512x1025", epoch_batch),
                       ("random_windows 512x1025", lambda step: batcher.random_windows(era, seed=0, step=step,
                                                                                        batch_size=512, seq_len=1024))):
        times = []
        for step in range(runs * 20):
            started = time.perf_counter()
            work(step % 127)
            times.append(time.perf_counter() - started)
        rows.append((name, f"{statistics.median(times) * 1e3:.2f} ms", "a step of the 10B recipe"))
    return rows


def era_open_cost(runs: int, directory: str) -> tuple[str, str, str]:
    """Median seconds for the reader to open a 64M-token era it has not read yet, its CRC-32 checked."""
    tokens = np.random.default_rng(0).integers(0, 8449, 65536 * 1024 + 1, dtype=np.uint16)
    cache = eras.EraCache(directory, os.path.join(directory, "eras.json"), tokens.size, tokens.size)
    tokens_path, manifest_path = cache.paths(0)
    tokens.tofile(tokens_path)
    with open(manifest_path, "w") as f:
        json.dump({"era": 0, "num_tokens": int(tokens.size), "crc32": token_cache.crc32(tokens)}, f)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        assert cache.verified(0) is not None
        times.append(time.perf_counter() - started)
    return ("open an era, CRC-32 checked (64M tokens)", f"{statistics.median(times) * 1e3:.1f} ms",
            "once an era: every 128 steps of the 10B recipe (from the page cache)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=float, default=16.0)
    parser.add_argument("--runs", type=int, default=5)
    arguments = parser.parse_args()
    from bench.bench_data import stdlib_texts
    from andrea_jax.data import tokenizer as tokenizers

    rows = step_cost(arguments.runs)
    with tempfile.TemporaryDirectory() as directory:
        rows.append(era_open_cost(arguments.runs, directory))
        tokenizer_path = os.path.join(directory, "tokenizer.json")
        tokenizers.train_bpe(stdlib_texts(arguments.megabytes), tokenizers.BPE_MERGES).save(tokenizer_path)
        cores = os.cpu_count() or 1
        for threads in sorted({1, cores}):
            out = subprocess.run([sys.executable, "-c", ENCODE, ROOT, tokenizer_path, str(arguments.megabytes),
                                  os.path.join(directory, f"eras{threads}"), str(arguments.runs)],
                                 env=dict(os.environ, RAYON_NUM_THREADS=str(threads)), check=True,
                                 capture_output=True, text=True).stdout
            rates = json.loads(out)
            rows.append((f"era encoder (bpe), {threads} core{'s' * (threads > 1)}",
                         f"{statistics.median(rates) / 1e6:.2f} MB/s",
                         f"{arguments.megabytes:g} MB of text, median of {len(rates)}"))
    width = max(len(name) for name, _, _ in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>12}  {note}")


if __name__ == "__main__":
    main()
