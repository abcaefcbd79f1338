"""BPE training and encoding speed, and bytes per token, on this CPU for English prose and Python source.

    python bench/bench_tokenizer.py [--runs 5] [--threads 0]

The 8449-entry BPE is trained on every other document of a corpus (a run trains it on a
sample) and `encode_batch` encodes the whole corpus; bytes per token are those of the
documents it was not trained on. Prose is the standard library's docstrings (English,
offline on every machine); source is the standard library's code, as in bench_data.py.
Last, how much Parquet compresses the prose and how fast `datasets` streams it back.
Rates are per second of wall clock and per CPU-second of the process: the second holds
on a machine shared with other work, and times the cores a machine has gives its rate.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from andrea_jax.data import local_files  # noqa: E402


def docstrings(min_chars: int = 200) -> list[str]:
    """The standard library's module, class and function docstrings of at least min_chars."""
    _, files = local_files.list_stdlib_files()
    texts = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            try:
                tree = ast.parse(f.read())
            except SyntaxError:
                continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) >= min_chars:
                    texts.append(text)
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="encodings of each corpus (the median is shown)")
    parser.add_argument("--threads", type=int, default=0, help="encoding threads (0 = the tokenizer's default)")
    args = parser.parse_args()
    if args.threads:
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # read when the first batch is encoded
    from andrea_jax.data import tokenizer as tokenizers
    from bench_data import stdlib_texts

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name, texts in (("prose (docstrings)", docstrings()), ("Python source", stdlib_texts(4.0))):
        started = time.perf_counter()
        bpe = tokenizers.train_bpe(texts[0::2])
        trained_in = time.perf_counter() - started
        megabytes = sum(len(t.encode()) for t in texts) / 1e6
        wall, cpu = [], []
        for _ in range(args.runs):
            started, started_cpu = time.perf_counter(), time.process_time()
            arrays = bpe.encode_arrays(texts)
            wall.append(time.perf_counter() - started)
            cpu.append(time.process_time() - started_cpu)
        held_out = texts[1::2]
        bytes_per_token = (sum(len(t.encode()) for t in held_out)
                           / sum(a.size for a in bpe.encode_arrays(held_out)))
        tokens = sum(a.size for a in arrays)
        trained_megabytes = sum(len(t.encode()) for t in texts[0::2]) / 1e6
        print(f"{name}: {megabytes:.2f} MB, {len(texts)} documents; BPE (vocab {bpe.vocab_size}) trained on "
              f"{trained_megabytes:.2f} MB at {trained_megabytes / trained_in:.2f} MB/s; encode_batch "
              f"{megabytes / statistics.median(wall):.2f} MB/s wall (range "
              f"{megabytes / max(wall):.2f}-{megabytes / min(wall):.2f}), "
              f"{megabytes / statistics.median(cpu):.2f} MB per CPU-second, "
              f"{tokens / statistics.median(wall) / 1e6:.2f} Mtok/s wall; "
              f"{bytes_per_token:.2f} bytes/token on the documents it was not trained on")
    parquet(docstrings())


def parquet(texts: list[str], copies: int = 20) -> None:
    """How much Parquet compresses the prose, and how fast `datasets` streams it back."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    with tempfile.TemporaryDirectory() as scratch:
        for codec in ("snappy", "zstd"):
            path = os.path.join(scratch, f"{codec}.parquet")
            pq.write_table(pa.table({"text": texts}), path, compression=codec)
            print(f"Parquet ({codec}): {megabytes / (os.path.getsize(path) / 1e6):.2f}x smaller than the prose")
        os.makedirs(os.path.join(scratch, "stream"))
        pq.write_table(pa.table({"text": texts * copies}), os.path.join(scratch, "stream", "train.parquet"))
        stream = datasets.load_dataset(os.path.join(scratch, "stream"), streaming=True)["train"]
        started = time.perf_counter()
        streamed = sum(len(record["text"].encode()) for record in stream.select_columns(["text"]))
        print(f"datasets streaming {streamed / 1e6:.1f} MB of it back: "
              f"{streamed / 1e6 / (time.perf_counter() - started):.1f} MB/s")


if __name__ == "__main__":
    main()
