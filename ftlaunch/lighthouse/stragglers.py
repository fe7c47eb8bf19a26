"""Stragglers: a group that keeps training, but slowly, found from what the group leaders report
(docs/lighthouse.md, *Stragglers*): the rule as pure functions, and what it remembers
(`StragglerWatch`), which the membership holds and applies under its lock.

Why the lighthouse: in synchronous training a slow group (a throttled GPU, a bad link, a noisy
neighbour) drags every step of every group, and nothing fails. Every leader already reports its
progress with each quorum request; the lighthouse compares them, without a collective of its own.

What is compared. Not the step time: every group's is the same, since everybody waits for the
slowest in the step's collectives. The signal is each group's own work before it needs the others
(`progress.ProgressReport.compute_seconds`: from the previous commit decision to the step's first
collective, less the time it waited for the quorum): the slow group arrives late, the fast ones
arrive early and wait for it -- in the collectives, which that time leaves out.

The rule (`judge`), per member of the quorum in use, over its last `StragglerRule.window` committed
steps:

- its *compute* is the median of its window (one slow step, a garbage collection or a checkpoint,
  moves nothing); no verdict before `StragglerRule.min_steps` steps (a group that just joined or
  restarted warms up);
- its *reference* is the median of the other members' computes, and its *slowdown* the ratio of
  the two. Others, not everyone: with two groups the median of both would halve every slowdown;
  and a job in which every group is slow has no straggler (every ratio is near 1);
- it *becomes* a straggler when its slowdown reaches `StragglerRule.enter` AND its compute
  exceeds the reference by `StragglerRule.spread` robust deviations of the others' computes
  (1.4826 x their median absolute deviation: a job whose groups differ widely by nature needs
  more) and by `StragglerRule.min_excess` seconds (a millisecond step is all noise);
- it *stays* one until its slowdown has stayed at or under `StragglerRule.leave` (< enter) for
  `StragglerRule.calm_steps` of its committed steps: a group near the threshold does not flap, and
  a slow group whose window looks fast for a moment (its peers slowed by a burst of load on a shared
  host: their median rises for a few seconds) stays one, its persistence count running on.

With the policy ``replace`` a straggler that stayed one for `StragglerRule.persist` of its committed
steps and `StragglerRule.persist_seconds` is replaced (`to_replace`): a replacement costs a heal and
a restart, and a noisy neighbour's burst of a few seconds is not worth one (on a shared, loaded
machine a group's own work can be twice another's for several seconds). One at a time: the next
only once the previous one's replacement has committed `StragglerRule.min_steps` steps (it can be
judged itself) or `REPLACEMENT_TIMEOUT` passed; never when that leaves the quorum below
``min_replicas``; the slowest first. The membership then hands its slot to a hot spare when one waits (fencing
it, as for a hung group), else tells it to end its process (as the dashboard's Kill does) so that its agent
restarts it. ``report`` only shows them (``/status``, ``/metrics``, the dashboard, the launcher's summary).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from ftlaunch.env import STRAGGLER_POLICIES

#: The policies (``--stragglers``): only show stragglers, or also replace persistent ones.
POLICIES = STRAGGLER_POLICIES
REPORT, REPLACE = POLICIES

#: How the membership starts the reason of a group it replaced as a straggler (status, history).
STRAGGLER_REASON = "straggler: "
#: Seconds a replacement stays in flight at most (its group never committed: gone, or very slow to
#: restart); then another straggler may be replaced.
REPLACEMENT_TIMEOUT = 300.0
#: Seconds between two verdicts at most once (the tick looks; a verdict walks every member).
JUDGE_EVERY = 0.5
#: The robust standard deviation of a normal distribution, in median absolute deviations.
MAD_TO_SIGMA = 1.4826
#: Replacements remembered for the status.
REPLACED_KEPT = 32
#: A reference compute below this (seconds) counts as this much: a slowdown is then finite.
_TINY = 1e-6


def check_policy(value: str) -> str:
    """``value`` if it names a policy, else ValueError naming them."""
    if value not in POLICIES:
        raise ValueError(f"stragglers policy must be one of {', '.join(POLICIES)}, got {value!r}")
    return value


@dataclass(frozen=True)
class StragglerRule:
    """The thresholds of the rule (see the module docstring)."""

    #: Committed steps of each group's window.
    window: int = 20
    #: Steps a group must have reported (in its window) before any verdict on it.
    min_steps: int = 10
    #: Slowdown at which a group becomes a straggler...
    enter: float = 1.5
    #: ... and at or under which it is one no more, once it stayed so for `calm_steps` committed steps.
    leave: float = 1.2
    calm_steps: int = 10
    #: Robust standard deviations of the others' computes its own must also exceed the reference by.
    spread: float = 3.0
    #: Seconds its compute must also exceed the reference by.
    min_excess: float = 0.005
    #: Committed steps, and seconds, a group must have been a straggler before ``replace`` acts on it.
    persist: int = 10
    persist_seconds: float = 15.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.window:
            raise ValueError(f"min_steps must be in 1..window ({self.window}), got {self.min_steps}")
        if not 1.0 <= self.leave < self.enter:
            raise ValueError(f"need 1 <= leave < enter, got leave={self.leave}, enter={self.enter}")
        if min(self.spread, self.min_excess, self.persist, self.persist_seconds, self.calm_steps) < 0:
            raise ValueError("spread, min_excess, persist, persist_seconds and calm_steps must be >= 0")


@dataclass(frozen=True)
class Standing:
    """One member's verdict."""

    replica_id: str
    #: Its compute over the reference (1.0: as fast as the others).
    slowdown: float
    #: The median of its window (seconds per step).
    compute: float
    #: The median of the other members' computes.
    reference: float
    #: Committed steps it reported (its current process's).
    steps: int
    straggler: bool = False
    #: Its ``steps`` when it became a straggler, and the time (the caller's clock; None: it is not one).
    since: int | None = None
    since_time: float | None = None
    #: A straggler's ``steps`` when its slowdown fell to `StragglerRule.leave` or under (None: it
    #: did not, or it is no straggler).
    calm_since: int | None = None

    def persistent(self, rule: StragglerRule, now: float) -> bool:
        """A straggler for `StragglerRule.persist` of its committed steps and for
        `StragglerRule.persist_seconds` at ``now``: ``replace`` acts on it."""
        return (
            self.straggler
            and self.since is not None
            and self.since_time is not None
            and self.steps - self.since >= rule.persist
            and now - self.since_time >= rule.persist_seconds
        )


