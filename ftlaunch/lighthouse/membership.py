"""Who belongs to the job, and when a quorum forms: the lighthouse's bookkeeping, without HTTP.

`Membership` is what the endpoints (``routes.py``) and the supervisor call: a group's quorum
request, heartbeat and leave, a lost connection, a failure report, an eviction, a claim for a
hot-spare slot, a kill request, the tick of time, the status. It holds the collaborators that keep
the lighthouse's state, each the only writer of its own:

- `roster.Roster`: the groups (liveness, step, incarnation, heartbeat pace, kill requests);
- `round.QuorumRound`: the parked quorum requests and the quorum they are compared with;
- `admission.Admission`: the evictions not yet told, the highest step of any quorum;
- `hung.HungWatch`: which members report their step blocked in a collective;
- `spares.SpareSlots`: the slot table of a job with hot spares (created by the first claim);
- `progress.ProgressBook`: the training progress the group leaders report;
- `stragglers.StragglerWatch`: each member's compute times, the slow ones, their replacements;
- `health.HealthBook`: what each group's agent reported of its health check before it (re)joined;

and keeps two things of its own: the history of events (for the status) and the quorum ids. After
every event it asks the pure rules what should happen -- `admission.refusal` and `arrival`, the
quorum decision (`quorum.decide_quorum`), `hung.hung_members`, `resume.adoption`,
`roster.forgettable`, the slot rule (`slots.assign`, through the table), the straggler rule
(`stragglers.judge`, `stragglers.to_replace`) -- and applies the answer
to the collaborators, records it and logs it. So what changes the state is read here; what the
rules are is read in their modules.

A quorum request is a `QuorumTicket`, resolved once with a `Quorum` or a `MembershipError` (the
small domain errors of ``tickets.py``, re-exported here), which ``routes.py`` maps to HTTP; it knows
no status codes and no sockets. Every method is thread-safe (one lock): the transport calls it from
its event loop, a supervisor from its own threads (`report_failure`, `snapshot`). The clocks are
injectable, so unit tests drive it in one process without sleeping (tests/unit/test_lighthouse_membership.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

from ftlaunch.lighthouse.admission import (
    Admission,
    Arrival,
    arrival,
    held_elsewhere,
    implausible_step,
    refusal,
)
from ftlaunch.lighthouse.health import FAILING, HealthBook, HealthReport
from ftlaunch.lighthouse.hung import HungWatch, hung_members, left_behind, silence_limit
from ftlaunch.lighthouse.progress import GroupProgress, ProgressBook, ProgressReport, Rewind
from ftlaunch.lighthouse.protocol import ANONYMOUS, advised_heartbeat_interval
from ftlaunch.lighthouse.quorum import (
    Connection,
    Health,
    Quorum,
    QuorumIdAllocator,
    QuorumMember,
    QuorumOptions,
    decide_quorum,
    group_health,
    may_form,
)
from ftlaunch.lighthouse.resume import adoption, take_resume_report
from ftlaunch.lighthouse.roster import ADOPTED, Roster, forgettable, newly_silent, slot_holder
from ftlaunch.lighthouse.round import QuorumRound
from ftlaunch.lighthouse.slots import Holder
from ftlaunch.lighthouse.spares import ClaimTicket, SpareSlots
from ftlaunch.lighthouse.status import (
    GroupStatus,
    HistoryEvent,
    LighthouseStatus,
    ReplacedStatus,
    SlotStatus,
    SparesStatus,
    SpareStatus,
    StatusOptions,
    StragglersStatus,
    StragglerStatus,
)
from ftlaunch.lighthouse.stragglers import (
    REPLACE,
    REPORT,
    STRAGGLER_REASON,
    Standing,
    StragglerRule,
    StragglerWatch,
    to_replace,
)
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


class Membership:
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
        stragglers: str = REPORT,
        straggler_rule: StragglerRule | None = None,
    ) -> None:
        """``stragglers``: the policy for slow groups (lighthouse/stragglers.py), ``report`` (show
        them) or ``replace`` (also replace persistent ones); ``straggler_rule``: its thresholds."""
        self._options = options
        #: Seconds an id that never joined a quorum is kept once it is no longer live (silent,
        #: disconnected, failed): max(60 s, 4 x heartbeat_timeout) unless given.
        self.forget_after = (
            forget_after if forget_after is not None else max(60.0, 4 * options.heartbeat_timeout)
        )
        self.max_groups = max_groups
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.Lock()
        self._roster = Roster(options)
        self._round = QuorumRound()
        self._admission = Admission()
        self._hung = HungWatch()
        #: The slot table of a job with hot spares, created by the first claim (see `claim`).
        self._spares: SpareSlots | None = None
        # Training progress the group leaders report (lighthouse/progress.py); outlives the groups.
        self._progress = ProgressBook()
        # Slow groups, judged from the compute times of those reports (lighthouse/stragglers.py).
        self._stragglers = StragglerWatch(stragglers, straggler_rule)
        # Health checks the groups' agents ran before (re)joining (lighthouse/health.py).
        self._health = HealthBook()
        self._ids = ids if ids is not None else _new_ids(wall_clock)
        self._history: deque[HistoryEvent] = deque(maxlen=HISTORY_LEN)
        self._closed = False
        self._next_forget = -math.inf
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
        return len(self._roster.groups)

    def advised_pace(self) -> float | None:
        """The heartbeat pace advised to the groups now (`protocol.advised_heartbeat_interval`; None:
        none), computed once per group count: the heartbeat answers carry it, and the hung rule's
        silence limit is several of it. Any thread: a racing recount gives the same value."""
        count = len(self._roster.groups)
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
            implausible = implausible_step(member, self._admission.high_step, self._round.current)
            if implausible is not None:
                raise implausible
            self._admit(rid, now, incarnation, beat=False)
            member, report = take_resume_report(member)
            if report is not None and self._round.current is None:
                self._adopt(rid, report, now)
            self._report_progress(rid, progress)
            self._roster.note_request(rid, member.step, member.address)
            ticket = self._round.park(member, now)
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
        quorum (lighthouse/hung.py: a silent peer is then declared lost sooner), and ``resume``: a
        resume report, adopted like one on a quorum request while this lighthouse formed no quorum
        (groups stepping on their last quorum through an outage may all be blocked in a step with a
        stopped member, and ask for no quorum: the hung rule then needs the quorum from here).
        Returns the reason of a pending `kill` (once), else None. Raises `ShuttingDown`, `Evicted`
        once, `HeldElsewhere` or `TooManyGroups`."""
        with self._lock:
            now = self._clock()
            if not self._closed:
                self._roster.learn_gap(replica_id, now)
                self._hung.report(replica_id, now, blocked)
            revived = self._admit(replica_id, now, incarnation, beat=True)
            self._report_progress(replica_id, progress)
            adopted = (
                resume is not None and self._round.current is None and self._adopt(replica_id, resume, now)
            )
            if (revived and replica_id in self._round.requests) or (adopted and self._round.requests):
                self._decide(now)
            if blocked is not None:
                self._declare_hung(now)
            return self._roster.take_kill(replica_id)

    def leave(
        self, replica_id: str, progress: ProgressReport | None = None, *, incarnation: str | None = None
    ) -> bool:
        """Graceful exit: forget the group without a failure; its waiting request ends `Left`.
        ``progress`` is its final report (kept: progress outlives the group). Returns False if the
        group was not known. With ``incarnation``, raises `HeldElsewhere` when another live
        incarnation holds the id (a stale process cannot make the group leave)."""
        with self._lock:
            if incarnation is not None:
                info = self._roster.infos.get(replica_id)
                held = held_elsewhere(
                    replica_id,
                    self._roster.groups.get(replica_id),
                    info.incarnation if info is not None else None,
                    incarnation,
                    self._clock(),
                    self._options,
                )
                if held is not None:
                    raise held
            if not self._closed:
                self._report_progress(replica_id, progress)
            self._admission.clear(replica_id)
            known = self._roster.remove(replica_id)
            self._round.withdraw(replica_id, error=Left(f"replica {replica_id} left"))
            if self._spares is not None:
                self._spares.left(replica_id)
            if known:
                self._record("left", replica_id)
                self._round.member_changed(replica_id)
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
            if replica_id not in self._roster.groups:
                self._record("failure_report", replica_id, f"unknown replica: {reason}")
                log.warning("lighthouse: failure reported for unknown replica %s: %s", replica_id, reason)
                return False
            self._mark_down(replica_id, Connection.FAILED, reason)
            return True

    def report_health(self, replica_id: str, report: HealthReport) -> None:
        """A group's agent ran its health check (before the group's workers start or restart):
        remembered for the status; the history records when a group's check starts failing and
        when it passes again. Nothing else changes: a group kept out by its check simply does not
        ask for a quorum, so the others go on without it."""
        with self._lock:
            change = self._health.report(replica_id, report, self._wall())
            if change == FAILING:
                detail = f"{report.check}: {report.last_line}" if report.last_line else report.check
                self._record(change, replica_id, detail)
                log.warning("lighthouse: replica %s kept out by its health check: %s", replica_id, detail)
            elif change is not None:
                entry = self._health.entry(replica_id)
                failed = entry.failures if entry is not None else 0
                self._record(change, replica_id, f"{report.check} passed ({failed} failure(s) in all)")
                log.info("lighthouse: replica %s passed its health check", replica_id)

    def evict(self, replica_id: str, reason: str) -> bool:
        """Drop a group; its waiting request, or else its next request, learns it (`Evicted`, once).
        Returns False if the group is unknown."""
        with self._lock:
            if replica_id not in self._roster.groups:
                return False
            self._count_down(replica_id)
            self._roster.remove(replica_id)
            error = Evicted(f"replica {replica_id} was evicted: {reason}")
            if not self._round.withdraw(replica_id, error=error):  # the parked request is its one notice
                self._admission.evict(replica_id, reason)
            self._record("evicted", replica_id, reason)
            self._round.member_changed(replica_id)
            log.warning("lighthouse: replica %s evicted: %s", replica_id, reason)
            self._decide(self._clock())
            return True

    def kill(self, replica_id: str, reason: str) -> bool:
        """Tell the group's leader, in the answer to its next heartbeat, to kill its own process
        (the dashboard's Kill button: a crash on demand). False if the group is unknown."""
        with self._lock:
            if not self._roster.request_kill(replica_id, reason):
                return False
            self._record("kill_requested", replica_id, reason)
            log.warning("lighthouse: replica %s asked to kill itself: %s", replica_id, reason)
            return True

    # ------------------------------------------------------------------ hot spares (lighthouse/spares.py)

    def claim(self, claimant: str, *, slots: int, preferred: int | None) -> ClaimTicket:
        """Park ``claimant``'s claim for one of the job's ``slots`` replica-group slots (maybe
        answered at once). The first claim creates the slot table. Raises `ShuttingDown`, or
        `ClaimError` when ``slots`` differs from the table's."""
        with self._lock:
            if self._closed:
                raise ShuttingDown("lighthouse shutting down")
            now = self._clock()
            if self._spares is None:
                opts = self._options
                self._spares = SpareSlots(
                    slots,
                    started=now,
                    arrival_grace=opts.heartbeat_timeout,
                    unclaimed_grace=opts.join_timeout,
                )
            ticket = self._spares.claim(claimant, preferred, slots, now)
            self._decide(now)
        return ticket

    def end_claim(self, ticket: ClaimTicket, *, timed_out: bool) -> None:
        """A claim's poll ended unanswered: its timeout passed (``timed_out``; the spare asks
        again) or its connection closed (the spare is gone, unless another rank still waits)."""
        with self._lock:
            if self._spares is not None and not ticket.done:
                self._spares.withdraw(ticket, self._clock(), timed_out=timed_out)

    # ------------------------------------------------------------------ what time and the transport do

    def expire(self, ticket: QuorumTicket, timeout: float) -> None:
        """The request's own timeout passed: withdraw it and answer `QuorumTimeout` saying why."""
        rid = ticket.member.replica_id
        with self._lock:
            if ticket.done:
                return
            reason = self._waiting_reason(self._clock())
            self._round.withdraw(
                rid, ticket, QuorumTimeout(f"no quorum containing {rid} within {timeout:g}s: {reason}")
            )

    def abandon(self, ticket: QuorumTicket) -> None:
        """Nobody waits for the answer any more (the connection closed): withdraw the request."""
        with self._lock:
            self._round.withdraw(ticket.member.replica_id, ticket, Abandoned("the requester went away"))

    def tick(self) -> None:
        """What only the passage of time changes: heartbeat expiry and the join timeout."""
        hb = self._options.heartbeat_timeout
        with self._lock:
            now = self._clock()
            self._declare_hung(now)
            if self._stragglers.due(now):
                self._judge_stragglers(now)
            roster = self._roster
            for rid in newly_silent(roster.groups, roster.infos, now, hb):
                reason = f"no heartbeat for {hb:g}s"
                roster.note_silent(rid, reason)
                self._count_down(rid)
                self._record("silent", rid, reason)
                self._round.member_changed(rid)
                log.warning("lighthouse: replica %s silent: %s", rid, reason)
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
            for rid in list(self._round.requests):
                self._round.withdraw(rid, error=ShuttingDown("lighthouse shutting down"))

    # ------------------------------------------------------------------ heartbeat answers

    def lost_in_quorum(self, replica_id: str) -> tuple[int, tuple[str, ...]] | None:
        """For the answer to ``replica_id``'s heartbeat: when it is a participant of the current
        quorum and some of that quorum's participants are no longer live here (silent, disconnected,
        failed, evicted, left), the quorum's id and theirs; else None.

        Why: a participant that hangs (SIGSTOP, a hung host) keeps its sockets open, so its peers'
        collectives with it wait out the collective timeout, while the lighthouse knows within its
        heartbeat timeout. Told in the answer to the heartbeats they send anyway, the live
        participants abort the quorum's step at once (worker/hang_abort.py). A member that is slow
        but still beats is live: never in the list. Before this lighthouse formed a quorum, the
        quorum it adopted from resume reports counts as the current one (its members step on it
        through the outage, worker/outage.py). O(1) while the quorum is whole (`QuorumRound.lost_in_quorum`).
        """
        with self._lock:
            return self._round.lost_in_quorum(replica_id, self._roster.groups, self._clock, self._options)

    def superseded_for(self, replica_id: str) -> int | None:
        """For the answer to ``replica_id``'s heartbeat: the current quorum's id when the group was in
        a quorum before but is not a participant of the current one, else None. Why: a group that
        was stopped while its peers went on (they aborted their step and formed the next quorum
        without it) resumes inside a collective of a quorum nobody else uses any more; told so, it
        aborts that step at once instead of at its collective timeout. O(1)."""
        with self._lock:
            info = self._roster.infos.get(replica_id)
            return self._round.superseded_for(replica_id, info is not None and info.in_a_quorum)

    def left_behind(self, replica_id: str) -> tuple[int, tuple[str, ...]] | None:
        """For the answer to ``replica_id``'s blocked heartbeat: the quorum id and the participants
        that left the step it waits in (`hung.left_behind`), else None."""
        with self._lock:
            g = self._roster.groups.get(replica_id)
            return left_behind(
                replica_id,
                self._round.watched()[0],
                self._hung.blocked.get(replica_id),
                g.last_seen if g is not None else None,
                self._round.requests,
                self._round.start,
                self._clock(),
            )

    def silence_limit(self, replica_id: str) -> float:
        """How long ``replica_id``'s heartbeats must have stopped to count as evidence that it is hung
        (`hung.silence_limit` of its usual heartbeat gap and the pace advised now)."""
        with self._lock:
            info = self._roster.infos.get(replica_id)
            return silence_limit(info.beat_gap if info is not None else 0.0, self.advised_pace())

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
            quorum, requests = self._round.current, self._round.requests
            members = set(quorum.replica_ids) if quorum else set()
            groups, infos = self._roster.groups, self._roster.infos
            statuses = tuple(
                GroupStatus(
                    replica_id=rid,
                    health=group_health(g, now, opts),
                    step=info.step,
                    address=info.address,
                    last_seen_age=round(now - g.last_seen, 4),
                    heartbeat_timeout=hb,
                    connections=connections(rid),
                    requesting=rid in requests,
                    in_quorum=rid in members,
                    heartbeats=info.heartbeats,
                    reason=info.reason,
                    first_seen=info.first_seen,
                )
                for rid, g, info in ((rid, groups[rid], infos[rid]) for rid in sorted(groups))
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
                quorum=quorum,
                next_quorum_id=self._ids.peek(),
                groups=statuses,
                pending=tuple(sorted(requests)),
                decision=self._waiting_reason(now),
                evicted=tuple(sorted(self._admission.evicted)),
                history=tuple(reversed(self._history)),
                spares=self._spares_status(now),
                progress=self._progress.snapshot(wall),
                quorum_changes=self._round.changes,
                step_rate=round(self._progress.job_step_rate(wall), 4),
                stragglers=self._stragglers_status(),
                rewinds=self._progress.rewinds(),
                health=self._health.snapshot(),
            )

    def stragglers(self) -> StragglersStatus:
        """The straggler verdicts and replacements (cheaper than `snapshot`: the launcher reads it
        with the progress)."""
        with self._lock:
            return self._stragglers_status()

    def progress(self) -> tuple[GroupProgress, ...]:
        """Every group's training progress, groups that left or died included (cheaper than
        `snapshot`: the launcher reads it every tick)."""
        with self._lock:
            return self._progress.snapshot(self._wall())

    def rewinds(self) -> tuple[Rewind, ...]:
        """The times the job went back to an earlier step (`progress.Rewind`), oldest first."""
        with self._lock:
            return self._progress.rewinds()

    # ------------------------------------------------------------------ appliers (under the lock)

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

    def _report_progress(self, rid: str, progress: ProgressReport | None) -> None:
        if progress is not None:
            wall = self._wall()
            self._progress.report(rid, progress, wall)
            watch = self._stragglers
            if watch.report(rid, progress.session, progress.commits, progress.compute_seconds, wall):
                log.info("lighthouse: %s committed: the straggler replacement arrived", rid)

    def _count_down(self, rid: str) -> None:
        """A group went down: one failure per incident in the progress book."""
        if self._roster.count_down(rid):
            self._progress.failed(rid)

    def _admit(self, rid: str, now: float, incarnation: str, *, beat: bool) -> bool:
        """Admit a group's request (`admission.refusal`, raised; an eviction is told once) and count
        it as a sign of life (`admission.arrival`; ``beat``: a heartbeat). Returns True if the group
        was not live before."""
        roster = self._roster
        g = roster.groups.get(rid)
        info = roster.infos.get(rid)
        refused = refusal(
            rid,
            incarnation,
            now,
            self._options,
            closed=self._closed,
            evicted=self._admission.evicted.get(rid),
            fenced=self._spares.fenced(rid) if self._spares is not None else None,
            group=g,
            holder=info.incarnation if info is not None else None,
        )
        if refused is not None:
            if isinstance(refused, Evicted):
                self._admission.clear(rid)  # told now
            raise refused
        kind = arrival(g, now, self._options)
        if kind is Arrival.NEW:
            if len(roster.groups) >= self.max_groups:
                self._forget_gone(now, force=True)
                if len(roster.groups) >= self.max_groups:
                    raise TooManyGroups(f"the lighthouse tracks {self.max_groups} replica ids already")
            roster.join(rid, now, self._wall(), incarnation, beat=beat)
            self._record("joined", rid)
            log.info("lighthouse: replica %s joined", rid)
            self._round.member_changed(rid)
            return True
        back = kind is Arrival.BACK
        if back:
            assert g is not None
            health = group_health(g, now, self._options)
            self._record("revived", rid, f"was {health.value}")
            log.info("lighthouse: replica %s is back (was %s)", rid, health.value)
            self._round.member_changed(rid)
        roster.heard(rid, now, incarnation, back=back, beat=beat)
        return back

    def _forget_gone(self, now: float, *, force: bool = False) -> None:
        """Forget the ids `roster.forgettable` names."""
        roster = self._roster
        gone = forgettable(
            roster.groups,
            roster.infos,
            self._round.requests,
            now,
            self._options,
            self.forget_after,
            force=force,
        )
        if not gone:
            return
        roster.forget(gone)
        self._record(
            "forgotten", gone[0] if len(gone) == 1 else None, f"{len(gone)} id(s) that never joined a quorum"
        )
        log.info(
            "lighthouse: forgot %d replica id(s) that never joined a quorum (e.g. %s)", len(gone), gone[0]
        )

    def _adopt(self, reporter: str, report: object, now: float) -> bool:
        """Adopt the quorum of ``reporter``'s resume report (`resume.adoption`) while this lighthouse
        formed none: the previous quorum from now on, quorum ids above it, its members not heard
        of yet standing in. Returns whether it was adopted."""
        try:
            quorum = adoption(report, self._round.adopted, self._wall())
        except ValueError:
            log.warning("lighthouse: ignoring a malformed resume report from %s", reporter)
            return False
        if quorum is None:
            return False
        self._round.adopt(quorum)
        self._ids.ensure_above(quorum.quorum_id)
        for rid in quorum.replica_ids:
            if rid not in self._roster.groups:
                self._roster.stand_in(
                    rid, now, self._wall(), f"expected: member of quorum {quorum.quorum_id}"
                )
        detail = (
            f"adopted quorum {quorum.quorum_id} of "
            f"{len(quorum.replica_ids)} group(s) from a previous lighthouse"
        )
        self._record("resumed", reporter, detail)
        log.info("lighthouse: %s reported by %s", detail, reporter)
        return True

    def _mark_down(self, rid: str, connection: Connection, reason: str) -> None:
        if not self._roster.mark_down(rid, connection, reason):
            return
        self._count_down(rid)
        self._record(connection.value, rid, reason)
        self._round.member_changed(rid)
        log.warning("lighthouse: replica %s %s: %s", rid, connection.value, reason)
        self._decide(self._clock())

    def _declare_hung(self, now: float) -> None:
        """Mark failed the members `hung.hung_members` finds hung, while the quorum they are in is
        the one the groups step on (marking one down may form the next quorum)."""
        quorum, adopted = self._round.watched()
        if quorum is None:
            return
        hung = self._hung
        if hung.blocked:
            hung.prune(self._roster.groups)
        found = hung_members(
            quorum,
            adopted=adopted,
            groups=self._roster.groups,
            infos=self._roster.infos,
            blocked=hung.blocked,
            requests=self._round.requests,
            round_start=self._round.start,
            now=now,
            options=self._options,
            pace=self.advised_pace(),
        )
        for member in found:
            if self._round.watched()[0] is not quorum or member.replica_id not in self._roster.groups:
                continue
            if adopted:  # it was in the job's quorum: told `superseded` on waking once the others went on
                self._roster.note_in_a_quorum(member.replica_id)
            self._mark_down(member.replica_id, Connection.FAILED, member.reason(quorum.quorum_id))

    def _judge_stragglers(self, now: float) -> None:
        """Judge the members of the quorum in use (`stragglers.judge`), record who became a
        straggler or stopped being one, and with the policy ``replace`` replace a persistent one
        (`stragglers.to_replace`)."""
        watch = self._stragglers
        quorum = self._round.current
        if quorum is None:
            return
        wall = self._wall()
        became, cleared = watch.judge(quorum.replica_ids, self._roster.groups, now, wall)
        for s in became:
            detail = _slow(s)
            self._record("straggler", s.replica_id, detail)
            log.warning("lighthouse: replica %s is a straggler: %s", s.replica_id, detail)
        for s in cleared:
            self._record("straggler_cleared", s.replica_id, f"{s.slowdown:.2f}x the others' compute now")
            log.info("lighthouse: replica %s is no straggler any more (%.2fx)", s.replica_id, s.slowdown)
        if watch.policy != REPLACE:
            return
        live = [
            rid
            for rid in quorum.replica_ids
            if (g := self._roster.groups.get(rid)) is not None
            and group_health(g, now, self._options) is Health.LIVE
        ]
        chosen = to_replace(
            watch.standings, live, self._options.min_replicas, watch.busy(now), watch.rule, now
        )
        if chosen is not None:
            self._replace_straggler(chosen, now, wall)

    def _replace_straggler(self, s: Standing, now: float, wall: float) -> None:
        """Give the straggler's slot to a hot spare when one waits: it is marked failed (its peers
        abort the step they share with it, as for a hung member) and the slot rule hands the slot
        on, fencing its name. Otherwise tell it to end its process (as the dashboard's Kill does):
        its agent restarts it, and it rejoins and heals."""
        rid = s.replica_id
        reason = f"{STRAGGLER_REASON}{_slow(s)}"
        spares = self._spares
        if spares is not None and any(polls for _name, _pref, _since, polls in spares.waiting()):
            self._mark_down(rid, Connection.FAILED, reason)  # the slot rule runs: a spare takes it
            if spares.fenced(rid) is not None:
                self._stragglers.replaced(s, "spare", now, wall)
                self._record("straggler_replaced", rid, f"{reason}; its slot went to a hot spare")
                log.warning("lighthouse: replaced straggler %s with a hot spare: %s", rid, reason)
                return
            # The spare stopped asking meanwhile: restart the straggler instead.
        self._stragglers.replaced(s, "restart", now, wall)
        self._roster.request_kill(rid, f"{reason}; restarting it (no hot spare waits)")
        self._record("straggler_replaced", rid, f"{reason}; told to restart (no hot spare waits)")
        log.warning("lighthouse: restarting straggler %s (no hot spare waits): %s", rid, reason)

    def _stragglers_status(self) -> StragglersStatus:
        watch = self._stragglers
        rule = watch.rule
        return StragglersStatus(
            policy=watch.policy,
            window=rule.window,
            enter=rule.enter,
            leave=rule.leave,
            groups=tuple(
                StragglerStatus(
                    s.replica_id,
                    round(s.slowdown, 3),
                    round(s.compute, 6),
                    round(s.reference, 6),
                    s.steps,
                    s.straggler,
                    watch.flagged_at(s.replica_id),
                )
                for s in sorted(watch.standings.values(), key=lambda s: s.replica_id)
            ),
            replacing=watch.replacing,
            replaced=tuple(
                ReplacedStatus(r.replica_id, round(r.slowdown, 3), r.how, r.time, r.arrived)
                for r in watch.history
            ),
            replacements=watch.replacements,
        )

    def _waiting_reason(self, now: float) -> str:
        rnd = self._round
        if not rnd.requests:
            return "no pending quorum requests"
        if rnd.current is None and rnd.adopted is None and now < self._grace_until:
            return f"restarted: waiting {self._grace_until - now:.1f}s more for the groups' resume reports"
        return decide_quorum(rnd.state(self._roster.groups, self._ids.peek()), now, self._options).reason

    def _decide(self, now: float) -> None:
        """Recompute the decision after an event; form the quorum and resolve its members if due."""
        if self._spares is not None:
            self._reconcile_spares(now)
        rnd = self._round
        if not rnd.requests:
            return
        if rnd.current is None and rnd.adopted is None and now < self._grace_until:
            return  # a restarted lighthouse waits for resume reports (see __init__)
        state = rnd.state(self._roster.groups, self._ids.peek())
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
        rewind = self._progress.quorum_formed(top, self._wall())
        if rewind is not None:
            self._record("rewind", None, f"step {rewind.reached} -> {rewind.restarted_at}", None)
            log.warning(
                "lighthouse: the job went back: quorum at step %d after it had reached step %d (no group "
                "holding that state is left: steps since are trained again, from a durable checkpoint "
                "or from scratch)", rewind.restarted_at, rewind.reached,
            )  # fmt: skip
        self._admission.quorum_formed(quorum)
        self._roster.note_quorum(quorum)
        if rnd.form(quorum, now):
            self._record("quorum", None, decision.reason, quorum)
            log.info(
                "lighthouse: quorum %d formed with %s (%s)",
                quorum.quorum_id,
                ", ".join(quorum.replica_ids),
                decision.reason,
            )
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("lighthouse: quorum %d re-formed (%s)", quorum.quorum_id, decision.reason)

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
            self._round.withdraw(rid, error=TrainingFinished(reason, finished))
        return True

    def _holder(self, rid: str, now: float) -> Holder:
        return slot_holder(self._roster.groups.get(rid), self._roster.infos.get(rid), now, self._options)

    def _reconcile_spares(self, now: float) -> None:
        """Give claimable slots to waiting claimants (`slots.assign`, through the table); forget the
        replaced holders (the table fences their names) and answer their parked requests."""
        assert self._spares is not None
        for change in self._spares.reconcile(now, lambda rid: self._holder(rid, now)):
            old = change.old
            if old is not None:
                self._roster.remove(old)
                self._round.withdraw(old, error=Evicted(f"replica {old} was replaced by {change.new}"))
                self._round.member_changed(old)
                self._record(
                    "replaced", old, f"slot {change.slot} given to {change.claimant} as {change.new}"
                )
            self._record("claimed", change.new, f"slot {change.slot} by {change.claimant}")
            log.info(
                "lighthouse: slot %d given to %s as %s%s", change.slot, change.claimant, change.new,
                f" (replacing {old})" if old else "",
            )  # fmt: skip

    def _spares_status(self, now: float) -> SparesStatus | None:
        spares = self._spares
        if spares is None:
            return None
        slots = tuple(
            SlotStatus(index, rid, holder, state.value, round(now - at, 3) if at is not None else None)
            for index, rid, holder, state, at in spares.slots(lambda rid: self._holder(rid, now))
        )
        waiting = tuple(
            SpareStatus(name, preferred, round(now - since, 3), polls)
            for name, preferred, since, polls in spares.waiting()
        )
        return SparesStatus(slots, waiting, spares.promotions, tuple(spares.fenced_names))


def _slow(s: Standing) -> str:
    """How slow a straggler is, for its history entry and the log."""
    return (
        f"{s.slowdown:.1f}x slower than the others: {s.compute * 1e3:.1f} ms of its own work per "
        f"committed step against {s.reference * 1e3:.1f} ms (medians)"
    )
