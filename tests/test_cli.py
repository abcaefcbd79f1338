"""The entry points' one error path: every user error, and a full disk however it arrives, as one line."""

import errno

import pytest

from andrea_jax import UserError, checkpoint, evaluate, train_loop
from andrea_jax.config import ConfigError
from andrea_jax.data import DataError
from andrea_jax.gpt2.huggingface import ExportError
from andrea_jax.runtime import atomic, cli


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
