"""A hung quorum member is declared lost on evidence, sooner than the heartbeat timeout
(docs/lighthouse.md, *Hung members*): the rule as pure functions, and what it remembers (`HungWatch`).

Why: a stopped group (SIGSTOP, a frozen host) keeps its sockets open, so its peers wait in a
collective with it until the lighthouse declares it silent after ``heartbeat_timeout`` (5 s), while
a stop that ends sooner costs every peer its whole length. Two facts together say it is hung, not
slow: its heartbeats have stopped (they come from a thread of their own, every 100 ms, whatever its
training thread does) for at least `QUICK_SILENCE` -- or several of its own usual heartbeat gaps,
when it beats more slowly or its machine is loaded (`silence_limit`) -- AND another member of the
same quorum waits for it: it reports, in its heartbeats (``blocked``: the quorum id and how long),
that its step has waited `protocol.BLOCKED_FOR` in a collective of that quorum, or its quorum
request has been parked `PARKED_FOR` (the fast path waits for every member: a member stopped
between two steps holds its peers there). Then the member is marked failed at once (`hung_members`
says who, the membership applies it): the others' heartbeat answers name it ``lost`` (they abort
the step, worker/hang_abort.py) and the next quorum forms without it; when it wakes, its first
heartbeat revives it and says ``superseded``, and it rejoins and heals. A member woken inside a
step its peers already left is told so (`left_behind`). With hot spares a member declared hung
keeps its slot until the heartbeat timeout (`roster.slot_holder`). A member that is merely slow
still beats, and peers that are not blocked report nothing: neither alone declares anything, and
the heartbeat timeout applies.

A restarted lighthouse watches the quorum it adopted from the groups' resume reports
(lighthouse/resume.py) until it forms its own, on the same two facts -- the groups step on that
quorum through the outage (worker/outage.py) and report ``blocked`` on its id, and their quorum
requests park until every member of it asked. It knows less, though: a reported member it has not
heard from yet has a stand-in (``last_seen``: the adoption), and a member's pace is unknown until it
beat twice. So only a member whose own heartbeats reached this lighthouse at least `MIN_BEATS`
times can be declared hung: one never heard from may be backing off before reconnecting, and one
heard once may just have been told a slower pace (`protocol.advised_heartbeat_interval`, which grows
as the job's groups come back). Those wait for the heartbeat timeout. For every member the silence
limit is also at least `SILENCE_GAPS` times the pace advised now: a group told to beat every S
seconds is not silent before several S.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from ftlaunch.lighthouse.protocol import BLOCKED_FOR
from ftlaunch.lighthouse.quorum import Connection, GroupState, Health, Quorum, QuorumOptions, group_health
from ftlaunch.lighthouse.roster import GroupInfo
from ftlaunch.lighthouse.status import HUNG_REASON

#: Least heartbeat silence that, with a waiting peer, makes a quorum member lost (seconds): five
#: heartbeat intervals (100 ms); the member's own usual gaps raise it (`SILENCE_GAPS`).
QUICK_SILENCE = 0.5
#: How many of a member's own usual heartbeat gaps the silence must also exceed (a loaded machine's
#: heartbeat thread is late sometimes; it is not declared lost for that).
SILENCE_GAPS = 5.0
#: How long peers' quorum requests must have been parked, held up by the silent member (seconds):
#: as long as a step must have been blocked (`protocol.BLOCKED_FOR`).
PARKED_FOR = 0.5
#: Heartbeats a member of an adopted quorum must have sent to this (restarted) lighthouse before its
#: silence counts: two, so that one gap of its pace here was seen (see the module docstring).
MIN_BEATS = 2

#: A report that a member's step waits in a collective: (quorum id, since when on the lighthouse's clock).
Blocked = tuple[int, float]


def parse_blocked(value: object) -> tuple[int, float] | None:
    """A heartbeat's ``blocked`` field (``{"quorum_id": int, "seconds": number >= 0}``) as (quorum
    id, seconds), or None when it is malformed (ignored: it can only speed up a decision the
    heartbeat timeout makes anyway)."""
    if not isinstance(value, dict):
        return None
    qid, seconds = value.get("quorum_id"), value.get("seconds")
    if isinstance(qid, bool) or not isinstance(qid, int) or isinstance(seconds, bool):
        return None
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        return None
    return qid, float(seconds)


def silence_limit(beat_gap: float, pace: float | None) -> float:
    """How long a member's heartbeats must have stopped to count as evidence: `QUICK_SILENCE`, or
    `SILENCE_GAPS` of its usual gap (``beat_gap``) or of the pace advised now, whichever is longest."""
    return max(QUICK_SILENCE, SILENCE_GAPS * max(beat_gap, pace or 0.0))


@dataclass(frozen=True)
class Hung:
    """A member found hung: silent ``silent`` seconds while ``peer`` waits ``waited`` seconds for it."""

    replica_id: str
    silent: float
    peer: str
    waited: float

    def reason(self, quorum_id: int) -> str:
        """Why it is marked failed (starts with `status.HUNG_REASON`: it keeps a hot-spare slot)."""
        return (
            f"{HUNG_REASON}no heartbeat for {self.silent:.1f}s while {self.peer} waits {self.waited:.1f}s "
            f"for it in quorum {quorum_id}"
        )


def hung_members(
    quorum: Quorum,
    *,
    adopted: bool,
    groups: Mapping[str, GroupState],
    infos: Mapping[str, GroupInfo],
    blocked: Mapping[str, Blocked],
    requests: Collection[str],
    round_start: float | None,
    now: float,
    options: QuorumOptions,
    pace: float | None,
) -> list[Hung]:
    """The participants of ``quorum`` (this lighthouse's current one, or the one it ``adopted``)
    hung now, in the quorum's order: each live, connected, silent for its `silence_limit` (and,
    ``adopted``, heard `MIN_BEATS` times), while another participant waits for it -- one that
    reported (``blocked``) waiting `protocol.BLOCKED_FOR` in a collective of this quorum and still
    beats, or, when none did, one whose quorum request (``requests``) has been parked `PARKED_FOR`
    since ``round_start`` (a member stopped between two steps holds its peers there, not in a
    collective). ``pace``: the heartbeat pace advised now. O(1) while nobody waits."""
    parked = round_start is not None and now - round_start >= PARKED_FOR
    if not (blocked or parked):
        return []
    members = frozenset(quorum.replica_ids)  # `in` on the tuple, per parked request, was O(groups^2) a tick
    connected = Connection.CONNECTED

    def limit(rid: str) -> float:
        info = infos.get(rid)
        return silence_limit(info.beat_gap if info is not None else 0.0, pace)

    # Reporters that said so themselves (no extrapolation) and still beat: a stale report of a
    # member that stopped since says nothing.
    waiting = [
        (rid, now - since) for rid, (qid, since) in blocked.items()
        if qid == quorum.quorum_id and rid in members and (g := groups.get(rid)) is not None
        and g.last_seen - since >= BLOCKED_FOR and now - g.last_seen < limit(rid)
        and g.connection is connected
    ]  # fmt: skip
    if not waiting and parked:
        assert round_start is not None
        waiting = [
            (rid, now - round_start) for rid in requests
            if rid in members and (g := groups.get(rid)) is not None and now - g.last_seen < limit(rid)
        ]  # fmt: skip
    if not waiting:
        return []
    found = []
    for rid in quorum.replica_ids:
        g = groups.get(rid)
        if g is None or g.connection is not connected or group_health(g, now, options) is not Health.LIVE:
            continue
        if adopted and infos[rid].heartbeats < MIN_BEATS:
            continue  # a stand-in, or heard once: its silence says nothing yet
        silent = now - g.last_seen
        if silent < limit(rid):
            continue
        peer = next((w for w in waiting if w[0] != rid), None)
        if peer is not None:
            found.append(Hung(rid, silent, peer[0], peer[1]))
    return found


def left_behind(
    replica_id: str,
    quorum: Quorum | None,
    blocked: Blocked | None,
    last_seen: float | None,
    requests: Collection[str],
    round_start: float | None,
    now: float,
) -> tuple[int, tuple[str, ...]] | None:
    """For the answer to ``replica_id``'s heartbeat: when it reports (``blocked``, as of its last
    heartbeat at ``last_seen``) being blocked in a collective of ``quorum`` (the current or adopted
    one) for `protocol.BLOCKED_FOR` while other participants of that quorum have had quorum requests
    parked for `PARKED_FOR` -- they left the quorum's step (they aborted it: this member was
    declared hung and woke before the next quorum formed) -- the quorum's id and theirs (answered
    as ``lost``: its step is aborted). Else None.

    Why: without it the woken member waits in the old quorum's collective (or configure) for peers
    that will never come, until its collective timeout, while the lighthouse waits for its quorum
    request (it is live): a deadlock that lasted 60 s. A member whose step still runs cannot be
    behind its peers' next request by that long: they would be in the collective with it."""
    if quorum is None or blocked is None or last_seen is None or round_start is None:
        return None
    if blocked[0] != quorum.quorum_id or replica_id not in quorum.replica_ids:
        return None
    if last_seen - blocked[1] < BLOCKED_FOR or now - round_start < PARKED_FOR:
        return None
    gone = tuple(rid for rid in quorum.replica_ids if rid != replica_id and rid in requests)
    return (quorum.quorum_id, gone) if gone else None


class HungWatch:
    """What the hung rule remembers: which members report their step blocked in a collective, of
    which quorum, since when (on the lighthouse's clock). Each heartbeat replaces its sender's report."""

    def __init__(self) -> None:
        self._blocked: dict[str, Blocked] = {}

    @property
    def blocked(self) -> Mapping[str, Blocked]:
        return self._blocked

    def report(self, replica_id: str, now: float, blocked: tuple[int, float] | None) -> None:
        """``replica_id``'s heartbeat at ``now`` says its step waits in a collective of quorum
        ``blocked[0]`` for ``blocked[1]`` seconds (None: it does not wait)."""
        if blocked is None:
            self._blocked.pop(replica_id, None)
        else:
            self._blocked[replica_id] = (blocked[0], now - blocked[1])

    def prune(self, known: Collection[str]) -> None:
        """Drop the reports of members no longer ``known`` (left, evicted, forgotten)."""
        for rid in [rid for rid in self._blocked if rid not in known]:
            del self._blocked[rid]