def _without(ordered: Sequence[float], i: int, k: int) -> float:
    """The ``k``-th smallest of ``ordered`` once its ``i``-th is removed."""
    return ordered[k] if k < i else ordered[k + 1]


def _median_without(ordered: Sequence[float], i: int) -> float:
    """The median of ``ordered`` (sorted, 2 or more) without its ``i``-th: O(1)."""
    n = len(ordered) - 1
    if n % 2:
        return _without(ordered, i, n // 2)
    return (_without(ordered, i, n // 2 - 1) + _without(ordered, i, n // 2)) / 2


def _sigma_without(ordered: Sequence[float], i: int, center: float) -> float:
    """The robust standard deviation (`MAD_TO_SIGMA` x the median absolute deviation from ``center``,
    their median) of ``ordered`` without its ``i``-th."""
    return MAD_TO_SIGMA * statistics.median(abs(v - center) for j, v in enumerate(ordered) if j != i)


def judge(
    windows: Mapping[str, Sequence[float]],
    steps: Mapping[str, int],
    previous: Mapping[str, Standing],
    rule: StragglerRule,
    now: float = 0.0,
) -> dict[str, Standing]:
    """The verdict on each member of the quorum in use (the module docstring's rule) at ``now``.

    ``windows``: each member's compute times of its committed steps, oldest first (its last
    ``rule.window`` are read); ``steps``: how many it reported in all (its current process);
    ``previous``: the last verdicts (the hysteresis). Members with fewer than ``rule.min_steps``
    steps in their window get no verdict, nor does anybody while fewer than two members have one.
    Cost: a median per member, plus the others' deviation for a member about to become a straggler.
    """
    computes = {
        rid: statistics.median(list(w)[-rule.window :])
        for rid, w in windows.items()
        if len(w) >= rule.min_steps
    }
    if len(computes) < 2:
        return {}
    ordered = sorted(computes.values())
    out: dict[str, Standing] = {}
    for rid, compute in computes.items():
        i = bisect.bisect_left(ordered, compute)
        reference = _median_without(ordered, i)
        slowdown = compute / max(reference, _TINY)
        before = previous.get(rid)
        was = before is not None and before.straggler
        count = steps.get(rid, 0)
        calm_since: int | None = None
        if was and before is not None:
            if slowdown <= rule.leave:
                calm_since = before.calm_since if before.calm_since is not None else count
            is_one = calm_since is None or count - calm_since < rule.calm_steps
        else:
            excess = compute - reference
            is_one = (
                slowdown >= rule.enter
                and excess >= rule.min_excess
                and excess >= rule.spread * _sigma_without(ordered, i, reference)
            )
        if not is_one:
            since, since_time, calm_since = None, None, None
        elif was and before is not None:
            since, since_time = before.since, before.since_time
        else:
            since, since_time = count, now
        out[rid] = Standing(rid, slowdown, compute, reference, count, is_one, since, since_time, calm_since)
    return out


def to_replace(
    standings: Mapping[str, Standing],
    live_members: Collection[str],
    min_replicas: int,
    busy: bool,
    rule: StragglerRule,
    now: float,
) -> Standing | None:
    """The straggler ``replace`` acts on at ``now``, or None: a persistent straggler among the live
    members of the quorum in use (the slowest; ties by id), unless a replacement is in flight
    (``busy``) or the quorum would fall below ``min_replicas`` without it."""
    if busy or len(live_members) - 1 < min_replicas:
        return None
    found = [s for rid, s in standings.items() if rid in live_members and s.persistent(rule, now)]
    return max(found, key=lambda s: (s.slowdown, s.replica_id), default=None)


@dataclass(frozen=True)
class Replacement:
    """A straggler replaced: with a hot spare (``how`` = ``spare``) or by restarting it (``restart``)."""

    replica_id: str
    slowdown: float
    how: str
    #: Wall time it was replaced.
    time: float
    #: Wall time its replacement first committed (None: not yet).
    arrived: float | None = None


@dataclass
class _InFlight:
    replacement: Replacement
    started: float  # the membership's clock
    #: The processes (sessions) known when it started: the first commit of another is the replacement.
    known: frozenset[str] = field(default_factory=frozenset)
    #: The replacement's process, once it committed (it settles after `StragglerRule.min_steps`).
    session: str | None = None


class StragglerWatch:
    """What the straggler rule remembers: each group's window of compute times (per process: a
    restarted group starts afresh), the last verdicts, the replacement in flight and those done.
    Not thread-safe: the membership calls it under its lock."""

    def __init__(self, policy: str = REPORT, rule: StragglerRule | None = None) -> None:
        self.policy = check_policy(policy)
        self.rule = rule if rule is not None else StragglerRule()
        self._windows: dict[str, deque[float]] = {}
        self._steps: dict[str, int] = {}
        self._sessions: dict[str, tuple[str, int]] = {}  # replica id -> (its process, commits seen)
        self._flagged_at: dict[str, float] = {}  # replica id -> wall time it became a straggler
        self._dirty = False
        self._next_judge = -math.inf
        self._in_flight: _InFlight | None = None
        self._replaced: deque[Replacement] = deque(maxlen=REPLACED_KEPT)
        #: Stragglers replaced since the lighthouse started.
        self.replacements = 0
        #: The last verdicts, by replica id (members of the quorum in use with enough steps).
        self.standings: Mapping[str, Standing] = {}

    # ---- what the groups report

    def report(self, replica_id: str, session: str, commits: int, compute: float, wall: float) -> bool:
        """A progress report of ``replica_id``'s process ``session``: ``commits`` steps committed so
        far, the last one's ``compute`` seconds. Returns True when it is the first commit of the
        replacement in flight (a process that did not exist when it started): it arrived. The
        replacement stays in flight until it committed `StragglerRule.min_steps` steps."""
        seen = self._sessions.get(replica_id)
        if seen is None or seen[0] != session:  # a new process: what the old one measured is gone
            self._windows.pop(replica_id, None)
            self._steps[replica_id] = 0
            seen = (session, 0)
        if commits <= seen[1]:
            self._sessions[replica_id] = seen
            return False
        self._sessions[replica_id] = (session, commits)
        window = self._windows.get(replica_id)
        if window is None:
            window = self._windows[replica_id] = deque(maxlen=self.rule.window)
        window.append(compute)
        self._steps[replica_id] = self._steps.get(replica_id, 0) + 1
        self._dirty = True
        flight = self._in_flight
        if flight is None or session in flight.known:
            return False
        arrived = flight.session is None
        if arrived:
            flight.session = session
            for i, r in enumerate(self._replaced):
                if r is flight.replacement:
                    self._replaced[i] = flight.replacement = dataclasses.replace(r, arrived=wall)
        if session == flight.session and self._steps[replica_id] >= self.rule.min_steps:
            self._in_flight = None  # it can be judged itself now: the next one may go
        return arrived

    # ---- verdicts

    def due(self, now: float) -> bool:
        """Whether a verdict is due: new steps were reported since the last one, `JUDGE_EVERY` ago."""
        return self._dirty and now >= self._next_judge

    def judge(
        self, members: Sequence[str], known: Collection[str], now: float, wall: float
    ) -> tuple[list[Standing], list[Standing]]:
        """Judge ``members`` (the quorum in use) now; forget the groups no longer ``known`` (left,
        evicted, replaced, forgotten). Returns the members that became stragglers and those that
        are stragglers no more."""
        self._dirty = False
        self._next_judge = now + JUDGE_EVERY
        for rid in [rid for rid in self._sessions if rid not in known]:
            self._forget(rid)
        windows = {rid: self._windows[rid] for rid in members if rid in self._windows}
        before = self.standings
        self.standings = judge(windows, self._steps, before, self.rule, now)
        became, cleared = [], []
        for rid, s in self.standings.items():
            was = rid in before and before[rid].straggler
            if s.straggler and not was:
                became.append(s)
                self._flagged_at[rid] = wall
            elif was and not s.straggler:
                cleared.append(s)
        for rid in [rid for rid in self._flagged_at if not _is_straggler(self.standings.get(rid))]:
            del self._flagged_at[rid]
        return became, cleared

    def flagged_at(self, replica_id: str) -> float | None:
        """Wall time ``replica_id`` became a straggler (None: it is not one)."""
        return self._flagged_at.get(replica_id)

    # ---- replacements

    def busy(self, now: float) -> bool:
        """A replacement is in flight (it has not committed `StragglerRule.min_steps` steps yet,
        for `REPLACEMENT_TIMEOUT` at most)."""
        flight = self._in_flight
        if flight is not None and now - flight.started > REPLACEMENT_TIMEOUT:
            self._in_flight = None
        return self._in_flight is not None

    def replaced(self, standing: Standing, how: str, now: float, wall: float) -> Replacement:
        """``standing``'s group is being replaced (``how``: ``spare`` or ``restart``) now."""
        replacement = Replacement(standing.replica_id, standing.slowdown, how, wall)
        known = frozenset(session for session, _ in self._sessions.values())
        self._in_flight = _InFlight(replacement, now, known)
        self._replaced.append(replacement)
        self.replacements += 1
        self._forget(standing.replica_id)
        self.standings = {rid: s for rid, s in self.standings.items() if rid != standing.replica_id}
        return replacement

    @property
    def replacing(self) -> str | None:
        """The replica id of the replacement in flight (None: none)."""
        return self._in_flight.replacement.replica_id if self._in_flight is not None else None

    @property
    def history(self) -> tuple[Replacement, ...]:
        """The last `REPLACED_KEPT` replacements, oldest first."""
        return tuple(self._replaced)

    def _forget(self, replica_id: str) -> None:
        self._windows.pop(replica_id, None)
        self._steps.pop(replica_id, None)
        self._sessions.pop(replica_id, None)
        self._flagged_at.pop(replica_id, None)


def _is_straggler(standing: Standing | None) -> bool:
    return standing is not None and standing.straggler
