"""The mechanics of a commit decision: waiting (bounded) for a step's collectives, the vote across
replica groups that makes a step failed anywhere committed nowhere, and the vote among a group's
ranks. A failed vote is reported (the step's error) and counts as "no", never raised.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftlaunch.errors import CommunicationError
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.worker.group_store import GroupStore

#: How often a wait looks at its ``interrupted`` condition.
_INTERRUPT_POLL = 0.05


def wait_all(
    futures: list[torch.futures.Future[Any]], deadline: float, interrupted: Callable[[], bool] | None = None
) -> bool:
    """Wait for every future until ``deadline`` (monotonic) or until ``interrupted()`` (looked at
    every 50 ms: the lighthouse said a peer of the step is gone, `hang_abort`); False if some are
    still running.

    torch futures have no timed wait: completion callbacks count down to an Event instead. The
    common case (everything already done by the time the optimizer steps) costs one check each.
    """
    waiting = [f for f in futures if not f.done()]
    if waiting:
        done = threading.Event()
        left = [len(waiting)]
        lock = threading.Lock()

        def one_done(_: torch.futures.Future[Any]) -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        for f in waiting:
            f.add_done_callback(one_done)
        while not done.wait(_slice(deadline, interrupted)):
            if time.monotonic() >= deadline or (interrupted is not None and interrupted()):
                return False
    for f in futures:
        f.wait()  # done: surfaces nothing (errors were reported in the completion callbacks)
    return True


def _slice(deadline: float, interrupted: Callable[[], bool] | None) -> float:
    left = max(deadline - time.monotonic(), 0.0)
    return left if interrupted is None else min(left, _INTERRUPT_POLL)


class CrossGroupVote:
    """A one-element MIN allreduce over the cross-group process group: 1 if every group is ready.

    The same tensor serves every step's vote: a Baby process group shares a storage with its child
    the first time it sees it (a shm file, an fd sent over a socket, an unregister when it dies),
    which a fresh tensor per step paid on every vote. After a failed vote the op may still be in
    flight somewhere, so that tensor is dropped and the next vote starts a new one.
    """

    def __init__(self) -> None:
        self._flag: torch.Tensor | None = None

    def __call__(
        self, pg: ProcessGroup, ok: bool, deadline: float, interrupted: Callable[[], bool] | None = None
    ) -> bool:
        """Whether every group voted yes; raises `CommunicationError` (or the group's error) when
        the vote fails or does not finish by ``deadline`` (monotonic) or ``interrupted()``."""
        flag = self._flag
        if flag is None:
            flag = self._flag = torch.empty(1, dtype=torch.int32)
        flag.fill_(1 if ok else 0)
        try:
            work = pg.allreduce([flag], dist.ReduceOp.MIN)
            if interrupted is None:
                # timedelta(0) means "no timeout" to torch: never pass less than a millisecond.
                left = timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
                if not work.wait(left):
                    raise CommunicationError("the commit vote timed out (commit timeout)")
            else:  # a wait that a lost peer can cut short (a backend's wait cannot be)
                fut = work.get_future()
                if not wait_all([fut], deadline, interrupted):
                    raise CommunicationError("the commit vote timed out or a peer was lost")
                fut.value()
        except Exception:
            self._flag = None
            raise
        return bool(flag.item() == 1)


def vote_of_all_groups(
    vote: CrossGroupVote,
    pg: ProcessGroup,
    ok: bool,
    deadline: float,
    report_error: Callable[[Exception], None],
    interrupted: Callable[[], bool] | None = None,
) -> bool:
    """Every group's ``ok`` (MIN across groups); False, with the reason reported, when it fails."""
    pg_error = pg.errored()
    if pg_error is not None:
        # The cross-group PG failed before or during this step (allreduce skips a failed group
        # without a word): gradients were not exchanged, so the step cannot commit.
        report_error(pg_error)
        return False
    try:
        return vote(pg, ok, deadline, interrupted)
    except Exception as e:  # noqa: BLE001 - reported, the step will not commit
        report_error(e)
        return False


def vote_of_group_ranks(
    group: GroupStore,
    seq: int,
    ok: bool,
    deadline: float,
    report_error: Callable[[Exception], None],
    replica_id: str,
) -> bool:
    """Every rank of this group's ``ok`` for round ``seq``. Raises `CommunicationError` (reported
    first) when a rank's vote does not arrive: it is dead (its agent restarts the group anyway) or
    stopped/hung, which no agent notices -- and the leader, still healthy, would bring the group
    into every quorum, failing every step of every group. The worker ends; its agent then restarts
    the whole group, the stopped rank included."""
    try:
        return group.vote(seq, ok, deadline)
    except CommunicationError as e:
        report_error(e)
        raise CommunicationError(
            f"a rank of replica group {replica_id} did not vote within the commit timeout "
            f"(dead or hung): {e}; this worker ends so that its agent restarts the group"
        ) from e
