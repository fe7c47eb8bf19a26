"""A job's timeline as plain data: each replica group's step against time, and what happened to the
groups (failures, hangs, rejoins, a spare taking over), for `timeline_svg` to draw.

Two places record one. The launcher samples each group's step whenever its supervisor reads the
progress and marks what it saw happen (`ftlaunch.launcher.timeline`); the lighthouse keeps each
group's step from its leader's progress reports (`progress.ProgressBook`) and the dashboard takes the
marks from the lighthouse's history. Both keep a series of any length in bounded memory with
`Series`, which drops the points that change the drawn line least when it fills up: a steady climb
needs two points, so the corners that matter -- where a group stopped, where it caught up -- are the
ones kept. Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

#: ``(seconds, step)``: one point of a series.
Point = tuple[float, float]

# Mark kinds. A failure kind starts a group's down time on the picture, a recovery kind ends it.
#: A worker died or was killed, or the lighthouse saw the group go down.
FAILURE = "failure"
#: The group's workers were stopped (SIGSTOP) or went silent: a hang.
HANG = "hang"
#: The group's agent process died (the supervisor respawns it).
AGENT = "agent"
#: The group failed for good (no restarts left, or its agent could not be respawned).
GAVE_UP = "gave_up"
#: The group committed again after a failure (or, at the lighthouse, joined a quorum again).
REJOIN = "rejoin"
#: A hot spare took the failed group's slot and committed.
TAKEOVER = "takeover"
#: The job's lighthouse was down (a span: ``at`` to ``until``; no group of its own).
LIGHTHOUSE = "lighthouse"
#: The group was slowed (``--chaos slow=``: a span ``at`` to ``until``), or the lighthouse found it a
#: straggler: it trains on, slowly (not a failure).
SLOW = "slow"
#: The lighthouse replaced the group as a straggler: its slot went to a hot spare, or it restarts.
STRAGGLER = "straggler"
#: The group's health check failed (``--health-check``): its agent keeps it out until the check
#: passes. A moment, not a down time of its own: a group restarting is down already (its failure
#: began it), and one kept out from the start has not trained yet.
HEALTH = "health"

FAILURE_KINDS = frozenset({FAILURE, HANG, AGENT, GAVE_UP, STRAGGLER})
RECOVERY_KINDS = frozenset({REJOIN, TAKEOVER})
#: Every kind, in the legend's order.
MARK_KINDS = (FAILURE, HANG, AGENT, GAVE_UP, HEALTH, SLOW, STRAGGLER, LIGHTHOUSE, REJOIN, TAKEOVER)


@dataclass(frozen=True)
class Line:
    """One replica group's step over time; drawn straight from point to point."""

    name: str
    points: tuple[Point, ...] = ()


@dataclass(frozen=True)
class Mark:
    """Something that happened at ``at`` seconds: to the group ``line`` (None: to the whole job)."""

    at: float
    kind: str
    line: str | None = None
    #: What the tooltip says.
    detail: str = ""
    #: The end of a span: `LIGHTHOUSE` (None: still down when the picture was taken), `SLOW` (None:
    #: a moment, the lighthouse's verdict, not a span).
    until: float | None = None


@dataclass(frozen=True)
class Timeline:
    """What one picture shows; times are seconds since the picture's t = 0 (`subtitle` says when)."""

    title: str
    lines: tuple[Line, ...] = ()
    marks: tuple[Mark, ...] = ()
    #: Where the time axis ends (the job's end, or now).
    end: float = 0.0
    subtitle: str = ""
    #: Marks left out of the record (a very long run): the picture says so.
    marks_dropped: int = 0


def _area(a: Point, b: Point, c: Point, sx: float, sy: float) -> float:
    """Twice the area of the triangle abc, in units of the series' own ranges (``sx``, ``sy``)."""
    return abs((b[0] - a[0]) * (c[1] - a[1]) - (c[0] - a[0]) * (b[1] - a[1])) / (sx * sy)


