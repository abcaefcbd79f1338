"""What HellaSwag's validation set costs a run: the whole scoring path on synthetic rows of the real shape.

    python bench/bench_hellaswag.py [--config configs/tiny.py] [--examples 10042] [--rounds 2]

The rows are random tokens with the real set's lengths (contexts about 100 BPE
tokens, endings about 30: normal draws, clipped), four an example, scored by
`hellaswag.score` exactly as eval.py and the training loop score them: packed into
the validation step's [batch_size, seq_len + 1] batches on the config's mesh,
the per-token losses summed over the endings. The content does not change the
cost: every row is padded to the window. Tokenizing the text is not included.
Params are the config's initialisation. Prints one line a round (the first
compiles) and the forward time a batch.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from andrea_jax import attention, model, precision, sharding  # noqa: E402
from andrea_jax.tools import hellaswag
from andrea_jax.config import validate  # noqa: E402

CONTEXT_TOKENS, ENDING_TOKENS = (100, 30), (30, 10)  # mean, standard deviation


def synthetic_rows(examples: int, vocab_size: int, seed: int = 0) -> hellaswag.Encoded:
    """Random token rows with HellaSwag's lengths: one context, four endings an example."""
    rng = np.random.default_rng(seed)
    contexts = np.clip(rng.normal(*CONTEXT_TOKENS, examples), 10, 300).astype(np.int64)
    endings = np.clip(rng.normal(*ENDING_TOKENS, (examples, hellaswag.ENDINGS)), 3, 100).astype(np.int64)
    ids = [rng.integers(0, vocab_size, length).astype(np.int32) for length in (contexts[:, None] + endings).flat]
    return hellaswag.Encoded(ids, endings.reshape(-1), rng.integers(0, hellaswag.ENDINGS, examples),
                             source_examples=examples)


def load_config(path: str):
    spec = importlib.util.spec_from_file_location("bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.model.dtype = precision.resolve_dtype_name(config.model.dtype, jax.devices()[0])
    config.model.attention = attention.for_device(config.model, jax.devices()[0])
    config.microbatches = max(1, config.microbatches)
    validate(config)
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--examples", type=int, default=hellaswag.VALIDATION_EXAMPLES)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    config = load_config(args.config)
    mesh = sharding.make_mesh(config)
    rules = sharding.rules(config)
    rows = synthetic_rows(args.examples, int(config.model.vocab_size))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        init = partial(model.init_params, config.model)
        boxed = jax.eval_shape(init, jax.random.key(0))
        params = jax.jit(lambda key: sharding.unbox(init(key)),
                         out_shardings=sharding.logical_shardings(boxed, mesh, rules))(jax.random.key(config.seed))
        step = hellaswag.make_step(config, mesh)
        batches = -(-len(rows.ids) // config.batch_size)
        lengths = np.array([len(ids) for ids in rows.ids])
        print(f"{args.config}: {args.examples:,} examples = {len(rows.ids):,} rows in {batches:,} batches of "
              f"[{config.batch_size}, {config.seq_len + 1}], compute {config.model.dtype}, attention "
              f"{config.model.attention}, mesh {sharding.describe(mesh)}; {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPUs; row lengths: mean {lengths.mean():.0f} tokens, "
              f"{100 * np.mean(lengths > config.seq_len + 1):.0f}% cut to the window", flush=True)
        times = []
        for index in range(args.rounds):
            start = time.perf_counter()
            result = hellaswag.score(step, params, rows, config, sharding.batch_sharding(mesh))
            times.append(time.perf_counter() - start)
            print(f"round {index + 1}{' (compiles)' if index == 0 else ''}: {times[-1]:.1f} s, "
                  f"acc_norm {result['acc_norm']:.4f} ± {result['acc_norm_stderr']:.4f}", flush=True)
    steady = statistics.median(times[1:]) if len(times) > 1 else times[0]
    print(f"whole set: {steady:.1f} s ({1e3 * steady / batches:.1f} ms a batch of {config.batch_size} rows)")


if __name__ == "__main__":
    main()
