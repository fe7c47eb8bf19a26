"""A restarted lighthouse declares hung a member of the quorum it adopted from the groups' resume
reports (lighthouse/hung.py; docs/lighthouse.md, *Hung members*).

After a restart the lighthouse has formed no quorum: the groups step on their last one through
the outage and report ``blocked`` on its id, and their quorum requests park until every member
of it asked. A member whose heartbeats reached this lighthouse (twice) and then stopped, while a
peer waits for it, is lost on that evidence; a member it never heard from -- or heard once -- may
be reconnecting with backoff (or just told a slower pace): it is waited for until the heartbeat
timeout, as before. `Membership` with a hand-driven clock, in one process.
"""

from __future__ import annotations

import pytest
from test_hung_members import beat
from test_lighthouse_membership import Clock, events, make

from ftlaunch.lighthouse.hung import MIN_BEATS, QUICK_SILENCE, SILENCE_GAPS
from ftlaunch.lighthouse.membership import Membership, QuorumTicket
from ftlaunch.lighthouse.protocol import BLOCKED_FOR, RESUME_KEY, advised_heartbeat_interval
from ftlaunch.lighthouse.quorum import QuorumMember

pytestmark = pytest.mark.timeout(60)

#: The quorum the groups had with the lighthouse that died (an id of the old lighthouse's).
OLD = 1_699_000_000_000 << 20


def probe(m: Membership, rid: str, members: str = "abc") -> QuorumTicket:
    """``rid``'s quorum request after the outage, with its resume report (the last quorum: OLD)."""
    report = {RESUME_KEY: {"quorum_id": OLD, "members": list(members)}}
    return m.request_quorum(QuorumMember(rid, step=40, data=report))


def restarted(seen: str) -> tuple[Membership, Clock]:
    """A restarted lighthouse: ``seen`` are back and beating (every 0.1 s) for 0.5 s; then a's
    request adopts quorum OLD (a, b, c) and is withdrawn (a stepping on it through the outage
    waits at most a second for an answer, worker/outage.py): no request is parked."""
    m, clock = make(heartbeat_timeout=5.0)
    beat(m, clock, seen, 0.5)
    m.abandon(probe(m, "a"))
    assert m.snapshot().pending == () and m.snapshot().quorum is None
    return m, clock


def test_an_adopted_member_that_beat_then_stopped_while_a_peer_is_blocked_is_lost_at_once() -> None:
    """c beat to the new lighthouse, then stopped (SIGSTOP); a and b, stepping on quorum OLD
    through the outage, block in its collective and say so (``blocked`` on OLD). Once a was blocked
    BLOCKED_FOR and c silent 0.5 s, c is lost: a and b are told so (``lost`` on OLD) and abort the step --
    not at the heartbeat timeout (5 s)."""
    m, clock = restarted("abc")
    since = clock.now
    beat(m, clock, "ab", BLOCKED_FOR - 0.1, blocked={"a": (OLD, since), "b": (OLD, since)})
    assert m.lost_in_quorum("a") is None and "failed" not in events(m, "c")  # blocked < BLOCKED_FOR: not yet
    beat(m, clock, "ab", 0.2, blocked={"a": (OLD, since), "b": (OLD, since)})
    assert m.lost_in_quorum("a") == (OLD, ("c",)) and m.lost_in_quorum("b") == (OLD, ("c",))
    assert "failed" in events(m, "c") and f"quorum {OLD}" in m.snapshot().history[0].detail
    tickets = {rid: probe(m, rid) for rid in "ab"}  # they aborted the step and ask: c is not waited for
    q = tickets["a"].quorum
    assert q is not None and q.replica_ids == ("a", "b") and q.quorum_id > OLD
    m.heartbeat("c")  # SIGCONT: it is still in quorum OLD's step, which its peers left
    assert m.superseded_for("c") == q.quorum_id


def test_an_adopted_member_that_holds_its_peers_parked_requests_is_lost_at_once() -> None:
    """c reconnected only after the adoption (2 s of backoff: the gap from the adoption to its
    first beat is not one of its heartbeat gaps), beat, then stopped, while a and b park their
    requests for a quorum that waits for it (the fast path): lost after 0.5 s of silence."""
    m, clock = make(heartbeat_timeout=5.0)
    beat(m, clock, "ab", 0.5)
    tickets = {rid: probe(m, rid) for rid in "ab"}
    beat(m, clock, "ab", 2.0)  # c: a stand-in, live for a heartbeat timeout from the adoption
    beat(m, clock, "abc", 0.3)
    assert m.silence_limit("c") == pytest.approx(QUICK_SILENCE)
    beat(m, clock, "ab", 0.4)
    assert not tickets["a"].done
    beat(m, clock, "ab", 0.2)
    assert "failed" in events(m, "c")
    q = tickets["a"].quorum
    assert q is not None and q.replica_ids == ("a", "b") and q.quorum_id > OLD


def test_a_resume_report_on_a_heartbeat_is_adopted_when_nobody_asks_for_a_quorum() -> None:
    """The lighthouse came back while a, b and c stepped on quorum OLD; c stopped before any of them
    asked for a quorum (groups stepping through an outage ask only every few steps), and a and b
    block in OLD's collective with it: no request will come. Their heartbeats carry the resume
    report (LighthouseClient.report_resume): the lighthouse adopts OLD from them and declares c hung."""
    m, clock = make(heartbeat_timeout=5.0)
    beat(m, clock, "abc", 0.5)
    report = {"quorum_id": OLD, "members": list("abc")}
    m.heartbeat("a", resume=report)
    assert "resumed" in events(m) and m.snapshot().pending == ()
    since = clock.now
    beat(m, clock, "ab", 1.1, blocked={"a": (OLD, since), "b": (OLD, since)})
    assert m.lost_in_quorum("b") == (OLD, ("c",)) and "failed" in events(m, "c")
    tickets = {rid: probe(m, rid) for rid in "ab"}
    q = tickets["a"].quorum
    assert q is not None and q.replica_ids == ("a", "b")
    m.heartbeat("a", resume=report)  # a late report once this lighthouse formed a quorum: ignored
    assert events(m).count("resumed") == 1