def thin(points: list[Point] | tuple[Point, ...], keep: int) -> list[Point]:
    """The ``keep`` points (at least the first and the last) that draw ``points`` most faithfully.

    Visvalingam's rule: repeatedly drop the point whose triangle with its two neighbours is the
    smallest, i.e. whose removal moves the line least. Collinear points go first (a steady climb
    or a flat stretch keeps only its ends), sharp corners last.
    """
    n = len(points)
    keep = max(keep, 2)
    if n <= keep:
        return list(points)
    sx = (points[-1][0] - points[0][0]) or 1.0
    sy = (max(p[1] for p in points) - min(p[1] for p in points)) or 1.0
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    alive = [True] * n
    version = [0] * n
    heap = [(_area(points[i - 1], points[i], points[i + 1], sx, sy), i, 0) for i in range(1, n - 1)]
    heapq.heapify(heap)
    left = n
    while left > keep and heap:
        area, i, ver = heapq.heappop(heap)
        if not alive[i] or ver != version[i]:
            continue  # stale: the point was dropped or its area changed since
        alive[i] = False
        left -= 1
        p, q = prev[i], nxt[i]
        nxt[p], prev[q] = q, p
        for j in (p, q):
            if 0 < j < n - 1:
                version[j] += 1
                a = _area(points[prev[j]], points[j], points[nxt[j]], sx, sy)
                # A neighbour's area never drops below the one just removed: the order stays sane.
                heapq.heappush(heap, (max(a, area), j, version[j]))
    return [points[i] for i in range(n) if alive[i]]


class Series:
    """One curve's points in time order, at most ``capacity`` of them (plus the latest sample).

    ``min_gap``: a sample closer than that to the last point kept waits as the latest (shown, replaced
    by the next one); the first sample past it keeps the one waiting and waits in its place. So a
    fast reporter costs a point per ``min_gap`` (little memory, rare thinning), and the last sample
    before a stall is a point. ``hold_after``: a sample after a silence longer than that (no sample
    at all) first repeats the last value at its own time, so the line stays flat through the
    silence and jumps, instead of a slope that would claim progress nobody reported (a dead
    group's reports stop; the first of its restart is far ahead). When full, the points are thinned to half
    (`thin`); ``capacity`` may be lowered at any time, and the series shrinks at its next point.
    """

    def __init__(self, capacity: int = 512, min_gap: float = 0.0, hold_after: float | None = None) -> None:
        if capacity < 4:
            raise ValueError("a series needs a capacity of at least 4 points")
        if hold_after is not None and hold_after < min_gap:
            raise ValueError("a series holds after a silence no shorter than its min_gap")
        self.capacity = capacity
        self._min_gap = min_gap
        self._hold_after = hold_after
        self._points: list[Point] = []
        self._latest: Point | None = None

    def add(self, t: float, value: float) -> None:
        if not math.isfinite(t) or not math.isfinite(value):
            return
        pts = self._points
        seen = self._latest or (pts[-1] if pts else None)  # the last sample, kept or waiting
        if seen is not None and t < seen[0]:
            return  # out of order: older than what was seen
        if seen is None:
            pts.append((t, value))
            return
        if self._hold_after is not None and t - seen[0] > self._hold_after:
            if self._latest is not None:
                pts.append(self._latest)  # the corner before the silence
            if value != seen[1]:
                pts.append((t, seen[1]))  # flat through it
            pts.append((t, value))
            self._latest = None
        elif t - pts[-1][0] < self._min_gap:
            self._latest = (t, value)
            return
        elif self._latest is not None:
            pts.append(self._latest)  # the interval's last sample: where a stall began is never lost
            self._latest = (t, value)
        else:
            pts.append((t, value))
        if len(pts) > self.capacity:
            self._points = thin(pts, self.capacity // 2)

    def points(self, limit: int | None = None) -> tuple[Point, ...]:
        """The points to draw (the latest sample included), thinned to ``limit`` if given."""
        pts = self._points if self._latest is None else [*self._points, self._latest]
        if limit is not None and len(pts) > limit:
            return tuple(thin(pts, limit))
        return tuple(pts)

    def __len__(self) -> int:
        return len(self._points) + (self._latest is not None)
