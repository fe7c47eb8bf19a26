"""Training progress as the lighthouse knows it: what each group's leader reports, and the per-group
and per-job totals kept from those reports (steps committed, heals, timings, the final checksum).

Why the lighthouse: step lines scraped from the workers' stdout would show "0 steps committed" for
a script that prints nothing, and count a ``final_checksum=`` quoted in a traceback as a result.
The group leader (rank 0) already talks to the lighthouse every step; it sends a small
`ProgressReport` with its quorum requests, its heartbeats and its leave, and `ProgressBook` turns those
reports into `GroupProgress` values that outlive the group (a group that left or died keeps its
totals: the summary and ``/metrics`` need them at the end).

The book also watches the job's step across quorums (`Rewind`): a quorum formed below the furthest
step of the quorums before it means no group holding the state of that step was left to heal from,
and the job restarted from an earlier step: from a durable checkpoint (the groups' reports say
which step they resumed from), else from scratch. That is not a failure of a group but steps of the
job trained again (without a checkpoint, its progress lost), and ``ftlaunch`` says so.

Pure bookkeeping: no I/O, no clock reads (times are arguments), so it is unit-tested in one process.
`Membership` owns one book and calls it under its lock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from typing import Any

from ftlaunch.lighthouse.timeline import Point, Series

#: Seconds of history behind the step rates (per group and for the job).
RATE_WINDOW_S = 10.0
#: Most groups whose progress is remembered (groups that left included); the oldest are forgotten.
MAX_GROUPS = 4096
#: Longest session id / checksum accepted in a report.
MAX_TOKEN_LEN = 128
#: Most rewinds remembered (the oldest are forgotten).
MAX_REWINDS = 64
#: Points of each group's step-over-time series (`GroupProgress.timeline`, the dashboard's picture).
TIMELINE_POINTS = 64
#: About the points of all the groups' series together: a job of many groups keeps fewer each
#: (`timeline_points`), so ``/status`` stays small.
TIMELINE_BUDGET = 8192
#: A report closer than this to the last point kept only updates the series' latest value: a point a
#: second at most, so the request path rarely pays for thinning (`timeline.Series`).
TIMELINE_MIN_GAP_S = 1.0
#: Reports that resume after a silence this long start with a flat stretch (`timeline.Series`). A
#: leader reports only when its progress changed, so no report means no new step: flat is the truth.
TIMELINE_HOLD_S = 1.0

_REPORT_FIELDS: dict[str, tuple[type, ...]] = {
    "session": (str,),
    "step": (int,),
    "commits": (int,),
    "heals": (int,),
    "heal_seconds": (float, int),
    "step_seconds": (float, int),
    "quorum_seconds": (float, int),
    "commit_seconds": (float, int),
    "compute_seconds": (float, int),
    "checksum": (str,),
    "finished": (bool,),
    "durable_step": (int,),
    "durable_time": (float, int),
    "durable_seconds": (float, int),
    "durable_saves": (int,),
    "durable_skipped": (int,),
    "durable_failed": (int,),
    "resumed_from": (int,),
}
#: The durable-checkpoint fields of a report and of `GroupProgress` (the session's, as last reported).
DURABLE_FIELDS = (
    "durable_step", "durable_time", "durable_seconds", "durable_saves", "durable_skipped",
    "durable_failed", "resumed_from",
)  # fmt: skip


@dataclass(frozen=True)
class ProgressReport:
    """What a group leader says about its own process (``session``) since it started.

    Counts are cumulative over the session, so a lost report loses nothing; the lighthouse adds the
    sessions up. Timings are those of the last committed step. ``checksum`` (of the trained state,
    sent once, at a clean shutdown) and ``finished`` (the training loop ended and the group leaves)
    are set only by the final report.
    """

    session: str
    #: The step the group is at (the number of steps committed in the job, heals included).
    step: int = 0
    #: Steps this session committed.
    commits: int = 0
    heals: int = 0
    heal_seconds: float = 0.0
    #: Wall time of the last committed step: quorum request to commit decision.
    step_seconds: float = 0.0
    #: Of which waiting for the quorum (and reconfiguring / healing).
    quorum_seconds: float = 0.0
    #: Of which the commit: waiting for the step's allreduces and the votes.
    commit_seconds: float = 0.0
    #: The group's own work in the last committed step: from the previous commit decision to the
    #: step's first collective (or its commit), less the time it waited for the quorum. What tells
    #: a slow group from the fast ones, which wait for it in the collectives (lighthouse/stragglers.py).
    compute_seconds: float = 0.0
    checksum: str = ""
    finished: bool = False
    #: Durable checkpoints (`ftlaunch.worker.durable`) of this session: the last one it published
    #: (step, 0: none; the writer's wall clock; seconds the write took), saves published, skipped
    #: (the previous still ran) and failed, and the step the process resumed from (0: none).
    durable_step: int = 0
    durable_time: float = 0.0
    durable_seconds: float = 0.0
    durable_saves: int = 0
    durable_skipped: int = 0
    durable_failed: int = 0
    resumed_from: int = 0

    def __post_init__(self) -> None:
        for name, types in _REPORT_FIELDS.items():
            value = getattr(self, name)
            if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
                raise ValueError(
                    f"progress field {name!r} must be {types[0].__name__}, got {type(value).__name__}"
                )
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if value < 0 or (isinstance(value, float) and not math.isfinite(value)):
                    raise ValueError(f"progress field {name!r} must be a finite number >= 0, got {value!r}")
        if not self.session or len(self.session) > MAX_TOKEN_LEN or not self.session.isprintable():
            raise ValueError(f"progress field 'session' must be 1..{MAX_TOKEN_LEN} printable characters")
        if len(self.checksum) > MAX_TOKEN_LEN or not self.checksum.isprintable():
            raise ValueError(
                f"progress field 'checksum' must be at most {MAX_TOKEN_LEN} printable characters"
            )

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _REPORT_FIELDS}

    @classmethod
    def from_json(cls, d: Any) -> ProgressReport:
        """Strict parse (the lighthouse's request check): unknown or mistyped fields raise ValueError."""
        if not isinstance(d, dict):
            raise ValueError(f"progress must be a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_REPORT_FIELDS))
        if unknown:
            raise ValueError(f"unknown progress field(s): {', '.join(map(repr, unknown))}")
        if "session" not in d:
            raise ValueError("progress needs 'session'")
        return cls(**d)


@dataclass(frozen=True)
class Rewind:
    """The job went back: a quorum formed at step ``restarted_at`` after quorums had reached step
    ``reached``, so no group holding the state of ``reached`` was left (every group died, or the
    only ones holding it died before a healer had its copy). Steps ``restarted_at`` .. ``reached``
    are trained again. ``recovered``: a group holding ``reached`` (or later) came back afterwards
    (it had hung, not died) and the job went on from its state: nothing was lost in the end."""

    reached: int
    restarted_at: int
    #: The lighthouse's wall time of the quorum that went back.
    wall: float
    recovered: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "reached": self.reached,
            "restarted_at": self.restarted_at,
            "wall": self.wall,
            "recovered": self.recovered,
        }

    @classmethod
    def from_json(cls, d: Any) -> Rewind:
        if not isinstance(d, dict):
            raise ValueError(f"rewind must be a JSON object, got {type(d).__name__}")
        return cls(
            reached=_int(d, "reached"),
            restarted_at=_int(d, "restarted_at"),
            wall=_num(d, "wall"),
            recovered=bool(d.get("recovered", False)),
        )


def _num(d: Mapping[str, Any], name: str, default: float = 0.0) -> float:
    value = d.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"progress field {name!r} must be a number, got {type(value).__name__}")
    return float(value)


