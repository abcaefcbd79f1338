"""leader_first with stand-in collectives: each process's view of a two-process run, one at a time."""

import jax
import pytest

from andrea_jax.data import DataError
from andrea_jax.runtime import leader_first as runtime_leader_first
from andrea_jax.runtime.leader_first import leader_first


class Broken(RuntimeError):
    pass


def fail():
    raise Broken("no such source")


@pytest.fixture
def collectives(monkeypatch):
    """Installs stand-ins for a two-process run: the flag process 0 shares (None: this process is 0 and
    reports its own) and the gather; returns what this process sent."""
    def install(process_0_ok=None, all_ok=(True, True)):
        sent = []
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        monkeypatch.setattr(runtime_leader_first, "_flag_of_process_0",
                            lambda ok: sent.append(ok) or (ok if process_0_ok is None else process_0_ok))
        monkeypatch.setattr(runtime_leader_first, "_flags_of_all",
                            lambda ok: sent.append(("gather", ok)) or list(all_ok))
        return sent
    return install


def test_everyone_succeeds(collectives):
    sent = collectives()
    assert leader_first(True, lambda: "built", lambda: "read", "prepare the data") == "built"
    assert sent == [True, ("gather", True)]
    sent = collectives(process_0_ok=True)
    assert leader_first(False, lambda: "built", lambda: "read", "prepare the data") == "read"
    assert sent == [True, ("gather", True)]


def test_a_leader_failure_is_shared_then_raised_and_the_others_stop_with_one_line(collectives):
    sent = collectives()
    with pytest.raises(Broken):
        leader_first(True, fail, lambda: "read", "prepare the data")
    assert sent == [False]  # shared before raising; no second collective (the others skip it too)
    sent = collectives(process_0_ok=False)
    follower_ran = []
    with pytest.raises(DataError, match="^process 0 failed to prepare the data; its output has the error"):
        leader_first(False, lambda: "built", lambda: follower_ran.append(1), "prepare the data")
    assert follower_ran == [] and sent == [True]


def test_a_follower_failure_reaches_the_leader(collectives):
    sent = collectives(process_0_ok=True, all_ok=(True, False))
    with pytest.raises(Broken):
        leader_first(False, lambda: "built", fail, "prepare the data")
    assert sent == [True, ("gather", False)]
    sent = collectives(all_ok=(True, False))
    with pytest.raises(DataError, match="^process 1 failed after process 0 could prepare the data"):
        leader_first(True, lambda: "built", lambda: "read", "prepare the data")


def test_one_process_just_runs_the_leader_work():
    assert leader_first(True, lambda: "built", fail, "prepare the data") == "built"
