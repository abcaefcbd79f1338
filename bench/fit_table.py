"""What ANDREA-120M as typed compiles to on each accelerator, from this machine: one table row each.

    python bench/fit_table.py v5e-1 v6e-1 v5e-16 v4-32                 # needs libtpu (jax[tpu])
    JAX_PLATFORMS=cpu python bench/fit_table.py t4 l4 a100_40gb a100_80gb h100
                                                   # needs requirements-gpu-compile.txt

Each target gets the automatic micro-batch choice a run there would make
(`andrea_jax/fit.py`); the row gives the compute dtype, micro-batches, remat, one
device's peak against its limit, the attention it runs, the HBM bytes a step moves
(counted from the optimized HLO), the roofline bound on MFU they give, and the step estimated
one kernel at a time (`andrea_jax/compile/kernel_time.py`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from andrea_jax.compile import check, targets  # noqa: E402
from andrea_jax.config import ConfigError  # noqa: E402
from configs import andrea120m  # noqa: E402

GIB = 2 ** 30


def row(name: str) -> str:
    start = time.perf_counter()
    target = targets.named(name)
    try:
        steps = check.compiled_for(andrea120m.get_config(), target, report=lambda line: None)
    except ConfigError as error:
        return f"| {name} | {len(target.devices)} | | | | | does not fit: {error} | | | |"
    cost = check.step_cost(steps, target)
    roofline = f"{cost.roofline_seconds * 1e3:.0f} ms, MFU ≤ {100 * cost.mfu_bound:.0f}%" if cost.mfu_bound else "no peak known"
    estimate = (f"{cost.estimate.seconds * 1e3:.0f} ms, MFU {100 * cost.estimated_mfu:.0f}%" if cost.estimated_mfu
                else f"none (no rate for {cost.estimate_missing})")
    c = steps.config
    return (f"| {name} | {len(target.devices)} ({target.num_hosts} host{'s' if target.num_hosts > 1 else ''}) | "
            f"{c.model.dtype} | {c.model.attention} | {c.microbatches} | {'on' if c.model.remat else 'off'} | "
            f"{steps.peak / GIB:.2f} of {target.memory_limit / GIB:.2f} GiB | "
            f"{sum(cost.hbm_bytes.values()) / 1e9:.1f} GB | {roofline} | {estimate} | "
            f"{time.perf_counter() - start:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("topologies", nargs="+")
    args = parser.parse_args()
    print("| target | devices | compute | attention | micro-batches | remat | peak a device | HBM a step | "
          "roofline (a bound) | estimated, one kernel at a time | compile time here |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.topologies:
        print(row(name), flush=True)


if __name__ == "__main__":
    main()