def _int(d: Mapping[str, Any], name: str) -> int:
    value = d.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"progress field {name!r} must be int, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class GroupProgress:
    """One replica group's training progress over all its sessions (``GET /status``'s ``progress``)."""

    replica_id: str
    #: The step it reported last.
    step: int = 0
    #: Steps committed, all sessions together.
    committed: int = 0
    #: Processes (sessions) that reported: the first one plus each restart.
    sessions: int = 0
    #: Times the lighthouse saw it go down (connection lost, reported failed, silent, evicted).
    failures: int = 0
    heals: int = 0
    heal_seconds: float = 0.0
    step_seconds: float = 0.0
    quorum_seconds: float = 0.0
    commit_seconds: float = 0.0
    #: The last committed step's own work, before it needed the other groups (`ProgressReport`).
    compute_seconds: float = 0.0
    #: Committed steps per second over the last `RATE_WINDOW_S`.
    step_rate: float = 0.0
    #: The current (last) session's id, and the lighthouse's wall time of its first commit report.
    session: str = ""
    session_first_commit: float | None = None
    #: Wall time of the last report that moved ``committed``.
    last_commit: float | None = None
    #: Set by the final report of a clean exit: the state's checksum and the step it was taken at.
    checksum: str = ""
    checksum_step: int | None = None
    finished: bool = False
    #: Sessions that committed steps starting behind a group that had already finished, without
    #: healing: they trained without the others' state (e.g. restarted after their peers finished).
    unsynced_sessions: int = 0
    #: The lighthouse turned its current session's quorum request away because the training had
    #: finished at a step it was behind, with nobody to heal from: it ends as a straggler.
    stopped_after_end: bool = False
    #: ``(wall time, step)`` over the group's life, thinned (`timeline.Series`): the dashboard's picture.
    timeline: tuple[Point, ...] = ()
    #: Durable checkpoints of its current session, as it last reported them (`ProgressReport`).
    durable_step: int = 0
    durable_time: float = 0.0
    durable_seconds: float = 0.0
    durable_saves: int = 0
    durable_skipped: int = 0
    durable_failed: int = 0
    resumed_from: int = 0

    @property
    def restarts(self) -> int:
        return max(0, self.sessions - 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "step": self.step,
            "committed": self.committed,
            "sessions": self.sessions,
            "failures": self.failures,
            "heals": self.heals,
            "heal_seconds": self.heal_seconds,
            "step_seconds": self.step_seconds,
            "quorum_seconds": self.quorum_seconds,
            "commit_seconds": self.commit_seconds,
            "compute_seconds": self.compute_seconds,
            "step_rate": self.step_rate,
            "session": self.session,
            "session_first_commit": self.session_first_commit,
            "last_commit": self.last_commit,
            "checksum": self.checksum,
            "checksum_step": self.checksum_step,
            "finished": self.finished,
            "unsynced_sessions": self.unsynced_sessions,
            "stopped_after_end": self.stopped_after_end,
            "timeline": [[round(t, 3), v] for t, v in self.timeline],
            **{name: getattr(self, name) for name in DURABLE_FIELDS},
        }

    @classmethod
    def from_json(cls, d: Any) -> GroupProgress:
        """Lenient on absent fields (an older lighthouse), strict on types."""
        if not isinstance(d, dict):
            raise ValueError(f"group progress must be a JSON object, got {type(d).__name__}")
        rid = d.get("replica_id")
        if not isinstance(rid, str):
            raise ValueError("group progress needs a string 'replica_id'")

        def opt_num(name: str) -> float | None:
            return None if d.get(name) is None else _num(d, name)

        checksum_step = d.get("checksum_step")
        if checksum_step is not None and (
            isinstance(checksum_step, bool) or not isinstance(checksum_step, int)
        ):
            raise ValueError("progress field 'checksum_step' must be int or null")
        for name in ("session", "checksum"):
            if not isinstance(d.get(name, ""), str):
                raise ValueError(f"progress field {name!r} must be str")
        return cls(
            replica_id=rid,
            step=_int(d, "step"),
            committed=_int(d, "committed"),
            sessions=_int(d, "sessions"),
            failures=_int(d, "failures"),
            heals=_int(d, "heals"),
            heal_seconds=_num(d, "heal_seconds"),
            step_seconds=_num(d, "step_seconds"),
            quorum_seconds=_num(d, "quorum_seconds"),
            commit_seconds=_num(d, "commit_seconds"),
            compute_seconds=_num(d, "compute_seconds"),
            step_rate=_num(d, "step_rate"),
            session=d.get("session", ""),
            session_first_commit=opt_num("session_first_commit"),
            last_commit=opt_num("last_commit"),
            checksum=d.get("checksum", ""),
            checksum_step=checksum_step,
            finished=bool(d.get("finished", False)),
            unsynced_sessions=_int(d, "unsynced_sessions"),
            stopped_after_end=bool(d.get("stopped_after_end", False)),
            timeline=_points(d.get("timeline", [])),
            durable_step=_int(d, "durable_step"),
            durable_time=_num(d, "durable_time"),
            durable_seconds=_num(d, "durable_seconds"),
            durable_saves=_int(d, "durable_saves"),
            durable_skipped=_int(d, "durable_skipped"),
            durable_failed=_int(d, "durable_failed"),
            resumed_from=_int(d, "resumed_from"),
        )


