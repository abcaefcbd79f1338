"""The entry points' one error path: every user error, and a full disk however it arrives, as one line."""

import ctypes
import errno
import os
import subprocess
import sys

import pytest

from andrea_jax import UserError, checkpoint, evaluate, train_loop
from andrea_jax.config import ConfigError
from andrea_jax.data import DataError
from andrea_jax.gpt2.huggingface import ExportError
from andrea_jax.runtime import atomic, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fail_with(error: BaseException):
    def main() -> None:
        raise error
    return main


@pytest.mark.parametrize("kind", [ConfigError, DataError, checkpoint.CheckpointError, evaluate.EvalError,
                                  ExportError, train_loop.TrainingStopped, atomic.DiskFull])
def test_each_user_error_is_one_line_and_exit_status_2(kind, capsys):
    assert issubclass(kind, UserError)
    with pytest.raises(SystemExit) as stopped:
        cli.run(_fail_with(kind("model.n_head=5 does not divide 768; pick 12")), join_cluster=False)
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "error: model.n_head=5 does not divide 768; pick 12\n"


def test_a_full_disk_from_deep_inside_a_library_names_the_file(tmp_path, capsys):
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "eval_step5.json"))
    with pytest.raises(SystemExit) as stopped:
        cli.run(_fail_with(full), join_cluster=False)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: the disk is full: writing {tmp_path}/eval_step5.json (")


def test_a_bug_keeps_its_traceback():
    with pytest.raises(KeyError, match="not a user error"):
        cli.run(_fail_with(KeyError("not a user error")), join_cluster=False)


def _without_root_override():
    """In the child, before it runs: root loses the capabilities that let it write where modes say no
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so chmod binds it as it binds anyone else."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    for capability in (1, 2):
        if prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone from the program it executes
            raise OSError(ctypes.get_errno(), "cannot drop a capability")


def test_a_read_only_workdir_is_one_line_and_exit_status_2(tmp_path):
    from andrea_jax import run_dir
    from configs import tiny

    empty, started = tmp_path / "empty", tmp_path / "started"
    empty.mkdir()
    run_dir.save_config(str(started), tiny.get_config())  # a run's directory, copied somewhere read-only
    (started / run_dir.LOCK_FILE).write_text("pid 1 on elsewhere")
    before = {path: path.read_bytes() for path in started.iterdir()}
    for directory in (empty, started):
        os.chmod(directory, 0o555)
    drop = None
    if os.geteuid() == 0:  # root writes through chmod: run train.py without that power, or skip
        try:
            subprocess.run(["true"], preexec_fn=_without_root_override, check=True)
        except (OSError, subprocess.SubprocessError) as error:
            pytest.skip(f"running as root, and root's override of file modes cannot be dropped here ({error})")
        drop = _without_root_override
    try:
        for workdir in (empty, empty / "new", started):  # the directory it would be made in may be the read-only one
            result = subprocess.run(
                [sys.executable, "train.py", "--config", "configs/tiny.py", "--workdir", str(workdir),
                 "--config.hellaswag.every=0", f"--config.data.cache_dir={tmp_path / 'cache'}"],
                capture_output=True, text=True, timeout=300, cwd=ROOT, preexec_fn=drop,
                env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""))
            assert (result.returncode, result.stdout, result.stderr) == (
                2, "", f"error: --workdir {workdir} cannot be written to (Permission denied); make it (or the "
                       f"directory it goes in) writable, or use another --workdir\n")
    finally:
        for directory in (empty, started):
            os.chmod(directory, 0o755)
    assert os.listdir(empty) == [] and not os.path.exists(tmp_path / "cache")
    assert {path: path.read_bytes() for path in started.iterdir()} == before


@pytest.mark.parametrize("jax_now, platforms", [
    ("no TPU chip", ["cpu"]),
    ("a TPU chip", []),
    ("the module moved", []),  # JAX picks the platforms itself, as without libtpu
    ("the function renamed", []),
])
def test_the_absent_tpu_check_degrades_to_jax_choosing_when_its_private_module_moves(jax_now, platforms, monkeypatch):
    import importlib.metadata
    import importlib.util
    import jax
    import jax._src
    from jax._src import hardware_utils

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("JAX_FORCE_TPU_INIT", raising=False)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object() if name == "libtpu" else
                        None if name == "jax_plugins" else find_spec(name, *args))
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id",
                        lambda: (int(jax_now == "a TPU chip"), None))
    if jax_now == "the module moved":
        monkeypatch.delattr(jax._src, "hardware_utils")
        monkeypatch.setitem(sys.modules, "jax._src.hardware_utils", None)  # importing it raises ImportError
    elif jax_now == "the function renamed":
        monkeypatch.delattr(hardware_utils, "num_available_tpu_chips_and_device_id")
    asked = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: asked.append((name, value)))
    cli._leave_out_an_absent_tpu()
    assert asked == [("jax_platforms", platform) for platform in platforms]


@pytest.mark.parametrize("chips, told", [(0, {"TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "host-a"}),
                                          (1, {"TPU_WORKER_HOSTNAMES": "host-a"})])
def test_libtpu_is_told_it_is_a_one_host_slice_only_where_the_host_has_no_tpu_chip(chips, told, monkeypatch):
    """A TPU host's libtpu finds its slice itself (a pod's workers among it); a name the user set is kept."""
    import importlib.util
    from jax._src import hardware_utils

    for name in cli.LIBTPU_WITHOUT_A_TPU:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-a")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object() if name == "libtpu" else
                        find_spec(name, *args))
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (chips, None))
    cli.quiet_libtpu_without_a_tpu()
    assert {name: os.environ[name] for name in cli.LIBTPU_WITHOUT_A_TPU if name in os.environ} == told


def test_a_command_on_a_host_without_a_tpu_does_not_start_libtpu():
    """With libtpu installed (for the TPU compile check) and no platform asked for, a CPU command's stderr
    holds none of libtpu's start-up errors."""
    pytest.importorskip("libtpu", reason="libtpu is not installed: it has nothing to start")
    env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
    result = subprocess.run(
        [sys.executable, "-c", "import jax\nfrom andrea_jax.runtime import cli\n"
         "cli.run(lambda: print(jax.devices()[0].platform), join_cluster=False)"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 0 and result.stdout.split() == ["cpu"], result.stderr[-2000:]
    assert "TPU" not in result.stderr and "E0000" not in result.stderr, result.stderr[-2000:]