@pytest.mark.parametrize("beats", [0, 1])
def test_an_adopted_member_not_heard_twice_waits_for_the_heartbeat_timeout(beats: int) -> None:
    """c never reached the new lighthouse (it may be backing off before reconnecting), or reached
    it once (it may just have been told a slower pace): however long a and b are blocked on OLD,
    c is not declared hung. At the heartbeat timeout it is silent, as before -- and then a and b,
    which step on OLD, are told (``lost``) too."""
    assert beats < MIN_BEATS
    m, clock = restarted("ab")
    for _ in range(beats):
        m.heartbeat("c")
    since = clock.now
    beat(m, clock, "ab", 4.8, blocked={"a": (OLD, since), "b": (OLD, since)})
    assert m.lost_in_quorum("a") is None and "failed" not in events(m, "c")
    beat(m, clock, "ab", 0.4, blocked={"a": (OLD, since), "b": (OLD, since)})
    assert "silent" in events(m, "c") and "failed" not in events(m, "c")
    assert m.lost_in_quorum("a") == (OLD, ("c",))


def test_a_slow_adopted_member_that_still_beats_is_not_lost_until_it_stops() -> None:
    """c's training thread is slow after the restart (a and b wait for it for seconds, blocked on
    OLD, and c's own request is late), but its heartbeat thread beats: c stays live. When it stops
    beating, it is lost on the same evidence."""
    m, clock = restarted("abc")
    since = clock.now
    beat(m, clock, "abc", 4.0, blocked={"a": (OLD, since), "b": (OLD, since)})
    assert m.lost_in_quorum("a") is None and "failed" not in events(m, "c")
    beat(m, clock, "ab", 0.6, blocked={"a": (OLD, since), "b": (OLD, since)})
    assert m.lost_in_quorum("a") == (OLD, ("c",))


def test_a_block_on_another_quorum_is_no_evidence_against_an_adopted_member() -> None:
    """Only a block on the adopted quorum's id says its members are waited for."""
    m, clock = restarted("abc")
    since = clock.now
    beat(m, clock, "ab", 3.0, blocked={"a": (OLD - 1, since), "b": (OLD - 1, since)})
    assert m.lost_in_quorum("a") is None and "failed" not in events(m, "c")


def test_a_member_that_woke_inside_the_adopted_quorums_step_is_told_to_abort_it() -> None:
    """c was declared hung and woke before the next quorum formed: a and b (which aborted the step
    on OLD) park their requests for it, c waits in OLD's collective for them. Its blocked heartbeat
    is answered with the members that left the step."""
    m, clock = restarted("abc")
    since = clock.now
    beat(m, clock, "abc", 1.2, blocked={"c": (OLD, since)})
    tickets = {rid: probe(m, rid) for rid in "ab"}
    beat(m, clock, "abc", 0.6, blocked={"c": (OLD, since)})
    assert m.left_behind("c") == (OLD, ("a", "b")) and not tickets["a"].done


def test_the_silence_limit_is_several_of_the_advised_heartbeat_paces() -> None:
    """A large job's lighthouse asks for slower beats (300 groups: every 0.3 s), and the advice grows
    as a restarted job's groups come back: a member told to beat every 0.3 s is not silent before
    five of them (SILENCE_GAPS), whatever gap it was seen beating at before."""
    m, clock = make(heartbeat_timeout=5.0)
    beat(m, clock, "a", 0.5)
    assert m.silence_limit("a") == pytest.approx(QUICK_SILENCE)
    for i in range(299):
        m.heartbeat(f"g{i}")
    assert m.group_count == 300 and advised_heartbeat_interval(300, 5.0) == 0.3
    assert m.silence_limit("a") == pytest.approx(SILENCE_GAPS * 0.3)


def test_with_hot_spares_an_adopted_member_declared_hung_keeps_its_slot_until_the_heartbeat_timeout() -> None:
    """As for a quorum this lighthouse formed: a stop of a few seconds is cheaper waited out than
    handed to a spare (the slot goes to the spare at the heartbeat timeout, as before the rule)."""
    from test_spares import granted, start_job

    m, clock = make(heartbeat_timeout=5.0)
    spare = start_job(m)  # rg0 and rg1 hold the slots, a spare waits
    beat(m, clock, ["rg0", "rg1"], 0.5)  # type: ignore[arg-type]
    m.heartbeat("rg0", resume={"quorum_id": OLD, "members": ["rg0", "rg1"]})
    since = clock.now
    beat(m, clock, ["rg0"], 1.1, blocked={"rg0": (OLD, since)})  # type: ignore[arg-type]
    assert "failed" in events(m, "rg1") and m.lost_in_quorum("rg0") == (OLD, ("rg1",))
    assert not spare.done  # the slot waits
    beat(m, clock, ["rg0"], 4.0, blocked={"rg0": (OLD, since)})  # type: ignore[arg-type]
    assert granted(spare) == (1, "rg1.1")