def _points(value: Any) -> tuple[Point, ...]:
    """``[[time, step], ...]`` of a status document, checked."""
    if not isinstance(value, list):
        raise ValueError("progress field 'timeline' must be a list of [time, step]")
    out = []
    for item in value:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in item)
        ):
            raise ValueError("progress field 'timeline' must be a list of [time, step]")
        out.append((float(item[0]), item[1]))
    return tuple(out)


@dataclass
class _Session:
    session: str
    commits: int = 0
    heals: int = 0
    heal_seconds: float = 0.0
    first_commit: float | None = None
    judged: bool = False  # whether its start was checked against the job's step


@dataclass
class _Totals:
    """Mutable per-group totals; the current session's counts are added on read."""

    replica_id: str
    step: int = 0
    committed: int = 0  # of finished (earlier) sessions
    heals: int = 0
    heal_seconds: float = 0.0
    sessions: int = 0
    failures: int = 0
    current: _Session | None = None
    last: ProgressReport | None = None
    last_commit: float | None = None
    checksum: str = ""
    checksum_step: int | None = None
    finished: bool = False
    unsynced: int = 0
    #: The session ("" before any report) the lighthouse refused as a straggler of a finished job.
    stopped_session: str | None = None
    #: Refused before its session was known: the next new session to report is the refused one.
    stopped_pending: bool = False
    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=256))
    timeline: Series = field(
        default_factory=lambda: Series(TIMELINE_POINTS, TIMELINE_MIN_GAP_S, TIMELINE_HOLD_S)
    )


