"""Who belongs to the job, and when a quorum forms: the lighthouse's bookkeeping, without HTTP.

`Membership` keeps the replica groups (liveness, step, history), the quorum requests waiting for a
quorum, and the evictions not yet told. After every event (a request, a heartbeat, a lost
connection, a failure report, an eviction, a leave, a tick) it asks the pure
`ftlaunch.lighthouse.quorum.decide_quorum` whether a quorum forms, and if it does, resolves the
waiting requests' `QuorumTicket`s. How an answer reaches a group is not its business: a ticket is
resolved once, with a `Quorum` or a `MembershipError`, and calls back whoever waits on it.

It knows no status codes and no sockets: refusals are the small domain errors of `tickets` (re-exported
here), which ``routes.py`` maps to HTTP. The hot-spare glue (`membership_spares`) and the status and
progress reports (`membership_status`) and the adoption of a restarted lighthouse's resume reports
(`membership_resume`) are mixed in from modules of their own. Every method is thread-safe (one lock): the transport calls it from its
event loop, a supervisor from its own threads (`report_failure`, `snapshot`). The clocks are
injectable, so unit tests drive it in one process without sleeping (tests/test_lighthouse_membership.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

from ftlaunch.lighthouse.membership_admit import AdmitMixin
from ftlaunch.lighthouse.membership_hung import HungMixin
from ftlaunch.lighthouse.membership_resume import ResumeMixin
from ftlaunch.lighthouse.membership_spares import SparesMixin
from ftlaunch.lighthouse.membership_status import ADOPTED, GroupInfo, StatusMixin
from ftlaunch.lighthouse.progress import ProgressBook, ProgressReport
from ftlaunch.lighthouse.protocol import ANONYMOUS, advised_heartbeat_interval
from ftlaunch.lighthouse.quorum import (
    Connection,
    GroupState,
    LighthouseState,
    Quorum,
    QuorumIdAllocator,
    QuorumMember,
    QuorumOptions,
    decide_quorum,
    may_form,
)
from ftlaunch.lighthouse.spares import SpareSlots
from ftlaunch.lighthouse.status import HistoryEvent
from ftlaunch.lighthouse.tickets import (
    Abandoned,
    Evicted,
    HeldElsewhere,
    ImplausibleStep,
    Left,
    MembershipError,
    QuorumTicket,
    QuorumTimeout,
    ShuttingDown,
    Superseded,
    TooManyGroups,
    TrainingFinished,
)

# The tickets and domain errors are part of this module's interface (routes.py, tests import them here).
__all__ = [
    "ADOPTED",
    "ANONYMOUS",
    "Abandoned",
    "Evicted",
    "HeldElsewhere",
    "ImplausibleStep",
    "Left",
    "MAX_GROUPS",
    "Membership",
    "MembershipError",
    "QuorumTicket",
    "QuorumTimeout",
    "ShuttingDown",
    "Superseded",
    "TooManyGroups",
    "TrainingFinished",
]

log = logging.getLogger(__name__)

#: Events kept for the dashboard / status.
HISTORY_LEN = 200
#: Most replica ids tracked at once; a new id past it is refused (`TooManyGroups`) once every id that
#: may be forgotten (see `forget_after`) was.
MAX_GROUPS = 4096
#: How often the tick looks for ids to forget (seconds); they are forgotten `forget_after` (>= 60 s) after
#: they were last live, so a look per tick (0.1 s) only walked every id ten times a second for nothing.
FORGET_CHECK_EVERY = 1.0

# The highest quorum id any lighthouse in this process handed out: one started in the same
# millisecond as its predecessor (tests do that) still starts above it.
_last_issued_id = 0
_ids_lock = threading.Lock()


def _new_ids(wall_clock: Callable[[], float]) -> QuorumIdAllocator:
    with _ids_lock:
        return QuorumIdAllocator(int(wall_clock() * 1000), floor=_last_issued_id)


class Membership(AdmitMixin, SparesMixin, StatusMixin, ResumeMixin, HungMixin):
    """The replica groups of one lighthouse and their quorum requests (see the module docstring)."""

    def __init__(
        self,
        options: QuorumOptions,
        *,
        ids: QuorumIdAllocator | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        forget_after: float | None = None,
        max_groups: int = MAX_GROUPS,
        startup_grace: float = 0.0,
    ) -> None:
        self._options = options
        #: Seconds an id that never joined a quorum is kept once it is no longer live (silent,
        #: disconnected, failed): max(60 s, 4 x heartbeat_timeout) unless given.
        self.forget_after = (
            forget_after if forget_after is not None else max(60.0, 4 * options.heartbeat_timeout)
        )
        self.max_groups = max_groups
        self._next_forget = -math.inf
        self._clock = clock
        self._wall = wall_clock
        self._ids = ids if ids is not None else _new_ids(wall_clock)
        self._lock = threading.Lock()
        self._groups: dict[str, GroupState] = {}
        self._info: dict[str, GroupInfo] = {}
        self._requests: dict[str, QuorumMember] = {}
        self._tickets: dict[str, QuorumTicket] = {}
        self._round_start: float | None = None
        self._quorum: Quorum | None = None
        #: The newest quorum groups reported from a previous lighthouse, until this one forms its own.
        self._adopted: Quorum | None = None
        self._prev_ids: frozenset[str] = frozenset()
        #: Members of the previous quorum (or the adopted one) with no pending request; None: to be
        #: recounted. Kept as requests come and go, so `may_form` checks the fast path in O(1): a
        #: scan of the previous quorum per request made a round of N requests O(N^2).
        self._prev_missing: set[str] | None = None
        self._prev_broken = False
        self._state_cache: LighthouseState | None = None  # see _state
        #: Bumped whenever a member of the current quorum goes down or comes back (`lost_in_quorum`).
        self._lost_version = 0
        self._lost_cache: tuple[int, int, tuple[str, ...]] | None = None  # (quorum id, version, lost)
        self._high_step: int | None = None  # the highest step of any quorum formed (see _check_step)
        self._evicted: dict[str, str] = {}  # replica id -> reason, until the group is told
        self._history: deque[HistoryEvent] = deque(maxlen=HISTORY_LEN)
        self._closed = False
        #: The slot table of a job with hot spares, created by the first claim (see `claim`).
        self._spares: SpareSlots | None = None
        # Training progress the group leaders report (lighthouse/progress.py); outlives the groups.
        self._progress = ProgressBook()
        self._quorum_changes = 0
        self._kills: dict[str, str] = {}  # replica id -> reason, until its next heartbeat
        self._blocked: dict[str, tuple[int, float]] = {}  # who waits in a collective (membership_hung)
        self._pace_cache: tuple[int, float | None] = (-1, None)  # (groups, the pace advised for them)
        #: A restarted lighthouse forms its first quorum from the groups' resume reports; until this
        #: time (and without a report) it forms none, so that groups that held the job's state are
        #: back before a fresh group could start a quorum of its own from step 0.
        self._grace_until = clock() + startup_grace

    @property
    def options(self) -> QuorumOptions:
        return self._options

    @property
    def group_count(self) -> int:
        """Replica ids tracked now (what the advised heartbeat pace scales with)."""
        return len(self._groups)

    def advised_pace(self) -> float | None:
        """The heartbeat pace advised to the groups now (`protocol.advised_heartbeat_interval`; None:
        none), computed once per group count: the heartbeat answers carry it, and the hung rule's
        silence limit is several of it (`membership_hung`). Any thread: a racing recount gives the
        same value."""
        count = len(self._groups)
        cached = self._pace_cache
        if cached[0] != count:
            cached = self._pace_cache = (
                count,
                advised_heartbeat_interval(count, self._options.heartbeat_timeout),
            )
        return cached[1]

    # ------------------------------------------------------------------ what groups do

    def request_quorum(
        self, member: QuorumMember, progress: ProgressReport | None = None, *, incarnation: str = ANONYMOUS
    ) -> QuorumTicket:
        """Park ``member``'s request until a quorum containing it forms (maybe at once).

        Counts as a heartbeat (and ``progress``, when given, as the group's progress report). A
        request of the same group still waiting is answered `Superseded`. Raises `ShuttingDown`,
        `Evicted` (once), `HeldElsewhere` (another live ``incarnation`` holds the id),
        `ImplausibleStep` or `TooManyGroups` instead of parking.
        """
        rid = member.replica_id
        with self._lock:
            now = self._clock()
            self._check_step(member)
            self._admit(rid, now, incarnation)
            member = self._take_resume_report(member, now)
            self._report_progress(rid, progress)
            info = self._info[rid]
            info.step, info.address = member.step, member.address
            old = self._tickets.get(rid)
            if old is not None:
                old._resolve(error=Superseded(f"superseded by a newer quorum request of replica {rid}"))
            ticket = QuorumTicket(member)
            self._tickets[rid] = ticket
            self._requests[rid] = member
            if self._prev_missing is not None:
                self._prev_missing.discard(rid)
            if self._round_start is None:
                self._round_start = now
            self._decide(now)
        return ticket

    def heartbeat(
        self,
        replica_id: str,
        progress: ProgressReport | None = None,
        *,
        incarnation: str = ANONYMOUS,
        blocked: tuple[int, float] | None = None,
        resume: object = None,
    ) -> str | None:
        """A sign of life (revives a silent, disconnected or failed group), maybe with a progress
        report, ``blocked``: (quorum id, seconds) its step has waited in a collective of that
        quorum (`membership_hung`: a silent peer is then declared lost sooner), and ``resume``: a
        resume report, adopted like one on a quorum request while this lighthouse formed no quorum
        (groups stepping on their last quorum through an outage may all be blocked in a step with a
        stopped member, and ask for no quorum: `membership_hung` then needs the quorum from here).
        Returns the reason of a pending `kill` (once), else None. Raises `ShuttingDown`, `Evicted`
        once, `HeldElsewhere` or `TooManyGroups`."""
        with self._lock:
            now = self._clock()
            if not self._closed:
                self._note_beat(replica_id, now, blocked)
            revived = self._admit(replica_id, now, incarnation)
            self._info[replica_id].heartbeats += 1
            self._report_progress(replica_id, progress)
            adopted = (
                resume is not None
                and self._quorum is None
                and self.adopt_resume_report(replica_id, resume, now)
            )
            if (revived and replica_id in self._requests) or (adopted and self._requests):
                self._decide(now)
            if blocked is not None:
                self._declare_hung(now)
            return self._kills.pop(replica_id, None)

    def leave(
        self, replica_id: str, progress: ProgressReport | None = None, *, incarnation: str | None = None
    ) -> bool:
        """Graceful exit: forget the group without a failure; its waiting request ends `Left`.
        ``progress`` is its final report (kept: progress outlives the group). Returns False if the
        group was not known. With ``incarnation``, raises `HeldElsewhere` when another live
        incarnation holds the id (a stale process cannot make the group leave)."""
        with self._lock:
            if incarnation is not None:
                self._check_holder(replica_id, self._clock(), incarnation)
            if not self._closed:
                self._report_progress(replica_id, progress)
            self._kills.pop(replica_id, None)
            self._evicted.pop(replica_id, None)
            known = self._groups.pop(replica_id, None) is not None
            self._info.pop(replica_id, None)
            self._drop_request(replica_id, error=Left(f"replica {replica_id} left"))
            if self._spares is not None:
                self._spares.left(replica_id)
            if known:
                self._record("left", replica_id)
                self._mark_prev_broken(replica_id)
                log.info("lighthouse: replica %s left", replica_id)
                self._decide(self._clock())
            return known

    # ------------------------------------------------------------------ what others say about groups

    def connection_lost(self, replica_id: str) -> None:
        """The group's last bound connection was closed by its peer without a leave: it died."""
        with self._lock:
            if not self._closed:
                self._mark_down(replica_id, Connection.DISCONNECTED, "connection closed without leave")

    def report_failure(self, replica_id: str, reason: str) -> bool:
        """Mark a group failed at once. Returns False (and records it) if the group is unknown."""
        with self._lock:
            if replica_id not in self._groups:
                self._record("failure_report", replica_id, f"unknown replica: {reason}")
                log.warning("lighthouse: failure reported for unknown replica %s: %s", replica_id, reason)
                return False
            self._mark_down(replica_id, Connection.FAILED, reason)
            return True

    def evict(self, replica_id: str, reason: str) -> bool:
        """Drop a group; its waiting request, or else its next request, learns it (`Evicted`, once).
        Returns False if the group is unknown."""
        with self._lock:
            if replica_id not in self._groups:
                return False
            del self._groups[replica_id]
            info = self._info.pop(replica_id, None)
            if info is not None:
                self._count_down(replica_id, info)
            error = Evicted(f"replica {replica_id} was evicted: {reason}")
            if not self._drop_request(replica_id, error=error):  # the parked request is its one notice
                self._evicted[replica_id] = reason
            self._record("evicted", replica_id, reason)
            self._mark_prev_broken(replica_id)
            log.warning("lighthouse: replica %s evicted: %s", replica_id, reason)
            self._decide(self._clock())
            return True

    # ------------------------------------------------------------------ what time and the transport do

    def expire(self, ticket: QuorumTicket, timeout: float) -> None:
        """The request's own timeout passed: withdraw it and answer `QuorumTimeout` saying why."""
        rid = ticket.member.replica_id
        with self._lock:
            if ticket.done:
                return
            reason = self._waiting_reason(self._clock())
            self._drop_request(
                rid, ticket, QuorumTimeout(f"no quorum containing {rid} within {timeout:g}s: {reason}")
            )

    def abandon(self, ticket: QuorumTicket) -> None:
        """Nobody waits for the answer any more (the connection closed): withdraw the request."""
        with self._lock:
            self._drop_request(ticket.member.replica_id, ticket, Abandoned("the requester went away"))

    def tick(self) -> None:
        """What only the passage of time changes: heartbeat expiry and the join timeout."""
        hb = self._options.heartbeat_timeout
        with self._lock:
            now = self._clock()
            self._declare_hung(now)
            for rid, g in self._groups.items():
                info = self._info[rid]
                if g.connection is Connection.CONNECTED and now - g.last_seen > hb and not info.silent_noted:
                    info.silent_noted = True
                    info.reason = f"no heartbeat for {hb:g}s"
                    self._count_down(rid, info)
                    self._record("silent", rid, info.reason)
                    self._mark_prev_broken(rid)
                    log.warning("lighthouse: replica %s silent: %s", rid, info.reason)
            if self._spares is not None:
                self._spares.forget_idle(now, hb)
            if (
                now >= self._next_forget
            ):  # a walk of every id: once a second is soon enough (forget_after >= 60 s)
                self._next_forget = now + FORGET_CHECK_EVERY
                self._forget_gone(now)
            self._decide(now)

    def close(self) -> None:
        """Refuse everything from now on (`ShuttingDown`), answering every waiting request so."""
        with self._lock:
            self._closed = True
            if self._spares is not None:
                self._spares.close(ShuttingDown("lighthouse shutting down"))
            for rid in list(self._tickets):
                self._drop_request(rid, error=ShuttingDown("lighthouse shutting down"))

    # ------------------------------------------------------------------ under the lock

    def _record(
        self, event: str, replica_id: str | None, detail: str = "", quorum: Quorum | None = None
    ) -> None:
        self._history.append(
            HistoryEvent(
                time=self._wall(),
                event=event,
                replica_id=replica_id,
                detail=detail,
                quorum_id=quorum.quorum_id if quorum is not None else None,
                participants=quorum.replica_ids if quorum is not None else None,
            )
        )

    def _mark_prev_broken(self, replica_id: str) -> None:
        if replica_id in self._prev_ids:
            self._prev_broken = True
            self._lost_version += 1

    def _prev_ids_now(self) -> frozenset[str]:
        """The ids of the quorum the next one is compared with (this lighthouse's, or the adopted one:
        `adopt_resume_report` sets them too)."""
        return self._prev_ids

    def _state(self) -> LighthouseState:
        # A view, not a copy: only used under the lock, and the decision functions do not mutate.
        adopted = self._quorum is None and self._adopted is not None
        prev = self._adopted if adopted else self._quorum
        if prev is not None and self._prev_missing is None:  # once per quorum (and per adoption)
            self._prev_missing = {rid for rid in prev.replica_ids if rid not in self._requests}
        missing = self._prev_missing if prev is not None else None
        # Whether an adopted quorum's members are the same incarnations is unknown: new id.
        broken = self._prev_broken or adopted
        next_id = self._ids.peek()
        # The same view serves every request of a round (its mappings and its set are the live
        # ones, compared by identity): it is made again only when another of its fields changed.
        state = self._state_cache
        if (
            state is not None and state.prev_missing is missing and state.prev_quorum is prev
            and state.round_start == self._round_start and state.prev_quorum_broken == broken
            and state.next_quorum_id == next_id and state.groups is self._groups and state.requests is self._requests
        ):  # fmt: skip
            return state
        state = self._state_cache = LighthouseState(
            groups=self._groups,
            requests=self._requests,
            round_start=self._round_start,
            prev_quorum=prev,
            prev_quorum_broken=broken,
            next_quorum_id=next_id,
            prev_missing=missing,
        )
        return state

    def _waiting_reason(self, now: float) -> str:
        if not self._requests:
            return "no pending quorum requests"
        if self._quorum is None and self._adopted is None and now < self._grace_until:
            return f"restarted: waiting {self._grace_until - now:.1f}s more for the groups' resume reports"
        return decide_quorum(self._state(), now, self._options).reason

    def _decide(self, now: float) -> None:
        """Recompute the decision after an event; form the quorum and resolve its members if due."""
        if self._spares is not None:
            self._reconcile_spares(now)
        if not self._requests:
            return
        if self._quorum is None and self._adopted is None and now < self._grace_until:
            return  # a restarted lighthouse waits for resume reports (see __init__)
        state = self._state()
        if not may_form(state, now, self._options):  # O(1) on most arrivals; see may_form
            return
        decision = decide_quorum(state, now, self._options)
        if not decision.formed:
            return
        if decision.participants is not None and self._refuse_behind_finished(decision.participants):
            self._decide(now)  # the others may form now (each round refuses one request or more)
            return
        if decision.new_id:
            global _last_issued_id
            with _ids_lock:
                self._ids.take()
                _last_issued_id = max(_last_issued_id, decision.quorum_id or 0)
        quorum = decision.to_quorum(created=self._wall())
        top = max(p.step for p in quorum.participants)
        self._high_step = top if self._high_step is None else max(self._high_step, top)
        rewind = self._progress.quorum_formed(top, self._wall())
        if rewind is not None:
            self._record("rewind", None, f"step {rewind.reached} -> {rewind.restarted_at}", None)
            log.warning(
                "lighthouse: progress lost: quorum at step %d after the job had reached step %d "
                "(no group holding that state is left)", rewind.restarted_at, rewind.reached,
            )  # fmt: skip
        changed = self._quorum is None or quorum.quorum_id != self._quorum.quorum_id
        self._quorum = quorum
        self._prev_missing = None
        self._prev_ids = frozenset(quorum.replica_ids)
        self._prev_broken = False
        requests, tickets, infos = self._requests, self._tickets, self._info
        for member in quorum.participants:
            rid = member.replica_id
            del requests[rid]
            info = infos[rid]
            info.step, info.in_a_quorum = member.step, True
            tickets.pop(rid)._resolve(quorum=quorum)
        self._round_start = now if self._requests else None
        if changed:
            self._quorum_changes += 1
            self._record("quorum", None, decision.reason, quorum)
            log.info(
                "lighthouse: quorum %d formed with %s (%s)",
                quorum.quorum_id,
                ", ".join(quorum.replica_ids),
                decision.reason,
            )
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("lighthouse: quorum %d re-formed (%s)", quorum.quorum_id, decision.reason)

    def _drop_request(
        self, rid: str, ticket: QuorumTicket | None = None, error: MembershipError | None = None
    ) -> bool:
        """Withdraw ``rid``'s waiting request (only if it is ``ticket``, when given) and answer it
        ``error``. Returns True if there was one."""
        current = self._tickets.get(rid)
        if current is None or (ticket is not None and current is not ticket):
            return False
        del self._tickets[rid], self._requests[rid]
        if self._prev_missing is not None and rid in self._prev_ids_now():
            self._prev_missing.add(rid)
        if not self._requests:
            self._round_start = None
        current._resolve(error=error)
        return True

    def _mark_down(self, rid: str, connection: Connection, reason: str) -> None:
        g = self._groups.get(rid)
        if g is None or g.connection is connection:
            return
        self._groups[rid] = GroupState(rid, g.last_seen, connection)
        self._info[rid].reason = reason
        self._count_down(rid, self._info[rid])
        self._record(connection.value, rid, reason)
        self._mark_prev_broken(rid)
        log.warning("lighthouse: replica %s %s: %s", rid, connection.value, reason)
        self._decide(self._clock())
