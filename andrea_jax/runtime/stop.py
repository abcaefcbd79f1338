"""The run's one stop request: SIGTERM and SIGINT set it, every wait polls it (docs/lifecycle.md, "Stop").

A signal handler here only notes the signal, or stops at once. In train.py a stop at once ends the process from
the handler, raising nothing into the code it lands in (a KeyboardInterrupt thrown into JAX's callbacks while a
step compiles is dropped, and one that ends the interpreter under XLA's threads can crash it at exit); where the
process lives on (a notebook's kernel) it raises KeyboardInterrupt, as Python does. Before the first step a
request stops at once; from then on the loop stops at the next step boundary, after saving, and a second
Ctrl-C stops at once unless a save is in flight.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Callable, Iterator

import jax

_KEY = "andrea_jax/stop"  # in the distributed runtime's key-value store: some process has a request
_POLL_S = 0.005


class StopRequest:
    """The signals received, in order; `training`, `saving` and `line_at_once` say what a signal does now."""

    def __init__(self, exit_process: bool) -> None:
        self.received: list[str] = []
        self.training = False  # from the first step on: a request stops at the next step boundary
        self.saving: Callable[[], bool] = lambda: False  # a checkpoint a stop at once would lose is being written
        # A stop at once: ends the process (train.py) after `clean_ups`, saying `line_at_once(signal, training)`,
        # or raises KeyboardInterrupt where the process lives on (a notebook's kernel).
        self.exit_process, self.clean_ups = exit_process, []
        self.line_at_once: Callable[[str, bool], str] = lambda name, training: f"stopped at once by {name}"
        self._published, self._vote, self._last_vote = False, None, None

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        self.received.append(name)
        # With several processes a second Ctrl-C is a note too: a process gone at once would leave the others
        # waiting in their next collective.
        again = name == "SIGINT" and self.received.count("SIGINT") > 1 and jax.process_count() == 1
        if self.training and not (again and not self.saving()):
            return  # only a note: the loop stops at its next step boundary
        if not self.exit_process:
            raise KeyboardInterrupt
        for clean_up in self.clean_ups:
            with contextlib.suppress(Exception):
                clean_up()
        with contextlib.suppress(Exception):  # the buffered streams may be mid-write in the main thread
            sys.stdout.flush()
        os.write(2, f"\nerror: {self.line_at_once(spoken(name), self.training)}\n".encode())
        os._exit(2)  # no interpreter teardown under XLA's threads; the kernel drops the run's locks

    def requested(self) -> bool:
        """Whether this process, or with several processes any of them, was asked to stop (polled by waits)."""
        if jax.process_count() == 1:
            return bool(self.received)
        if self._publish():
            return True
        try:
            return _client().key_value_try_get(_KEY) is not None
        except Exception:  # absent
            return False

    def _publish(self) -> bool:
        """Posts this process's request for the others' waits (once); whether there is one."""
        if self.received and not self._published:
            _client().key_value_set(_KEY, "1", allow_overwrite=True)
            self._published = True
        return self._published

    def agreed(self, done: int, waited_out: bool = False) -> bool:
        """Whether every process stops after step `done`; `waited_out`: this one's wait for the next batch was
        ended by a request. With several processes each posts its vote and reads all of them (a host round
        trip through the distributed runtime, no device work), polling the request meanwhile."""
        if jax.process_count() == 1:
            return waited_out or bool(self.received)
        # Its own request only: another's is in that one's vote, at this step or the next.
        local = waited_out or self._publish()
        client, prefix = _client(), f"andrea_jax/step{done}/"
        # The vote of two steps back: every process voted at the last step, so each has read that one. (The last
        # step's may still be read by a process that has not passed it: this one's host runs ahead of its step.)
        self._forget_vote()
        self._vote, self._last_vote = self._last_vote, f"{prefix}{jax.process_index()}"
        client.key_value_set(self._last_vote, "1" if local else "0")
        while len(votes := client.key_value_dir_get(prefix)) < jax.process_count():
            self._publish()  # a request that came meanwhile, for a process waiting for its era
            time.sleep(_POLL_S)
        return any(value == "1" for _, value in votes)

    def _forget_vote(self) -> None:
        if self._vote is not None:
            with contextlib.suppress(Exception):
                _client().key_value_delete(self._vote)

    def reason(self) -> str:
        return self.received[0] if self.received else "a signal to another process"


def spoken(signal_name: str) -> str:
    """A signal as a user names it: Ctrl-C for SIGINT."""
    return "Ctrl-C" if signal_name == "SIGINT" else signal_name


def _client():
    from jax._src import distributed  # the runtime's client: JAX has no public handle on its key-value store

    return distributed.global_state.client


@contextlib.contextmanager
def stop_requests(exit_process: bool) -> Iterator[StopRequest]:
    """The run's StopRequest (`exit_process`: a stop at once ends the process), its handlers installed for
    SIGTERM and SIGINT (each unless the process was started ignoring it, as a shell starts a background job's
    SIGINT), with its keys in the runtime's store (a later run in these processes). On exit the handlers are
    put back; where the process ends with the run (train.py) the signals are ignored instead: the run has
    nothing left to stop, and Python's teardown would give a handler's signal its default action back before
    XLA's objects are freed (the process killed without a line)."""
    request, previous = StopRequest(exit_process), {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(sig) == signal.SIG_IGN:
            continue
        with contextlib.suppress(ValueError):  # not the main thread: signals stay with the caller
            previous[sig] = signal.signal(sig, request._on_signal)
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if exit_process else handler)
        request._forget_vote()  # the last vote stays: a process may be reading it still
        if request._published:
            with contextlib.suppress(Exception):
                _client().key_value_delete(_KEY)
