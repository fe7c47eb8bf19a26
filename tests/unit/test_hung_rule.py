"""The hung-member rule as pure functions (lighthouse/hung.py): property tests of what it may and
must declare, over generated quorums, heartbeats, blocked reports and parked requests. The same
rule applied by the membership, step by step: tests/unit/test_hung_members.py,
tests/unit/test_hung_after_lighthouse_restart.py."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from ftlaunch.lighthouse import protocol
from ftlaunch.lighthouse.hung import (
    MIN_BEATS,
    PARKED_FOR,
    QUICK_SILENCE,
    Hung,
    hung_members,
    left_behind,
    silence_limit,
)
from ftlaunch.lighthouse.protocol import BLOCKED_FOR
from ftlaunch.lighthouse.quorum import Connection, GroupState, Quorum, QuorumMember, QuorumOptions
from ftlaunch.lighthouse.roster import GroupInfo
from ftlaunch.worker import hang_abort, manager

NOW = 1000.0
QID = 7
OPTS = QuorumOptions(heartbeat_timeout=5.0)
IDS = "abcde"


@dataclass(frozen=True)
class Scene:
    """What `hung_members` reads, generated."""

    quorum: Quorum
    adopted: bool
    groups: dict[str, GroupState]
    infos: dict[str, GroupInfo]
    blocked: dict[str, tuple[int, float]]
    requests: frozenset[str]
    round_start: float | None
    pace: float | None

    def run(self, **changes: object) -> list[Hung]:
        fields = {
            "adopted": self.adopted,
            "groups": self.groups,
            "infos": self.infos,
            "blocked": self.blocked,
            "requests": self.requests,
            "round_start": self.round_start,
            "pace": self.pace,
            **changes,
        }
        return hung_members(self.quorum, now=NOW, options=OPTS, **fields)  # type: ignore[arg-type]

    def limit(self, rid: str) -> float:
        return silence_limit(self.infos[rid].beat_gap, self.pace)

    def beats(self, rid: str) -> bool:
        """``rid`` still beats: silent less than its silence limit."""
        return NOW - self.groups[rid].last_seen < self.limit(rid)

    def blocked_waiter(self, rid: str) -> bool:
        """``rid`` said itself (as of its last heartbeat) that it waits `BLOCKED_FOR` in this quorum."""
        report, g = self.blocked.get(rid), self.groups[rid]
        return (
            report is not None
            and report[0] == QID
            and g.last_seen - report[1] >= BLOCKED_FOR
            and g.connection is Connection.CONNECTED
            and self.beats(rid)
        )

    def parked(self) -> bool:
        return self.round_start is not None and NOW - self.round_start >= PARKED_FOR


@st.composite
def scenes(draw: st.DrawFn) -> Scene:
    """Mostly quorums of several members, about half of them beating, with blocked reports and
    parked rounds on either side of their thresholds (so that verdicts are common)."""
    known = draw(st.lists(st.sampled_from(IDS), min_size=2, max_size=len(IDS), unique=True))
    outsider = draw(st.one_of(st.none(), st.sampled_from(known)))  # a known group not in the quorum
    members = sorted(rid for rid in known if rid != outsider)
    quorum = Quorum(QID, tuple(QuorumMember(rid) for rid in members), created=0.0)
    beating = st.sampled_from([0.0, 0.1, 0.3])
    silent = st.one_of(st.floats(0.4, 3.0), st.floats(4.9, 7.0))
    groups, infos, blocked = {}, {}, {}
    for rid in known:
        connection = draw(
            st.sampled_from([Connection.CONNECTED] * 8 + [Connection.FAILED, Connection.DISCONNECTED])
        )
        groups[rid] = GroupState(rid, NOW - draw(st.one_of(beating, silent)), connection)
        infos[rid] = GroupInfo(
            first_seen=0.0,
            heartbeats=draw(st.integers(0, 4)),
            beat_gap=draw(st.sampled_from([0.0, 0.1, 0.3])),
        )
        if draw(st.booleans()):
            qid = draw(st.sampled_from([QID, QID, QID - 1]))
            waited = draw(st.one_of(st.sampled_from([0.2, BLOCKED_FOR, 1.5]), st.floats(0.0, 2.0)))
            blocked[rid] = (qid, groups[rid].last_seen - waited)
    requests = frozenset(draw(st.lists(st.sampled_from(known), unique=True)))
    parked = st.one_of(st.sampled_from([0.2, PARKED_FOR, 1.5]), st.floats(0.0, 2.0))
    round_start = draw(st.one_of(st.none(), parked.map(lambda r: NOW - r)))
    return Scene(
        quorum=quorum,
        adopted=draw(st.booleans()),
        groups=groups,
        infos=infos,
        blocked=blocked,
        requests=requests,
        round_start=round_start,
        pace=draw(st.sampled_from([None, 0.2, 0.3])),
    )


@settings(max_examples=400, deadline=None)
@given(scenes())
def test_only_a_silent_live_member_that_a_beating_peer_waits_for_is_declared(scene: Scene) -> None:
    """Each member declared: in the quorum, connected, live, silent at least its silence limit (and,
    in an adopted quorum, heard `MIN_BEATS` times); the peer named is another member of the quorum
    that still beats and waits for it -- blocked `BLOCKED_FOR` in this quorum's collective, or, when
    no member says so, parked `PARKED_FOR` in a quorum request."""
    found = scene.run()
    members = scene.quorum.replica_ids
    any_blocked = any(scene.blocked_waiter(rid) for rid in members)
    assert [h.replica_id for h in found] == [rid for rid in members if rid in {h.replica_id for h in found}]
    for h in found:
        g = scene.groups[h.replica_id]
        assert g.connection is Connection.CONNECTED and h.silent == NOW - g.last_seen
        assert max(QUICK_SILENCE, scene.limit(h.replica_id)) <= h.silent <= OPTS.heartbeat_timeout
        assert not scene.adopted or scene.infos[h.replica_id].heartbeats >= MIN_BEATS
        assert h.peer != h.replica_id and h.peer in members and scene.beats(h.peer)
        if any_blocked:
            assert scene.blocked_waiter(h.peer) and h.waited == NOW - scene.blocked[h.peer][1]
        else:
            assert scene.parked() and h.peer in scene.requests and h.waited == NOW - scene.round_start  # type: ignore[operator]


@settings(max_examples=400, deadline=None)
@given(scenes())
def test_every_member_the_evidence_points_at_is_declared(scene: Scene) -> None:
    """The converse: a member that may be declared (connected, live, silent past its limit, heard
    enough) is declared whenever another member waits for it."""
    found = {h.replica_id for h in scene.run()}
    members = scene.quorum.replica_ids
    waiters = [rid for rid in members if scene.blocked_waiter(rid)]
    if not waiters and scene.parked():
        waiters = [rid for rid in members if rid in scene.requests and scene.beats(rid)]
    for rid in members:
        g = scene.groups[rid]
        silent = NOW - g.last_seen
        suspect = (
            g.connection is Connection.CONNECTED
            and scene.limit(rid) <= silent <= OPTS.heartbeat_timeout
            and (not scene.adopted or scene.infos[rid].heartbeats >= MIN_BEATS)
        )
        assert (rid in found) == (suspect and any(w != rid for w in waiters)), rid


@settings(max_examples=200, deadline=None)
@given(scenes(), st.floats(0.0, 3.0))
def test_no_waiting_peer_no_verdict_and_longer_silence_keeps_it(scene: Scene, more: float) -> None:
    """Without a blocked report on this quorum and without a parked round, nobody is declared
    (silence alone waits for the heartbeat timeout), and a lone member never is; a member declared
    stays declared while it stays silent (within the heartbeat timeout)."""
    other_quorum = {rid: (QID - 1, since) for rid, (_, since) in scene.blocked.items()}
    assert scene.run(blocked=other_quorum, round_start=None) == []
    assert scene.run(blocked={}, round_start=None) == []
    if len(scene.quorum.replica_ids) == 1:
        assert scene.run() == []
    for h in scene.run():
        g = scene.groups[h.replica_id]
        later = max(g.last_seen - more, NOW - OPTS.heartbeat_timeout)
        groups = {**scene.groups, h.replica_id: GroupState(h.replica_id, later, g.connection)}
        assert h.replica_id in {x.replica_id for x in scene.run(groups=groups)}
        beating = {**scene.groups, h.replica_id: GroupState(h.replica_id, NOW, g.connection)}
        assert h.replica_id not in {x.replica_id for x in scene.run(groups=beating)}


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.sampled_from(IDS), min_size=1, unique=True),
    st.sampled_from(IDS),
    st.one_of(st.none(), st.tuples(st.sampled_from([QID, QID - 1]), st.floats(NOW - 3.0, NOW))),
    st.floats(NOW - 1.0, NOW),
    st.lists(st.sampled_from(IDS), unique=True),
    st.one_of(st.none(), st.floats(NOW - 2.0, NOW)),
)
def test_a_member_is_left_behind_exactly_when_its_peers_left_its_step(
    members: list[str],
    rid: str,
    blocked: tuple[int, float] | None,
    last_seen: float,
    requests: list[str],
    round_start: float | None,
) -> None:
    """``left_behind`` answers the quorum id and the other members with a parked request exactly
    when ``rid``, a member, said it was blocked `BLOCKED_FOR` in this quorum and the round has been
    parked `PARKED_FOR`."""
    quorum = Quorum(QID, tuple(QuorumMember(m) for m in sorted(members)), created=0.0)
    got = left_behind(rid, quorum, blocked, last_seen, frozenset(requests), round_start, NOW)
    gone = tuple(m for m in quorum.replica_ids if m != rid and m in requests)
    due = (
        blocked is not None
        and round_start is not None
        and rid in members
        and blocked[0] == QID
        and last_seen - blocked[1] >= BLOCKED_FOR
        and NOW - round_start >= PARKED_FOR
        and bool(gone)
    )
    assert got == ((QID, gone) if due else None)
    assert left_behind(rid, None, blocked, last_seen, frozenset(requests), round_start, NOW) is None


def test_the_silence_limit_is_the_quick_silence_or_several_gaps() -> None:
    assert silence_limit(0.0, None) == QUICK_SILENCE == silence_limit(0.1, 0.1)
    assert silence_limit(0.3, None) == silence_limit(0.0, 0.3) == 1.5


def test_the_worker_reports_a_block_when_the_lighthouse_counts_it() -> None:
    """One threshold, read on both sides: a worker reporting sooner would be ignored, later would
    slow every hung-peer recovery down."""
    watch_after = inspect.signature(hang_abort.LostPeerAbort.watch).parameters["after"].default
    assert watch_after is protocol.BLOCKED_FOR
    assert manager.BLOCKED_FOR is protocol.BLOCKED_FOR  # `Manager._blocked`, `Manager._stuck`
