"""The membership's reports (`membership.Membership` mixes it in): the status document, the training
progress, and what rides on a heartbeat answer: the admin's kill request and the participants of
the caller's quorum that are lost (or the news that its quorum went on without it); and the one
rule that progress feeds back: no quorum of groups behind a group that finished the training.

Why apart: apart from that last rule, these read the bookkeeping and change nothing the quorum
decision sees (a kill is told to the group, which then dies like any crashed process), so the
rules of who is in a quorum read without them. `GroupInfo` lives here because the status is what it is for. Runs under the
membership's lock like the rest of it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftlaunch.lighthouse.progress import GroupProgress, ProgressBook, ProgressReport, Rewind
from ftlaunch.lighthouse.protocol import ANONYMOUS
from ftlaunch.lighthouse.quorum import (
    GroupState,
    Health,
    Quorum,
    QuorumIdAllocator,
    QuorumMember,
    QuorumOptions,
    group_health,
)
from ftlaunch.lighthouse.spares import SpareSlots
from ftlaunch.lighthouse.status import (
    GroupStatus,
    HistoryEvent,
    LighthouseStatus,
    SparesStatus,
    StatusOptions,
)
from ftlaunch.lighthouse.tickets import MembershipError, QuorumTicket, TrainingFinished

log = logging.getLogger("ftlaunch.lighthouse.membership")

#: The holder of an id a restarted lighthouse only knows from a resume report: whichever process of
#: the group comes back first takes it (`membership_resume`; `GroupInfo.incarnation`).
ADOPTED = "<adopted>"


@dataclass
class GroupInfo:
    """Per-group facts for the status that the decision does not need."""

    first_seen: float  # wall clock
    step: int = 0
    address: str = ""
    reason: str = ""  # why it is disconnected / failed / silent
    heartbeats: int = 0
    silent_noted: bool = False
    #: Its going down was counted in the progress book (once per incident, until it is back).
    down_counted: bool = False
    #: Which process holds the id (`request_quorum`'s ``incarnation``).
    incarnation: str = ANONYMOUS
    #: It was a participant of some quorum (ids that never were are forgotten once gone).
    in_a_quorum: bool = False
    #: Its usual gap between two signs of life (a decaying maximum; `membership_hung`).
    beat_gap: float = 0.0


class StatusMixin:
    """`Membership`'s status and progress methods; the attributes and helpers below are the membership's."""

    _lock: threading.Lock
    _clock: Callable[[], float]
    _wall: Callable[[], float]
    _options: QuorumOptions
    _ids: QuorumIdAllocator
    _groups: dict[str, GroupState]
    _info: dict[str, GroupInfo]
    _requests: dict[str, QuorumMember]
    _quorum: Quorum | None
    _adopted: Quorum | None
    _evicted: dict[str, str]
    _history: deque[HistoryEvent]
    _spares: SpareSlots | None
    _progress: ProgressBook
    _quorum_changes: int
    _kills: dict[str, str]
    _prev_ids: frozenset[str]
    _prev_broken: bool
    _lost_version: int
    _lost_cache: tuple[int, int, tuple[str, ...]] | None

    if TYPE_CHECKING:

        def _waiting_reason(self, now: float) -> str: ...

        def _spares_status(self, now: float) -> SparesStatus | None: ...

        def _record(self, event: str, replica_id: str | None, detail: str = "") -> None: ...

        def _drop_request(
            self, rid: str, ticket: QuorumTicket | None = None, error: MembershipError | None = None
        ) -> bool: ...

    # ------------------------------------------------------------------ status

    def snapshot(
        self,
        *,
        address: str = "",
        quorum_tick: float = 0.0,
        admin: bool = False,
        connections: Callable[[str], int] = lambda replica_id: 0,
    ) -> LighthouseStatus:
        """The status now; ``connections`` counts a group's bound connections (the transport's)."""
        opts = self._options
        hb = opts.heartbeat_timeout
        with self._lock:
            now, wall = self._clock(), self._wall()
            members = set(self._quorum.replica_ids) if self._quorum else set()
            groups = tuple(
                GroupStatus(
                    replica_id=rid,
                    health=group_health(g, now, opts),
                    step=info.step,
                    address=info.address,
                    last_seen_age=round(now - g.last_seen, 4),
                    heartbeat_timeout=hb,
                    connections=connections(rid),
                    requesting=rid in self._requests,
                    in_quorum=rid in members,
                    heartbeats=info.heartbeats,
                    reason=info.reason,
                    first_seen=info.first_seen,
                )
                for rid, g, info in (
                    (rid, self._groups[rid], self._info[rid]) for rid in sorted(self._groups)
                )
            )
            return LighthouseStatus(
                address=address,
                time=wall,
                options=StatusOptions(
                    opts.min_replicas,
                    opts.join_timeout,
                    hb,
                    quorum_tick,
                    admin,
                    expected_replicas=opts.expected_replicas,
                ),
                quorum=self._quorum,
                next_quorum_id=self._ids.peek(),
                groups=groups,
                pending=tuple(sorted(self._requests)),
                decision=self._waiting_reason(now),
                evicted=tuple(sorted(self._evicted)),
                history=tuple(reversed(self._history)),
                spares=self._spares_status(now),
                progress=self._progress.snapshot(wall),
                quorum_changes=self._quorum_changes,
                step_rate=round(self._progress.job_step_rate(wall), 4),
                rewinds=self._progress.rewinds(),
            )

    # ------------------------------------------------------------------ progress (lighthouse/progress.py)

    def progress(self) -> tuple[GroupProgress, ...]:
        """Every group's training progress, groups that left or died included (cheaper than
        `snapshot`: the launcher reads it every tick)."""
        with self._lock:
            return self._progress.snapshot(self._wall())

    def rewinds(self) -> tuple[Rewind, ...]:
        """The times the job went back to an earlier step (`progress.Rewind`), oldest first."""
        with self._lock:
            return self._progress.rewinds()

    def kill(self, replica_id: str, reason: str) -> bool:
        """Tell the group's leader, in the answer to its next heartbeat, to kill its own process
        (the dashboard's Kill button: a crash on demand). False if the group is unknown."""
        with self._lock:
            if replica_id not in self._groups:
                return False
            self._kills[replica_id] = reason
            self._record("kill_requested", replica_id, reason)
            log.warning("lighthouse: replica %s asked to kill itself: %s", replica_id, reason)
            return True

    def _report_progress(self, rid: str, progress: ProgressReport | None) -> None:
        if progress is not None:
            self._progress.report(rid, progress, self._wall())

    def _count_down(self, rid: str, info: GroupInfo) -> None:
        """One failure per incident: a group reported failed whose connection then closes went
        down once. A kill not yet told is void: it was meant for the process that went down."""
        self._kills.pop(rid, None)
        if not info.down_counted:
            info.down_counted = True
            self._progress.failed(rid)

    # ------------------------------------------------------------------ the end of the training

    def _refuse_behind_finished(self, participants: tuple[QuorumMember, ...]) -> bool:
        """The end-of-run race (docs/launcher.md): a group restarting just as the others finish
        asks for a quorum once they left, and would get one of itself alone, then train from behind
        with nobody to heal from. So a quorum whose participants are all behind the furthest step at
        which another group finished is not formed: its requests are answered `TrainingFinished`
        (their groups end as stragglers of a finished job). Returns whether it refused."""
        ids = frozenset(p.replica_id for p in participants)
        finished = self._progress.furthest_finished_step(exclude=ids)
        if not finished or max(p.step for p in participants) >= finished:
            return False
        for member in participants:
            rid = member.replica_id
            reason = (
                f"the training finished at step {finished}; nothing left to heal from "
                f"(replica {rid} is at step {member.step})"
            )
            self._progress.stopped_after_end(rid)
            self._record("refused_finished", rid, reason)
            log.warning("lighthouse: replica %s refused a quorum: %s", rid, reason)
            self._drop_request(rid, error=TrainingFinished(reason, finished))
        return True

    # ------------------------------------------------------------------ heartbeat answers

    def lost_in_quorum(self, replica_id: str) -> tuple[int, tuple[str, ...]] | None:
        """For the answer to ``replica_id``'s heartbeat: when it is a participant of the current
        quorum and some of that quorum's participants are no longer live here (silent, disconnected,
        failed, evicted, left), the quorum's id and theirs; else None.

        Why: a participant that hangs (SIGSTOP, a hung host) keeps its sockets open, so its peers'
        collectives with it wait out the collective timeout, while the lighthouse knows within its
        heartbeat timeout. Told in the answer to the heartbeats they send anyway, the live
        participants abort the quorum's step at once (worker/hang_abort.py). A member that is slow
        but still beats is live: never in the list. O(1) while the quorum is whole (every heartbeat
        asks); the list is computed once per change of a member's liveness. Before this lighthouse
        formed a quorum, the quorum it adopted from resume reports counts as the current one (its
        members step on it through the outage, worker/outage.py; `_prev_ids` are its members).
        """
        with self._lock:
            quorum = self._quorum if self._quorum is not None else self._adopted
            if not self._prev_broken or quorum is None or replica_id not in self._prev_ids:
                return None
            cached = self._lost_cache
            if cached is None or cached[0] != quorum.quorum_id or cached[1] != self._lost_version:
                now = self._clock()
                lost = tuple(
                    p.replica_id for p in quorum.participants
                    if (g := self._groups.get(p.replica_id)) is None
                    or group_health(g, now, self._options) is not Health.LIVE
                )  # fmt: skip
                cached = self._lost_cache = (quorum.quorum_id, self._lost_version, lost)
            return (quorum.quorum_id, cached[2]) if cached[2] else None

    def superseded_for(self, replica_id: str) -> int | None:
        """For the answer to ``replica_id``'s heartbeat: the current quorum's id when the group was in
        a quorum before but is not a participant of the current one, else None. Why: a group that
        was stopped while its peers went on (they aborted their step and formed the next quorum
        without it) resumes inside a collective of a quorum nobody else uses any more; told so, it
        aborts that step at once instead of at its collective timeout. O(1)."""
        with self._lock:
            quorum, info = self._quorum, self._info.get(replica_id)
            if quorum is None or info is None or not info.in_a_quorum or replica_id in self._prev_ids:
                return None
            return quorum.quorum_id
