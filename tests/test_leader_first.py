"""leader_first with stand-in collectives: each process's view of a two-process run, one at a time."""

import pytest

from andrea_jax.data import DataError
from andrea_jax.runtime.leader_first import leader_first


class Broken(RuntimeError):
    pass


def fail():
    raise Broken("no such source")


def collectives(process_0_ok=None, all_ok=(True, True)):
    """Stand-ins: the flag process 0 shares (None: this process is 0 and reports its own) and the gather."""
    sent = []

    def flag_of_process_0(ok):
        sent.append(ok)
        return ok if process_0_ok is None else process_0_ok

    def flags_of_all(ok):
        sent.append(("gather", ok))
        return list(all_ok)

    return sent, dict(flag_of_process_0=flag_of_process_0, flags_of_all=flags_of_all)


def test_everyone_succeeds():
    sent, stand_ins = collectives()
    assert leader_first(True, lambda: "built", lambda: "read", "prepare the data", **stand_ins) == "built"
    assert sent == [True, ("gather", True)]
    sent, stand_ins = collectives(process_0_ok=True)
    assert leader_first(False, lambda: "built", lambda: "read", "prepare the data", **stand_ins) == "read"
    assert sent == [True, ("gather", True)]


def test_a_leader_failure_is_shared_then_raised_and_the_others_stop_with_one_line():
    sent, stand_ins = collectives()
    with pytest.raises(Broken):
        leader_first(True, fail, lambda: "read", "prepare the data", **stand_ins)
    assert sent == [False]  # shared before raising; no second collective (the others skip it too)
    sent, stand_ins = collectives(process_0_ok=False)
    follower_ran = []
    with pytest.raises(DataError, match="^process 0 failed to prepare the data; its output has the error"):
        leader_first(False, lambda: "built", lambda: follower_ran.append(1), "prepare the data", **stand_ins)
    assert follower_ran == [] and sent == [True]


def test_a_follower_failure_reaches_the_leader():
    sent, stand_ins = collectives(process_0_ok=True, all_ok=(True, False))
    with pytest.raises(Broken):
        leader_first(False, lambda: "built", fail, "prepare the data", **stand_ins)
    assert sent == [True, ("gather", False)]
    sent, stand_ins = collectives(all_ok=(True, False))
    with pytest.raises(DataError, match="^process 1 failed after process 0 could prepare the data"):
        leader_first(True, lambda: "built", lambda: "read", "prepare the data", **stand_ins)


def test_one_process_just_runs_the_leader_work():
    assert leader_first(True, lambda: "built", fail, "prepare the data") == "built"
