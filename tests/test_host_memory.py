"""host_memory: freed host buffers are reused instead of being faulted in again every step."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 20 "steps" that each allocate, touch and free a 64 MB buffer; prints the minor page
# faults of the last 19 (the first one faults its pages in either way).
PROBE = """
import resource, sys
import numpy as np
from andrea_jax.runtime import host_memory
if sys.argv[1] == "keep":
    assert host_memory.keep_freed_memory()
np.ones(16 * 2**20, np.float32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(19):
    np.ones(16 * 2**20, np.float32)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    result = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_raised_thresholds_stop_the_page_faults_of_every_step():
    default, kept = page_faults("default"), page_faults("keep")
    # glibc's default maps fresh pages for every buffer (fewer faults than 4 KiB pages
    # where the kernel backs them with huge pages, but thousands); kept: none.
    assert default >= 19 * 64
    assert kept <= default // 100