def timeline_points(groups: int) -> int:
    """Points each group's series keeps in a job of ``groups``: `TIMELINE_POINTS`, halved each time
    the job doubles past `TIMELINE_BUDGET` / `TIMELINE_POINTS` groups, at least 8. Few sizes, so
    the series shrink lazily (at their next point) a few times as a job grows, never per group."""
    points = TIMELINE_POINTS
    while points > 8 and groups * points > TIMELINE_BUDGET:
        points //= 2
    return points


def _rate(samples: deque[tuple[float, int]], now: float) -> float:
    """Counts per second over the samples of the last `RATE_WINDOW_S` (0 with fewer than two)."""
    while len(samples) > 2 and now - samples[1][0] > RATE_WINDOW_S:
        samples.popleft()
    if len(samples) < 2 or now - samples[-1][0] > RATE_WINDOW_S:
        return 0.0
    (t0, c0), (t1, c1) = samples[0], samples[-1]
    return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0


class ProgressBook:
    """Per-group totals from the leaders' reports; see the module docstring. Not thread-safe: its
    owner (`Membership`) calls it under its own lock."""

    def __init__(self) -> None:
        self._groups: dict[str, _Totals] = {}
        self._job: deque[tuple[float, int]] = deque(maxlen=1024)  # (wall, commits of all groups)
        self._job_commits = 0
        #: Ids of the groups whose current session finished: the lighthouse asks for the furthest
        #: finished step at every quorum it forms (nobody finished for most of a run: no scan).
        self._finished: set[str] = set()
        #: The furthest step of the quorums since the job last went back (None: no quorum yet).
        self._reached: int | None = None
        self._rewinds: deque[Rewind] = deque(maxlen=MAX_REWINDS)
        self._timeline_points = TIMELINE_POINTS

    def _totals(self, replica_id: str) -> _Totals:
        t = self._groups.get(replica_id)
        if t is None:
            if len(self._groups) >= MAX_GROUPS:
                self._finished.discard(self._groups.pop(next(iter(self._groups))).replica_id)
            t = self._groups[replica_id] = _Totals(replica_id)
            points = timeline_points(len(self._groups))
            if points != self._timeline_points:  # the job grew past a size: every series keeps fewer
                self._timeline_points = points
                for other in self._groups.values():
                    other.timeline.capacity = points
            t.timeline.capacity = points
        return t

    def report(self, replica_id: str, report: ProgressReport, wall: float) -> None:
        """A report of ``replica_id``'s leader arrived at ``wall`` (the lighthouse's clock)."""
        t = self._totals(replica_id)
        cur = t.current
        if cur is None or cur.session != report.session:
            if cur is not None:  # the previous process is gone: keep what it did
                t.committed += cur.commits
                t.heals += cur.heals
                t.heal_seconds += cur.heal_seconds
            cur = t.current = _Session(report.session)
            t.sessions += 1
            if t.stopped_pending:
                t.stopped_session, t.stopped_pending = report.session, False
            t.finished, t.checksum, t.checksum_step = False, "", None
            self._finished.discard(replica_id)
        if report.commits < cur.commits:
            return  # an older report of this session, overtaken by a newer one
        new_commits = report.commits - cur.commits
        if new_commits and not cur.judged:
            cur.judged = True
            started_at = report.step - report.commits
            if report.heals == 0 and started_at < self.furthest_finished_step(exclude=replica_id):
                t.unsynced += 1
        cur.commits, cur.heals, cur.heal_seconds = report.commits, report.heals, float(report.heal_seconds)
        t.step, t.last = report.step, report
        t.timeline.add(wall, report.step)
        if new_commits:
            if cur.first_commit is None:
                cur.first_commit = wall
            t.last_commit = wall
            t.samples.append((wall, t.committed + cur.commits))
            self._job_commits += new_commits
            self._job.append((wall, self._job_commits))
        if report.finished:
            t.finished = True
            self._finished.add(replica_id)
            if report.checksum:
                t.checksum, t.checksum_step = report.checksum, report.step

    def quorum_formed(self, top: int, wall: float) -> Rewind | None:
        """A quorum formed whose furthest member is at step ``top``, at ``wall``. Returns the
        `Rewind` it makes, if it is below the step the quorums had reached."""
        reached = self._reached
        if reached is not None and top > reached + 1 and self._rewinds and not self._rewinds[-1].recovered:
            # Steps advance one per quorum; a jump to (or past) the lost step is a group of the old
            # state back (it had hung): the job goes on from it.
            last = self._rewinds[-1]
            if top >= last.reached:
                self._rewinds[-1] = Rewind(last.reached, last.restarted_at, last.wall, recovered=True)
        if reached is not None and top < reached:
            rewind = Rewind(reached=reached, restarted_at=top, wall=wall)
            self._rewinds.append(rewind)
            self._reached = top
            return rewind
        self._reached = top if reached is None else max(reached, top)
        return None

    def rewinds(self) -> tuple[Rewind, ...]:
        """The times the job went back, oldest first."""
        return tuple(self._rewinds)

    def failed(self, replica_id: str) -> None:
        """The lighthouse saw the group go down (counted once per incident by the caller)."""
        self._totals(replica_id).failures += 1

    def furthest_finished_step(self, exclude: str | Set[str] | None = None) -> int:
        """The furthest step at which another group (not ``exclude``: one id or a set of them)
        finished (a clean exit), 0 if none did."""
        others = (
            frozenset() if exclude is None else frozenset((exclude,)) if isinstance(exclude, str) else exclude
        )
        return max((self._groups[rid].step for rid in self._finished if rid not in others), default=0)

    def stopped_after_end(self, replica_id: str) -> None:
        """The lighthouse refused the group's process a quorum: the training finished at a step it
        was behind (`tickets.TrainingFinished`). Marks its session (see below) until a newer one."""
        t = self._totals(replica_id)
        # A process reports only once it commits: one refused before its first commit (the usual
        # case) is not the current session but the next new one, which reports with its leave.
        t.stopped_session = t.current.session if t.current is not None else ""
        t.stopped_pending = True

    def job_step_rate(self, wall: float) -> float:
        """Committed group-steps per second of the whole job, divided by the groups that committed
        in the window: the job's steps per second."""
        rate = _rate(self._job, wall)
        active = sum(
            1
            for t in self._groups.values()
            if t.last_commit is not None and wall - t.last_commit <= RATE_WINDOW_S
        )
        return rate / active if active else 0.0

    def snapshot(self, wall: float) -> tuple[GroupProgress, ...]:
        out = []
        for rid in sorted(self._groups):
            t = self._groups[rid]
            cur, last = t.current, t.last
            out.append(
                GroupProgress(
                    replica_id=rid,
                    step=t.step,
                    committed=t.committed + (cur.commits if cur else 0),
                    sessions=t.sessions,
                    failures=t.failures,
                    heals=t.heals + (cur.heals if cur else 0),
                    heal_seconds=round(t.heal_seconds + (cur.heal_seconds if cur else 0.0), 6),
                    step_seconds=last.step_seconds if last else 0.0,
                    quorum_seconds=last.quorum_seconds if last else 0.0,
                    commit_seconds=last.commit_seconds if last else 0.0,
                    compute_seconds=last.compute_seconds if last else 0.0,
                    step_rate=round(_rate(t.samples, wall), 4),
                    session=cur.session if cur else "",
                    session_first_commit=cur.first_commit if cur else None,
                    last_commit=t.last_commit,
                    checksum=t.checksum,
                    checksum_step=t.checksum_step,
                    finished=t.finished,
                    unsynced_sessions=t.unsynced,
                    stopped_after_end=t.stopped_session == (cur.session if cur else ""),
                    timeline=t.timeline.points(),
                    **({name: getattr(last, name) for name in DURABLE_FIELDS} if last else {}),
                )
            )
        return tuple(out)
