"""Joining a multi-process run: one collective called from different lines is one program in every process.

jax 0.12.1's processes wait for ever in a collective that they reach from different lines (leader_first's
leader and followers, for one): the call stack is in the program's metadata, and so in its fingerprint.
"""

import contextlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from andrea_jax.runtime import distributed
from tests.test_multihost import ROOT, env, free_port, wait_all


@pytest.fixture
def jax_config():
    """Restores the settings that joining a run changes."""
    names = ("jax_traceback_in_locations_limit", "jax_include_full_tracebacks_in_locations",
             "jax_compilation_cache_include_metadata_in_key", "jax_enable_preemption_service")
    saved = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def lowered_text():
    """A new function each time (nothing cached), lowered with its metadata: the caller's line is in it unless
    the call stack is left out."""
    return jax.jit(lambda x: x * 2).lower(np.float32(1)).as_text(debug_info=True)


def test_a_multi_process_run_lowers_one_program_whatever_line_calls_it(jax_config, monkeypatch):
    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args, **kwargs: joined.append(args))
    monkeypatch.setattr(distributed, "cluster_detected", lambda *args: False)  # whatever this machine is
    assert not distributed.initialize()  # one process, no cluster: its programs keep their lines
    here = lowered_text()
    there = lowered_text()
    assert here != there

    assert distributed.initialize("127.0.0.1:1234", 2, 0)
    assert joined == [("127.0.0.1:1234", 2, 0)]
    here = lowered_text()
    there = lowered_text()
    assert here == there
    assert "jit(<lambda>)/mul" in here  # the operations' names stay
    assert jax.config.jax_compilation_cache_include_metadata_in_key
    # JAX's other setting writes the innermost user frame whatever the limit: joining turns it back on.
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    distributed.initialize("127.0.0.1:1234", 2, 0)
    here = lowered_text()
    there = lowered_text()
    assert here == there


CALLED_FROM_TWO_LINES = textwrap.dedent("""
    import sys
    import numpy as np
    from jax.experimental import multihost_utils
    from andrea_jax.runtime import distributed

    distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), timeout_s=30)
    if sys.argv[2] == "0":
        value = multihost_utils.broadcast_one_to_all(np.int32(7))
    else:
        value = multihost_utils.broadcast_one_to_all(np.int32(0))
    print("received", int(value), flush=True)
""")


def test_two_processes_meet_in_a_collective_they_call_from_different_lines(tmp_path):
    """The collective itself, across two processes: on jax 0.12.1 without the fix both wait for ever (and
    ignore SIGTERM), so they are killed at the deadline."""
    script = tmp_path / "two_lines.py"
    script.write_text(CALLED_FROM_TWO_LINES)
    address = f"127.0.0.1:{free_port()}"
    # Each compiles its own program: from the suite's compilation cache one could load the other's.
    child_env = {key: value for key, value in env(1).items() if key != "JAX_COMPILATION_CACHE_DIR"}
    logs = [tmp_path / f"process_{rank}.log" for rank in range(2)]
    with contextlib.ExitStack() as files:
        procs = [subprocess.Popen([sys.executable, str(script), address, str(rank)], cwd=ROOT,
                                  env=dict(child_env, PYTHONPATH=ROOT, JAX_ENABLE_COMPILATION_CACHE="false"),
                                  stdout=files.enter_context(open(log, "w")), stderr=subprocess.STDOUT)
                 for rank, log in enumerate(logs)]
        try:
            codes = wait_all(procs, timeout=90)  # kills both past it
        except subprocess.TimeoutExpired:
            pytest.fail("the processes still wait in the collective after 90 s")
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], outputs
    assert [output.splitlines()[-1] for output in outputs] == ["received 7", "received 7"], outputs
