"""A step's commit decision (`StepCommit`: wait, then vote, giving a `Verdict`) and its mechanics:
waiting (bounded) for a step's collectives, the vote across replica groups that makes a step failed
anywhere committed nowhere, and the vote among a group's ranks. A failed vote is reported (the
step's error) and counts as "no", never raised -- except a rank of the group that does not vote
(`vote_of_group_ranks`): that ends the worker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from ftlaunch.errors import CommunicationError
from ftlaunch.process_group.base import ProcessGroup, collective_device
from ftlaunch.process_group.work import PollableWork
from ftlaunch.worker.group_store import GroupStore
from ftlaunch.worker.hang_abort import LostPeerAbort
from ftlaunch.worker.manager_parts import ManagerSettings
from ftlaunch.worker.step import StepAttempt

__all__ = [
    "CrossGroupVote",
    "StepCommit",
    "Verdict",
    "vote_of_all_groups",
    "vote_of_group_ranks",
    "wait_all",
]

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
    flight somewhere, so that tensor is dropped and the next vote starts a new one. It lives where
    the group reduces (`collective_device`): on the GPU for Baby NCCL, which refuses CPU tensors.
    """

    def __init__(self) -> None:
        self._flag: torch.Tensor | None = None
        self._flag_pg: ProcessGroup | None = None  # the group `_flag` was made for

    def __call__(
        self, pg: ProcessGroup, ok: bool, deadline: float, interrupted: Callable[[], bool] | None = None
    ) -> bool:
        """Whether every group voted yes; raises `CommunicationError` (or the group's error) when
        the vote fails or does not finish by ``deadline`` (monotonic) or ``interrupted()``."""
        flag = self._flag
        if flag is None or self._flag_pg is not pg:  # the device asked once per group, not per step
            flag = self._flag = torch.empty(1, dtype=torch.int32, device=collective_device(pg))
            self._flag_pg = pg
        flag.fill_(1 if ok else 0)
        try:
            work = pg.allreduce([flag], dist.ReduceOp.MIN)
            if interrupted is None:
                # timedelta(0) means "no timeout" to torch: never pass less than a millisecond.
                left = timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
                if not work.wait(left):
                    raise CommunicationError("the commit vote timed out (commit timeout)")
            elif isinstance(work, PollableWork):  # waited here, in slices a lost peer can cut short
                while not work.done_within(_slice(deadline, interrupted)):
                    if time.monotonic() >= deadline or interrupted():
                        raise CommunicationError("the commit vote timed out or a peer was lost")
                work.wait()  # done: raises the op's error, if any
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


class Verdict(Enum):
    """What a step's commit decided, the same on every rank of every participating group."""

    #: Every rank of every group finished the step cleanly: apply it.
    COMMIT = "commit"
    #: Everyone agreed, but this group is behind and waits to heal (`StepPlan.waits`): it voted yes
    #: so that the others commit, and applies nothing (it heals from their snapshot of this step).
    STAND_BY = "stand by"
    #: A rank somewhere failed the step: nobody applies it.
    REFUSE = "refuse"
    #: Every rank finished cleanly, but fewer groups than ``min_replica_size`` were up to date:
    #: nobody applies the step, but its healers load the state they received (torchft's healers
    #: heal whether or not the step commits). Otherwise a group that heals only at a commit (live
    #: heals: LocalSGD, DiLoCo) could never come back when the job needs it to reach the minimum.
    TOO_FEW = "too few"

    @property
    def agreed(self) -> bool:
        """Whether the step counts as agreed (committed, or stood by for)."""
        return self in (Verdict.COMMIT, Verdict.STAND_BY)


class StepCommit:
    """One rank's part in deciding each step: `wait` for the step's collectives (bounded by the
    commit deadline, cut short when the lighthouse says a peer of the quorum is lost), then `vote`.
    Failures are reported to ``report`` (the step's error) as they are found."""

    def __init__(
        self,
        settings: ManagerSettings,
        pg: ProcessGroup,
        group: GroupStore,
        hang_abort: LostPeerAbort,
        report: Callable[[Exception], None],
    ) -> None:
        self._settings = settings
        self._pg = pg
        self._group = group
        self._hang_abort = hang_abort
        self._report = report
        self._vote_across_groups = CrossGroupVote()

    def wait(self, attempt: StepAttempt, deadline: float, budget: float) -> Callable[[], bool]:
        """Wait for the step's allreduces until ``deadline``; returns the ``interrupted`` condition
        the votes wait with too (`LostPeerAbort.watch`)."""
        attempt.waiting_since = time.monotonic()
        interrupted = self._hang_abort.watch(self._pg.prepare_abort)
        if not wait_all(attempt.pending, deadline, interrupted):
            # A collective of this step hangs (a peer stopped, not died). Give up on the step and
            # abort the process group so the hung op is released; the next quorum rebuilds it.
            # When the lighthouse said the peer is lost, that abort is under way already.
            lost = self._hang_abort.error
            self._hang_abort.settle()
            self._report(lost or CommunicationError(
                f"commit timed out after {budget:g} s waiting for this step's allreduces"))  # fmt: skip
            if lost is None:
                self._pg.abort()
        attempt.settled()
        return interrupted

    def vote(
        self, attempt: StepAttempt, seq: int, deadline: float, interrupted: Callable[[], bool]
    ) -> Verdict:
        """This rank's readiness, then the vote of every group (MIN over the cross-group process
        group), then of every rank of this group (round ``seq`` of its store)."""
        plan = attempt.plan
        healed = attempt.received is not None or attempt.healed_at_start
        if plan is not None and plan.heal and not healed and attempt.error is None:
            self._report(CommunicationError("healing was planned but no state was received"))
        # Enough groups up to date (torchft's rule: those at the quorum's max step; at step 0 with
        # init_sync that is every group, though only the primary's gradients count). The same answer
        # in every group (the quorum's numbers), so it is not voted on: a clean step with too few
        # still lets its healers load what they received (`Verdict.TOO_FEW`).
        enough = plan is not None and plan.num_up_to_date >= self._settings.min_replica_size
        ok = attempt.error is None and plan is not None
        if plan is not None and plan.replica_world_size > 1:
            lost = self._hang_abort.error
            if lost is not None:  # the quorum lost a peer: no vote with it (every live peer was told)
                self._report(lost)
                ok = False
            else:
                ok = vote_of_all_groups(self._vote_across_groups, self._pg, ok, deadline, self._report,
                                        interrupted)  # fmt: skip
        if self._settings.group_world_size > 1:
            ok = vote_of_group_ranks(self._group, seq, ok, deadline, self._report, self._settings.replica_id)
        if self._hang_abort.error is not None:
            self._hang_abort.settle()  # the aborted ops fail within this step
        if not ok or plan is None:
            return Verdict.REFUSE
        if not enough:
            return Verdict.TOO_FEW
        return Verdict.STAND_BY if plan.waits else Verdict.COMMIT
