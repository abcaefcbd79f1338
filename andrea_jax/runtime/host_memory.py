"""Keep freed host memory in the process: glibc's malloc thresholds for a training loop.

XLA:CPU allocates every step's buffers from the host heap. By default glibc
serves large blocks with fresh mmap()s and gives freed memory back to the OS, so
each step faults its buffers' pages in again, a large share of a small model's
step on a CPU (measured in bench/RESULTS.md). Raising both thresholds keeps freed blocks
for reuse; the process's resident memory then stays at its peak, which a trainer
reaches in its first step anyway.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # glibc mallopt() parameters (malloc.h)
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 30  # glibc's dynamic ceiling (32 MiB) still trims every step (bench/RESULTS.md)


def keep_freed_memory() -> bool:
    """Raises glibc's mmap and trim thresholds; False where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the process already runs with
    except AttributeError:  # no mallopt (macOS): another allocator, nothing to set
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES))
