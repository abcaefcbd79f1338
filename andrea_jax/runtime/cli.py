"""What train.py and eval.py share: the multi-process flags, quiet libraries, one-line errors."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import sys
from typing import Callable

from absl import app, flags, logging

COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                  "host:port of process 0, for a multi-process run launched by hand")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes in a multi-process run")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0 .. num_processes-1")
DISTRIBUTED_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout", 120, "Seconds to wait for the coordinator at start, and for a silent process "
    "before the run stops")


def run(main: Callable[[], None], join_cluster: bool = True, verbosity: int = logging.WARNING) -> None:
    """Joins the cluster if there is one (and `join_cluster`), runs `main`, and turns user errors into one
    line and exit code 2. Libraries log at `verbosity` unless --verbosity says otherwise."""
    from andrea_jax import UserError
    from andrea_jax.runtime import atomic, distributed, host_memory

    host_memory.keep_freed_memory()
    quiet_libtpu_without_a_tpu()
    _leave_out_an_absent_tpu()
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(verbosity)  # library INFO chatter hides the progress bar and the results
    try:
        if join_cluster:
            distributed.initialize(COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value,
                                   DISTRIBUTED_TIMEOUT.value)
        main()
    except Exception as error:
        # A full disk arrives from many writers, Orbax's threads among them, in many forms.
        known = error if isinstance(error, UserError) else atomic.as_disk_full(error)
        if known is None:
            raise
        print(f"error: {known}", file=sys.stderr, flush=True)
        sys.exit(2)


# At start-up libtpu asks the cloud's metadata server for its slice's hosts and workers, and where there is
# none (a host without a TPU chip: the compile check's compile-only TPUs, JAX trying each installed plugin)
# prints half a dozen lines of errors, before its logging is set up: TPU_MIN_LOG_LEVEL, TPU_STDERR_LOG_LEVEL and
# TF_CPP_MIN_LOG_LEVEL leave them. Told it is a one-host slice it asks nothing; a compile-only topology names
# its own hosts, and compiles the same.
LIBTPU_WITHOUT_A_TPU = {"TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "localhost"}


def quiet_libtpu_without_a_tpu() -> None:
    """Tells libtpu what it would ask for, where it is installed and the host has no TPU chip; a variable
    already set is kept. Before libtpu loads: it reads them once."""
    if importlib.util.find_spec("libtpu") is not None and _tpu_chips() == 0:
        for name, value in LIBTPU_WITHOUT_A_TPU.items():
            os.environ.setdefault(name, value)


def _tpu_chips() -> int | None:
    """This host's TPU chips by the check JAX's own TPU start-up makes, or None where JAX has moved it."""
    try:  # JAX has no public check, and may move this one
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0]
    except (ImportError, AttributeError, TypeError, IndexError, OSError):
        return None


def _leave_out_an_absent_tpu() -> None:
    """libtpu (installed for the TPU compile check) starts whenever JAX picks the platforms itself, on a host
    without a TPU chip for nothing. Where no platform was asked for, the host has no TPU chip and no other
    accelerator's plugin is installed, the CPU is all there is: ask for it."""
    if (os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_FORCE_TPU_INIT")
            or importlib.util.find_spec("libtpu") is None
            or importlib.metadata.entry_points(group="jax_plugins") or importlib.util.find_spec("jax_plugins")):
        return
    import jax

    if _tpu_chips() == 0:  # where JAX moved its check, JAX picks the platforms itself, as without libtpu
        jax.config.update("jax_platforms", "cpu")


@contextlib.contextmanager
def one_line_flag_errors():
    """Every mistake on the command line as one line and exit status 2, in place of a traceback.

    absl reports a bad value in a line of its own plus a help hint; ml_collections raises
    (a misspelt --config.key, a config file that is missing or broken) with a traceback.
    """
    try:
        yield
        return
    except flags.Error as error:  # a bad value, a missing required flag, an unknown flag
        message = " ".join(str(error).split()) + "; see --helpshort"
    except Exception as error:
        # ml_collections: a key the config does not have (an AttributeError around a KeyError; a misspelt group,
        # --config.optimzer.x, a KeyError as the cause of another error), or a config file it could not read or run
        cause = error.args[0] if isinstance(error, AttributeError) and error.args else error.__cause__ or error
        if isinstance(cause, KeyError):
            key, _, hint = str(cause.args[0] if cause.args else cause).partition("\n")
            message = (f"the config has no key {key.strip()}" + (f"; {hint.strip()}" if hint else "") +
                       "; every key is in andrea_jax/config.py, with its default and meaning")
        else:
            lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
            message = (f"the --config file could not be loaded ({lines[-1] if lines else type(cause).__name__}); "
                       f"pass a config file such as configs/tiny.py")
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
    with one_line_flag_errors():
        argv = flags.FLAGS(argv)
        if "config" in flags.FLAGS:
            # ml_collections keeps a failed load as a value that raises on first use: use it now.
            getattr(flags.FLAGS["config"].value, "keys", None)
    return argv


def run_app(main: Callable[[list[str]], None]) -> None:
    """absl's app.run with one-line flag errors (train.py, eval.py, compile.check)."""
    app.run(main, flags_parser=_parse_flags)
