"""Work process 0 does for every process, with every failure reaching every process: the one way
train.py (run directory, tokenizer, token caches) and eval.py (the validation cache) prepare data.

With several processes, process 0 works first while the others wait in a
collective that hands them its success flag; then they read what it wrote, and a
second collective tells each process whether all of them could. A failure
anywhere stops every process with one line at once, where it would otherwise
leave the others waiting in their next collective until the distributed
runtime's timeout aborts them.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from andrea_jax.data import DataError

T = TypeVar("T")


def _flag_of_process_0(ok: bool) -> bool:
    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


def _flags_of_all(ok: bool) -> list[bool]:
    return [bool(flag) for flag in np.ravel(multihost_utils.process_allgather(np.int32(ok)))]


def leader_first(is_leader: bool, leader_work: Callable[[], T], follower_work: Callable[[], T], what: str) -> T:
    """leader_work() on process 0, then follower_work() on the others; what they return.

    `what` completes "process 0 failed to ...". With one process, leader_work simply runs.
    """
    if jax.process_count() == 1:
        return leader_work()
    if not is_leader and not _flag_of_process_0(True):
        raise DataError(f"process 0 failed to {what}; its output has the error: fix that and rerun")
    result, failure = None, None
    try:
        result = (leader_work if is_leader else follower_work)()
    except BaseException as error:  # Ctrl-C too: the others must not wait for a process that left
        failure = error
    if is_leader:
        _flag_of_process_0(failure is None)  # a leader that failed stops here, and the others skip the gather
    elif failure is not None:
        _flags_of_all(False)
    if failure is not None:
        raise failure
    failed = [index for index, ok in enumerate(_flags_of_all(True)) if not ok]
    if failed:
        raise DataError(f"process {failed[0]} failed after process 0 could {what} "
                        f"({len(failed)} in all); its output has the error: fix that and rerun")
    return result
