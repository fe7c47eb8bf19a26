"""The job's timeline as ``ftlaunch`` saw it, and where the picture goes at exit.

`JobTimeline` records, on the supervisor's main thread: each group's step whenever the supervisor
reads the progress from the lighthouse (every 0.1 s with the lighthouse it hosts; a `Series` per
group, bounded however long the job runs), and what the supervisor learned happen to the groups --
a chaos injection (a slowdown is a span on the group's line), a worker's or agent's death, a hang, a
group failing for good, a rejoin, a hot spare taking a slot, the lighthouse down and back, and what
the lighthouse said about slow groups (found a straggler, replaced one). It reads no clock (times are
arguments, the supervisor's monotonic clock) and writes nothing: `Timeline` is the renderer's input
(`ftlaunch.lighthouse.timeline_svg`), and the supervisor writes the file.

**One incident, one mark.** A chaos SIGKILL is followed, milliseconds later, by the agent's report
of the worker's death; a SIGSTOP by the agent's report of the stopped worker. The injection is the
mark (it says what was done), and the first report of the group's failure after it is the same
incident; so is a straggler replacement and its workers' end. A second failure before the group is back (its
restart died too) is a mark of its own.

`keep_timeline` decides whether a job's picture is written (see its docstring; docs/launcher.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from ftlaunch import env
from ftlaunch.launcher.chaos import Injection
from ftlaunch.launcher.group import Group
from ftlaunch.lighthouse.timeline import (
    AGENT,
    FAILURE,
    FAILURE_KINDS,
    GAVE_UP,
    HANG,
    HEALTH,
    LIGHTHOUSE,
    SLOW,
    STRAGGLER,
    Line,
    Mark,
    Series,
    Timeline,
)

#: The file written next to the worker logs (in the job's log directory).
TIMELINE_FILE = "timeline.svg"
#: Points kept per group (`Series`): ample for a picture ~900 pixels wide.
POINTS_PER_GROUP = 512
#: Marks kept; a longer record drops its oldest (the picture counts them).
MAX_MARKS = 2000


def keep_timeline(own_log_dir: bool, code: int, chaos: bool, failures: int) -> bool:
    """Whether the job's picture is written at exit: always into a ``--log-dir`` the user gave, and
    into the temporary one whenever that is kept (the job failed or was stopped: exit ``code`` not
    0). A job that succeeded in a temporary directory only when there is something to see:
    ``--chaos`` ran or a group failed; its worker logs are removed then, the picture stays."""
    return not own_log_dir or code != 0 or chaos or failures > 0


class JobTimeline:
    """What the picture shows, recorded as the supervisor learns it (see the module docstring)."""

    def __init__(self, started: float, max_marks: int = MAX_MARKS) -> None:
        self._started = started
        self._series: dict[int, Series] = {}
        self._marks: deque[Mark] = deque(maxlen=max_marks)
        self._recorded = 0
        #: Groups whose last mark is a chaos injection not yet matched by the failure it causes.
        self._injected: set[int] = set()
        self._lighthouse_down_at: float | None = None
        self._slowdowns: list[Injection] = []

    @property
    def failures(self) -> int:
        """Failure marks recorded (hangs, agent deaths and groups failing for good included)."""
        return sum(1 for m in self._marks if m.kind in FAILURE_KINDS)

    @property
    def health_failures(self) -> int:
        """Health-check marks recorded (a group kept out: something to see, though no failure)."""
        return sum(1 for m in self._marks if m.kind == HEALTH)

    def sample(self, now: float, groups: Iterable[Group]) -> None:
        """The supervisor read the groups' progress at ``now``: each group's step from then on."""
        for g in groups:
            if g.last_step is None:
                continue
            series = self._series.get(g.gid)
            if series is None:
                series = self._series[g.gid] = Series(POINTS_PER_GROUP)
            series.add(now - self._started, g.last_step)

    def injected(self, injection: Injection) -> None:
        """``--chaos`` hit a group. A slowdown (``slow=``) is a span on the group's line, drawn to
        where it ended (its injection says, once it did); the group trains on meanwhile."""
        if injection.signal == "SLOW":
            self._slowdowns.append(injection)
            return
        kind = HANG if injection.signal == "SIGSTOP" else AGENT if injection.target == "agent" else FAILURE
        at = f" at step {injection.step}" if injection.step is not None else ""
        self._mark(
            injection.at, kind, injection.group, f"chaos: {injection.signal} to its {injection.target}{at}"
        )
        self._injected.add(injection.group)

    def failed(self, gid: int, now: float, detail: str, kind: str = FAILURE) -> None:
        """A failure of group ``gid`` was reported (a worker's or the agent's death, a stopped worker,
        `GAVE_UP`): a mark, unless it is the failure a chaos injection just caused."""
        if kind != GAVE_UP and gid in self._injected:
            self._injected.discard(gid)
            return
        self._mark(now, kind, gid, detail)

    def found_slow(self, gid: int, at: float, detail: str) -> None:
        """The lighthouse found group ``gid`` a straggler (a moment, not a span)."""
        self._mark(at, SLOW, gid, detail)

    def health_failed(self, gid: int, at: float, detail: str) -> None:
        """Group ``gid``'s health check began failing: its agent keeps it out until it passes (a
        moment: a group restarting is down already, one kept out from the start never trained)."""
        self._mark(at, HEALTH, gid, detail)

    def straggler_replaced(self, gid: int, at: float, detail: str) -> None:
        """The lighthouse replaced group ``gid`` as a straggler; the failure of its workers that
        follows (fenced, or told to end) is the same incident."""
        self._mark(at, STRAGGLER, gid, detail)
        self._injected.add(gid)

    def recovered(self, gid: int, at: float, kind: str, detail: str = "") -> None:
        """Group ``gid`` is back (`REJOIN`), or a spare took its slot (`TAKEOVER`, on the spare)."""
        self._injected.discard(gid)
        self._mark(at, kind, gid, detail)

    def lighthouse_down(self, at: float) -> None:
        if self._lighthouse_down_at is None:
            self._lighthouse_down_at = at

    def lighthouse_back(self, at: float, detail: str = "") -> None:
        """The supervisor restarted the lighthouse it hosts (after a chaos crash or on its own)."""
        since = self._lighthouse_down_at if self._lighthouse_down_at is not None else at
        self._lighthouse_down_at = None
        self._recorded += 1
        self._marks.append(
            Mark(
                since - self._started,
                LIGHTHOUSE,
                None,
                detail or "restarted on the same address",
                at - self._started,
            )
        )

    def timeline(self, now: float, title: str, subtitle: str) -> Timeline:
        """The picture's data, the job ending (or seen) at ``now``."""
        marks = list(self._marks)
        if self._lighthouse_down_at is not None:
            marks.append(Mark(self._lighthouse_down_at - self._started, LIGHTHOUSE, None, "not restarted"))
        for inj in self._slowdowns:
            until = min(inj.until if inj.until is not None else now, now)
            at = f" at step {inj.step}" if inj.step is not None else ""
            detail = f"chaos: slowed down {inj.factor:g}x for {until - inj.at:.1f}s{at}"
            marks.append(
                Mark(inj.at - self._started, SLOW, env.replica_id(inj.group), detail, until - self._started)
            )
        lines = tuple(Line(env.replica_id(gid), self._series[gid].points()) for gid in sorted(self._series))
        return Timeline(
            title,
            lines,
            tuple(sorted(marks, key=lambda m: m.at)),
            max(now - self._started, 0.0),
            subtitle,
            marks_dropped=self._recorded - len(self._marks),
        )

    def _mark(self, at: float, kind: str, gid: int, detail: str) -> None:
        self._recorded += 1
        self._marks.append(Mark(at - self._started, kind, env.replica_id(gid), detail))
