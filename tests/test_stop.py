"""The run's one stop request (runtime/stop.py): what each signal does before and during training."""

import os
import signal
import subprocess
import sys
import time

import pytest

from andrea_jax.runtime import stop


def deliver(sig):
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs in the main thread between bytecodes


@pytest.fixture
def default_sigint():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_ignored_ctrl_c_stays_ignored_after_a_sigterm():
    """A background job's SIGINT is ignored from its start: a SIGTERM (which asks for a checkpoint) must not turn
    it back on, or the Ctrl-C after it stops the run at once without that checkpoint."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stop.stop_requests(exit_process=False) as request:
            request.training = True
            deliver(signal.SIGTERM)
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            deliver(signal.SIGINT)
            deliver(signal.SIGINT)
            assert request.received == ["SIGTERM"] and request.requested() and request.agreed(3)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_where_the_process_ends_with_the_run_its_stops_are_ignored_after_the_run(default_sigint):
    """train.py: after the run a signal has nothing left to stop, and Python's teardown would give a handler's
    signal its default action back before XLA's objects are freed (rc -15, no line): both are ignored."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with stop.stop_requests(exit_process=True):
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, previous)
        assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        deliver(signal.SIGTERM)  # ignored: this process lives on
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_second_ctrl_c_waits_for_a_save_in_flight_and_otherwise_stops_at_once(default_sigint):
    saving = [False]
    with stop.stop_requests(exit_process=False) as request:
        request.training, request.saving = True, lambda: saving[0]
        assert not request.agreed(1)
        deliver(signal.SIGINT)  # during a step: noted, the loop stops at its next boundary
        assert request.received == ["SIGINT"] and request.agreed(2)
        saving[0] = True
        deliver(signal.SIGINT)  # while the stop's checkpoint is written: only noted
        assert request.received == ["SIGINT", "SIGINT"]
        saving[0] = False
        with pytest.raises(KeyboardInterrupt):  # nothing to lose: at once
            deliver(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_before_the_first_step_any_stop_is_at_once(default_sigint):
    with stop.stop_requests(exit_process=False) as request:
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGTERM)
        assert request.received == ["SIGTERM"]


_AT_ONCE = """
import os, signal, sys, time
from andrea_jax.runtime import stop
with stop.stop_requests(exit_process=True) as request:
    request.clean_ups.append(lambda: open(sys.argv[1], "w").write("cleaned"))
    request.line_at_once = lambda name, training: f"stopped by {name}, training={training}"
    request.training = sys.argv[2] == "training"
    print("ready", flush=True)
    while True:  # a step, or a compile: the handler runs between its bytecodes
        time.sleep(0.01)
"""


@pytest.mark.parametrize("phase, signals", [("starting", ["SIGTERM"]), ("training", ["SIGINT", "SIGINT"])])
def test_a_stop_at_once_ends_the_process_in_one_line_after_its_clean_up(tmp_path, phase, signals):
    marker = tmp_path / "cleaned"
    process = subprocess.Popen([sys.executable, "-c", _AT_ONCE, str(marker), phase], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert process.stdout.readline() == "ready\n"
    for name in signals:
        process.send_signal(getattr(signal, name))
        time.sleep(0.2)
    _, err = process.communicate(timeout=30)
    name = "Ctrl-C" if signals[0] == "SIGINT" else signals[0]
    assert process.returncode == 2 and err.strip() == f"error: stopped by {name}, training={phase == 'training'}"
    assert marker.read_text() == "cleaned"
