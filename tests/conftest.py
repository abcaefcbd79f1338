"""Eight CPU devices for every test, so meshes can be tested on one machine; one compilation
cache for the run of the suite; the tests marked `alone` run with no other test beside them.

The flags must be set before jax is imported anywhere. Many tests, and the train.py and
eval.py processes they start, compile the same programs: JAX's persistent cache lets the
first compile serve the rest. Its directory is new for each run of the suite and removed
after it, so no run can pass on an executable an earlier run compiled.
"""

import atexit
import contextlib
import fcntl
import os
import shutil
import signal
import tempfile

import pytest

# The train.py processes the tests start take Ctrl-C as a user's terminal sends it. A shell starts a background
# job with SIGINT ignored, and a child keeps that (train.py then leaves Ctrl-C alone, as a background job should):
# in a suite run in the background, every test of a Ctrl-C would wait for a stop that never comes.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "PYTEST_XDIST_WORKER" not in os.environ:  # a worker inherits its controller's directory
    _run = tempfile.mkdtemp(prefix="andrea-jax-tests-")
    atexit.register(shutil.rmtree, _run, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=os.path.join(_run, "compiles"),
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


@contextlib.contextmanager
def _locked(path: str, operation: int):
    with open(path, "a") as f:
        fcntl.flock(f, operation)
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked `alone` waits until no other worker is inside a test and keeps the others out until it
    ends; every other test runs beside any but those. The full-size TPU compiles beside another worker took
    3 to 4 times as long as alone, and that worker's tests about twice theirs (bench/RESULTS.md).

    A readers-writer lock over the workers: a test holds the suite's lock shared, one marked `alone` holds it
    exclusively. A waiting `alone` test holds the turnstile, which every test passes through first, so the
    other worker cannot keep taking the shared lock ahead of it."""
    run = os.path.dirname(os.environ["JAX_COMPILATION_CACHE_DIR"])  # the suite's own directory, shared by its workers
    lock, turnstile = os.path.join(run, "tests.lock"), os.path.join(run, "tests.turnstile")
    if item.get_closest_marker("alone"):
        with _locked(turnstile, fcntl.LOCK_EX), _locked(lock, fcntl.LOCK_EX):
            yield
        return
    with _locked(turnstile, fcntl.LOCK_SH):
        pass
    with _locked(lock, fcntl.LOCK_SH):
        yield


# The modules that take longest, longest first (bench/RESULTS.md, the suite's timeline): the workers take whole
# modules in collection order, so with these first the last modules either worker starts are short ones and both
# end together. A module not named keeps its place after them; a stale list costs time, never a result.
_LONGEST_FIRST = ("test_compile_check", "test_multihost", "test_data_eras", "test_cloud_storage", "test_train_loop",
                  "test_lifecycle", "test_resume", "test_model", "test_train_step", "test_loss_scale", "test_watching",
                  "test_eval")


def pytest_collection_modifyitems(config, items):
    module = lambda item: os.path.basename(item.nodeid.split("::")[0])[:-len(".py")]
    rank = lambda item: _LONGEST_FIRST.index(module(item)) if module(item) in _LONGEST_FIRST else len(_LONGEST_FIRST)
    items.sort(key=rank)  # stable: a module's tests keep their order
