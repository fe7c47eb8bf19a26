"""A hung quorum member is declared lost on evidence, sooner than the heartbeat timeout
(`membership.Membership` mixes it in; docs/lighthouse.md, *Hung members*).

Why: a stopped group (SIGSTOP, a frozen host) keeps its sockets open, so its peers wait in a
collective with it until the lighthouse declares it silent after ``heartbeat_timeout`` (5 s), while
a stop that ends sooner costs every peer its whole length. Two facts together say it is hung, not
slow: its heartbeats have stopped (they come from a thread of their own, every 100 ms, whatever its
training thread does) for at least `QUICK_SILENCE` -- or several of its own usual heartbeat gaps,
when it beats more slowly or its machine is loaded (`silence_limit`) -- AND another member of the same
quorum waits for it: it reports, in its heartbeats (``blocked``: the quorum id and how long), that
its step has waited `BLOCKED_FOR` in a collective of that quorum, or its quorum request has been
parked `PARKED_FOR` (the fast path waits for every member: a member stopped between two steps
holds its peers there). Then the member is marked failed
at once: the others' heartbeat answers name it ``lost`` (they abort the step, worker/hang_abort.py)
and the next quorum forms without it; when it wakes, its first heartbeat revives it and says
``superseded``, and it rejoins and heals. With hot spares it keeps its slot until the heartbeat
timeout (as before this rule): a stop of a few seconds is cheaper waited out than handed to a
spare, which must heal while the stopped group wakes fenced and restarts. A member that is merely
slow still beats, and peers that are not blocked report nothing: neither alone declares anything, and the heartbeat timeout applies
as before.

A restarted lighthouse watches the quorum it adopted from the groups' resume reports
(`membership_resume`) until it forms its own, on the same two facts -- the groups step on that
quorum through the outage (worker/outage.py) and report ``blocked`` on its id, and their quorum
requests park until every member of it asked. It knows less, though: a reported member it has not
heard from yet has a stand-in (``last_seen``: the adoption), and a member's pace is unknown until it
beat twice. So only a member whose own heartbeats reached this lighthouse at least `MIN_BEATS`
times can be declared hung: one never heard from may be backing off before reconnecting, and one
heard once may just have been told a slower pace (`protocol.advised_heartbeat_interval`, which grows
as the job's groups come back). Those wait for the heartbeat timeout. For every member the silence
limit is also at least `SILENCE_GAPS` times the pace advised now: a group told to beat every S
seconds is not silent before several S.

Why apart: the rest of the membership reads without it; it runs under the membership's lock.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ftlaunch.lighthouse.membership_status import ADOPTED, GroupInfo
from ftlaunch.lighthouse.quorum import (
    Connection,
    GroupState,
    Health,
    Quorum,
    QuorumMember,
    QuorumOptions,
    group_health,
)
from ftlaunch.lighthouse.status import HUNG_REASON

log = logging.getLogger("ftlaunch.lighthouse.membership")

#: Least heartbeat silence that, with a waiting peer, makes a quorum member lost (seconds): five
#: heartbeat intervals (100 ms); the member's own usual gaps raise it (`SILENCE_GAPS`).
QUICK_SILENCE = 0.5
#: How many of a member's own usual heartbeat gaps the silence must also exceed (a loaded machine's
#: heartbeat thread is late sometimes; it is not declared lost for that).
SILENCE_GAPS = 5.0
#: How long a peer must report being blocked in a collective of the quorum (seconds; workers report
#: it from worker/hang_abort.SUSPECT_AFTER on): as long as a parked request must wait.
BLOCKED_FOR = 0.5
#: How long peers' quorum requests must have been parked, held up by the silent member (seconds).
PARKED_FOR = 0.5
#: How fast a member's usual gap forgets a long one (per heartbeat): a decaying maximum.
_GAP_DECAY = 0.9
#: Heartbeats a member of an adopted quorum must have sent to this (restarted) lighthouse before its
#: silence counts: two, so that one gap of its pace here was seen (see the module docstring).
MIN_BEATS = 2


def parse_blocked(value: object) -> tuple[int, float] | None:
    """A heartbeat's ``blocked`` field (``{"quorum_id": int, "seconds": number >= 0}``), or None when
    it is malformed (ignored: it can only speed up a decision the heartbeat timeout makes anyway)."""
    if not isinstance(value, dict):
        return None
    qid, seconds = value.get("quorum_id"), value.get("seconds")
    if isinstance(qid, bool) or not isinstance(qid, int) or isinstance(seconds, bool):
        return None
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        return None
    return qid, float(seconds)


class HungMixin:
    """`Membership`'s evidence-based loss of hung members; the attributes and helpers are the membership's."""

    _lock: threading.Lock
    _clock: Callable[[], float]
    _options: QuorumOptions
    _groups: dict[str, GroupState]
    _info: dict[str, GroupInfo]
    _quorum: Quorum | None
    _adopted: Quorum | None
    _requests: dict[str, QuorumMember]
    _round_start: float | None
    #: replica id -> (quorum id, since when, on this clock) its step waits in a collective of it.
    _blocked: dict[str, tuple[int, float]]

    if TYPE_CHECKING:

        def _mark_down(self, rid: str, connection: Connection, reason: str) -> None: ...

        def advised_pace(self) -> float | None: ...

    def _note_beat(self, rid: str, now: float, blocked: tuple[int, float] | None) -> None:
        """A heartbeat of ``rid`` arrives (before it counts as a sign of life): learn its usual gap
        and whether it is blocked. Call under the lock."""
        g, info = self._groups.get(rid), self._info.get(rid)
        # A stand-in's last_seen is the adoption of a resume report, not a beat: no gap to learn.
        if (
            g is not None
            and info is not None
            and g.connection is Connection.CONNECTED
            and info.incarnation != ADOPTED
        ):
            gap = now - g.last_seen
            if gap < self._options.heartbeat_timeout:
                info.beat_gap = max(gap, info.beat_gap * _GAP_DECAY)
        if blocked is None:
            self._blocked.pop(rid, None)
        else:
            self._blocked[rid] = (blocked[0], now - blocked[1])

    def silence_limit(self, rid: str) -> float:
        """How long ``rid``'s heartbeats must have stopped to count as evidence (see the module docstring)."""
        info = self._info.get(rid)
        gap = info.beat_gap if info is not None else 0.0
        return max(QUICK_SILENCE, SILENCE_GAPS * max(gap, self.advised_pace() or 0.0))

    def _watched(self) -> tuple[Quorum | None, bool]:
        """The quorum whose members may be declared hung, and whether it is adopted: this
        lighthouse's current quorum, or before it formed one, the quorum it adopted from resume
        reports (its members step on it through the outage)."""
        if self._quorum is not None:
            return self._quorum, False
        return self._adopted, self._adopted is not None

    def _declare_hung(self, now: float) -> None:
        """Mark failed every participant of the current quorum whose heartbeats stopped while another
        participant waits for it: blocked in a collective of that quorum, or parked in a quorum
        request that the stopped member's absence holds up (the fast path waits for every member of
        the quorum; a member stopped between two steps holds its peers there, not in a collective).
        O(1) while nobody waits. Before this lighthouse formed a quorum, the one it adopted, and
        only its members heard `MIN_BEATS` times here (see the module docstring)."""
        quorum, adopted = self._watched()
        start = self._round_start
        parked = start is not None and now - start >= PARKED_FOR
        if quorum is None or not (self._blocked or parked):
            return
        ids = quorum.replica_ids
        members = frozenset(ids)  # `in` on the tuple, per parked request, was O(groups^2) a tick
        for rid in [rid for rid in self._blocked if rid not in self._groups]:
            del self._blocked[rid]  # left, evicted or forgotten
        # Reporters that said so themselves (no extrapolation) and still beat: a stale report of a
        # member that stopped since says nothing.
        waiting = [
            (rid, now - since) for rid, (qid, since) in self._blocked.items()
            if qid == quorum.quorum_id and rid in members and self._groups[rid].last_seen - since >= BLOCKED_FOR
            and now - self._groups[rid].last_seen < self.silence_limit(rid)
            and self._groups[rid].connection is Connection.CONNECTED
        ]  # fmt: skip
        if not waiting and parked:
            assert start is not None
            waiting = [
                (rid, now - start) for rid in self._requests
                if rid in members and (g := self._groups.get(rid)) is not None and now - g.last_seen < self.silence_limit(rid)
            ]  # fmt: skip
        if not waiting:
            return
        for rid in ids:
            g = self._groups.get(rid)
            if g is None or g.connection is not Connection.CONNECTED or self._watched()[0] is not quorum:
                continue
            if group_health(g, now, self._options) is not Health.LIVE:
                continue
            info = self._info[rid]
            if adopted and info.heartbeats < MIN_BEATS:
                continue  # a stand-in, or heard once: its silence says nothing yet
            silent = now - g.last_seen
            if silent < self.silence_limit(rid):
                continue
            peer, waited = next((w for w in waiting if w[0] != rid), (None, 0.0))
            if peer is None:
                continue
            if adopted:  # it was in the job's quorum: told `superseded` on waking once the others went on
                info.in_a_quorum = True
            self._mark_down(
                rid, Connection.FAILED,
                f"{HUNG_REASON}no heartbeat for {silent:.1f}s while {peer} waits {waited:.1f}s for it in quorum "
                f"{quorum.quorum_id}",
            )  # fmt: skip

    def left_behind(self, replica_id: str) -> tuple[int, tuple[str, ...]] | None:
        """For the answer to ``replica_id``'s heartbeat: when it reports being blocked in a collective
        of the current quorum (or the adopted one: `_watched`) for `BLOCKED_FOR` while other
        participants of that quorum have had quorum requests parked for `PARKED_FOR` -- they left
        the quorum's step (they aborted it: this member was declared hung and woke before the next
        quorum formed) -- the quorum's id and theirs (answered as ``lost``: its step is aborted).
        Else None.

        Why: without it the woken member waits in the old quorum's collective (or configure) for
        peers that will never come, until its collective timeout, while the lighthouse waits for
        its quorum request (it is live): a deadlock the soak saw last 60 s. A member whose step
        still runs cannot be behind its peers' next request by that long: they would be in the
        collective with it."""
        with self._lock:
            quorum, mine, start = self._watched()[0], self._blocked.get(replica_id), self._round_start
            g = self._groups.get(replica_id)
            if quorum is None or mine is None or g is None or start is None or mine[0] != quorum.quorum_id:
                return None
            ids = quorum.replica_ids
            if replica_id not in ids:
                return None
            now = self._clock()
            if g.last_seen - mine[1] < BLOCKED_FOR or now - start < PARKED_FOR:
                return None
            gone = tuple(rid for rid in ids if rid != replica_id and rid in self._requests)
            return (quorum.quorum_id, gone) if gone else None
