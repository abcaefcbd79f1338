"""Eight CPU devices for every test, so meshes can be tested on one machine; one compilation
cache for the run of the suite.

The flags must be set before jax is imported anywhere. Many tests, and the train.py and
eval.py processes they start, compile the same programs: JAX's persistent cache lets the
first compile serve the rest. Its directory is new for each run of the suite and removed
after it, so no run can pass on an executable an earlier run compiled.
"""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "PYTEST_XDIST_WORKER" not in os.environ:  # a worker inherits its controller's cache
    _cache = tempfile.mkdtemp(prefix="andrea-jax-test-compiles-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
