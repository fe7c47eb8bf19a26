"""The lighthouse's bookkeeping (ftlaunch.lighthouse.membership) in one process: no sockets, no
sleeps, a hand-driven clock. What tests/processes/test_lighthouse_server.py checks over HTTP,
here as rules."""

from __future__ import annotations

import threading

import pytest

from ftlaunch.lighthouse.membership import (
    Abandoned,
    Evicted,
    Left,
    Membership,
    QuorumTicket,
    QuorumTimeout,
    ShuttingDown,
    Superseded,
)
from ftlaunch.lighthouse.quorum import Health, QuorumIdAllocator, QuorumMember, QuorumOptions
from ftlaunch.lighthouse.status import LighthouseStatus


class Clock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def make(
    min_replicas: int = 1, join_timeout: float = 60.0, heartbeat_timeout: float = 5.0
) -> tuple[Membership, Clock]:
    clock = Clock()
    options = QuorumOptions(
        min_replicas=min_replicas, join_timeout=join_timeout, heartbeat_timeout=heartbeat_timeout
    )
    return Membership(options, ids=QuorumIdAllocator(1_700_000_000_000), clock=clock, wall_clock=clock), clock


def ask(m: Membership, *rids: str, **fields: object) -> dict[str, QuorumTicket]:
    return {rid: m.request_quorum(QuorumMember(rid, **fields)) for rid in rids}  # type: ignore[arg-type]


def members(ticket: QuorumTicket) -> tuple[str, ...]:
    assert ticket.done and ticket.quorum is not None, ticket.error
    return ticket.quorum.replica_ids


def events(m: Membership, rid: str | None = None) -> list[str]:
    """History, oldest first (of one group when ``rid`` is given)."""
    return [h.event for h in reversed(m.snapshot().history) if rid is None or h.replica_id == rid]


def test_a_lone_group_gets_its_quorum_at_once() -> None:
    m, _ = make()
    t = m.request_quorum(QuorumMember("a", step=3))
    assert members(t) == ("a",) and t.quorum is not None and t.quorum.member("a").step == 3  # type: ignore[union-attr]
    assert m.snapshot().pending == () and events(m) == ["joined", "quorum"]


def test_fast_quorum_keeps_the_id_and_changes_it_when_it_must() -> None:
    m, _ = make()
    for rid in "ab":
        m.heartbeat(rid)
    first = ask(m, "a", "b")
    assert not first["a"].done or members(first["a"]) == ("a", "b")
    q1 = first["b"].quorum
    assert q1 is not None and members(first["a"]) == ("a", "b")
    same = ask(m, "a", "b")
    assert same["a"].quorum is same["b"].quorum and same["a"].quorum.quorum_id == q1.quorum_id  # type: ignore[union-attr]
    failed = {
        "a": m.request_quorum(QuorumMember("a", commit_failures=1)),
        "b": m.request_quorum(QuorumMember("b")),
    }
    q2 = failed["a"].quorum
    assert q2 is not None and q2.quorum_id > q1.quorum_id
    m.heartbeat("c")  # a newcomer does not hold up a fast quorum of the previous members
    fast = ask(m, "a", "b")
    assert members(fast["a"]) == ("a", "b") and fast["a"].quorum.quorum_id == q2.quorum_id  # type: ignore[union-attr]
    c = m.request_quorum(QuorumMember("c"))
    assert not c.done and "split brain" in m.snapshot().decision  # 1 of 3 live groups
    again = ask(m, "a", "b")
    assert members(c) == ("a", "b", "c") and c.quorum.quorum_id > q2.quorum_id  # type: ignore[union-attr]
    assert again["a"].quorum is c.quorum


def test_a_newer_request_supersedes_the_waiting_one() -> None:
    m, _ = make(min_replicas=2)
    old = m.request_quorum(QuorumMember("a"))
    new = m.request_quorum(QuorumMember("a", step=1))
    assert isinstance(old.error, Superseded) and "superseded" in str(old.error)
    b = m.request_quorum(QuorumMember("b"))
    assert members(b) == ("a", "b") and members(new) == ("a", "b")


def test_leave_ends_the_wait_and_forgets_the_group() -> None:
    m, _ = make(min_replicas=2)
    t = m.request_quorum(QuorumMember("a"))
    assert m.leave("a") is True
    assert isinstance(t.error, Left)
    assert m.snapshot().group("a") is None and m.snapshot().pending == ()
    assert "left" in events(m, "a") and "disconnected" not in events(m, "a")
    assert m.leave("a") is False
    m.connection_lost("a")  # its heartbeat connection closing after the leave is no death
    assert m.snapshot().group("a") is None


def test_evict_tells_once_then_a_fresh_join() -> None:
    m, _ = make(min_replicas=2)
    m.heartbeat("a")
    assert m.evict("a", "bad node") is True
    assert m.snapshot().evicted == ("a",)
    with pytest.raises(Evicted, match="bad node"):
        m.heartbeat("a")
    m.heartbeat("a")  # one-shot
    assert m.snapshot().group("a") is not None and m.snapshot().evicted == ()
    parked = m.request_quorum(QuorumMember("a"))
    assert m.evict("a", "drain")
    assert isinstance(parked.error, Evicted)  # the parked request was its one notice
    m.heartbeat("a")
    assert m.evict("nobody", "x") is False


def test_failure_report_and_lost_connection_wake_the_waiters() -> None:
    m, _ = make()
    for rid in "abcd":
        m.heartbeat(rid)
    waiting = ask(m, "a", "b", "c")  # d is live and has not asked: wait for the straggler
    assert not waiting["a"].done and "straggler" in m.snapshot().decision
    assert m.report_failure("d", "agent saw exit code -9") is True
    assert members(waiting["a"]) == ("a", "b", "c")
    d = m.snapshot().group("d")
    assert d is not None and d.health is Health.FAILED and "exit code -9" in d.reason
    waiting = ask(m, "a", "b")
    assert not waiting["a"].done
    m.connection_lost("c")  # its process died: its bound connection closed
    assert members(waiting["b"]) == ("a", "b")
    assert m.snapshot().group("c").health is Health.DISCONNECTED  # type: ignore[union-attr]
    assert m.report_failure("nobody", "x") is False and events(m)[-1] == "failure_report"


def test_a_revived_member_forces_a_new_id() -> None:
    m, _ = make()
    m.heartbeat("b")
    q1 = ask(m, "a", "b")["b"].quorum
    m.report_failure("b", "blip")
    m.heartbeat("b")  # back: may be a new incarnation under the same name
    assert events(m, "b")[-2:] == ["failed", "revived"]
    q2 = ask(m, "a", "b")["b"].quorum
    assert (
        q1 is not None and q2 is not None and q2.replica_ids == q1.replica_ids and q2.quorum_id > q1.quorum_id
    )


def test_time_alone_silences_a_group_and_ends_the_join_wait() -> None:
    m, clock = make(join_timeout=10.0, heartbeat_timeout=5.0)
    for rid in "abc":
        m.heartbeat(rid)
    waiting = ask(m, "a", "b")
    clock.now += 4.0
    m.heartbeat("a")
    m.heartbeat("b")
    m.tick()
    assert not waiting["a"].done
    clock.now += 2.0  # c: 6 s without a heartbeat
    m.tick()
    assert members(waiting["a"]) == ("a", "b")
    assert m.snapshot().group("c").health is Health.SILENT  # type: ignore[union-attr]
    m.tick()
    assert events(m, "c").count("silent") == 1  # recorded once

    m2, clock2 = make(join_timeout=10.0, heartbeat_timeout=60.0)
    for rid in "abc":
        m2.heartbeat(rid)
    waiting = ask(m2, "a", "b")
    clock2.now += 9.9
    m2.tick()
    assert not waiting["a"].done
    clock2.now += 0.2
    m2.tick()
    assert members(waiting["a"]) == ("a", "b")
    assert "join timeout" in m2.snapshot().history[0].detail


def test_expire_says_why_and_withdraws() -> None:
    m, _ = make(min_replicas=2)
    t = m.request_quorum(QuorumMember("a"))
    m.expire(t, 0.5)
    assert (
        isinstance(t.error, QuorumTimeout)
        and "within 0.5s" in str(t.error)
        and "min_replicas" in str(t.error)
    )
    assert m.snapshot().pending == ()
    m.expire(t, 0.5)  # a second expiry changes nothing
    assert isinstance(t.error, QuorumTimeout)

    m, _ = make(join_timeout=0.0)
    for rid in "abcd":
        m.heartbeat(rid)
    t = ask(m, "a", "b")["a"]
    m.expire(t, 1.0)
    assert "split brain" in str(t.error)


def test_abandon_withdraws_only_the_same_request() -> None:
    m, _ = make(min_replicas=2)
    first = m.request_quorum(QuorumMember("a"))
    second = m.request_quorum(QuorumMember("a"))
    m.abandon(first)  # already superseded: the newer request stays
    assert m.snapshot().pending == ("a",)
    m.abandon(second)
    assert isinstance(second.error, Abandoned) and m.snapshot().pending == ()


def test_close_answers_waiters_and_refuses_everything() -> None:
    m, _ = make(min_replicas=2)
    t = m.request_quorum(QuorumMember("a"))
    m.close()
    assert isinstance(t.error, ShuttingDown)
    with pytest.raises(ShuttingDown):
        m.heartbeat("a")
    with pytest.raises(ShuttingDown):
        m.request_quorum(QuorumMember("b"))
    m.connection_lost("a")
    assert m.snapshot().group("a").health is Health.LIVE  # type: ignore[union-attr]


def test_ticket_callbacks_run_once_from_any_thread() -> None:
    m, _ = make(min_replicas=2)
    t = m.request_quorum(QuorumMember("a"))
    seen: list[tuple[str, bool]] = []
    t.add_done_callback(lambda ticket: seen.append((threading.current_thread().name, ticket.done)))
    other = threading.Thread(target=lambda: m.request_quorum(QuorumMember("b")), name="other")
    other.start()
    other.join(10)
    assert seen == [("other", True)]
    t.add_done_callback(lambda ticket: seen.append(("late", ticket.done)))  # already done: called at once
    assert seen[-1] == ("late", True)
    assert not t.resolve(error=ShuttingDown("x")) and t.quorum is not None  # the first answer wins


def test_snapshot_is_the_status_document() -> None:
    m, clock = make()
    m.heartbeat("b")
    clock.now += 1.0
    ask(m, "a", "b", step=2)
    m.request_quorum(QuorumMember("a", step=3, address="host:1"))
    snap = m.snapshot(
        address="http://x:1", quorum_tick=0.1, admin=True, connections=lambda rid: 2 if rid == "a" else 0
    )
    a = snap.group("a")
    assert a is not None and a.requesting and a.in_quorum and a.step == 3 and a.address == "host:1"
    assert (
        a.connections == 2 and snap.pending == ("a",) and snap.options.admin and snap.address == "http://x:1"
    )
    assert snap.history[0].event == "quorum" and snap.history[0].participants == ("a", "b")
    doc = snap.to_json()
    assert (
        doc["version"] == 1
        and doc["groups"][0]["health"] == "live"
        and doc["quorum"]["quorum_id"] == snap.quorum_id
    )
    assert LighthouseStatus.from_json(doc) == snap


def test_ids_increase_across_memberships_of_one_process() -> None:
    options = QuorumOptions()
    ids = [Membership(options).request_quorum(QuorumMember("a")).quorum.quorum_id for _ in range(3)]  # type: ignore[union-attr]
    assert ids == sorted(set(ids))


# ------------------------------------------------------------------ hostile or broken groups


def test_ids_that_never_joined_a_quorum_are_forgotten_once_gone() -> None:
    """20,000 heartbeat-only ids used to stay listed (and walked by every tick) forever."""
    m, clock = make(heartbeat_timeout=5.0)
    assert m.forget_after == 60.0
    members(m.request_quorum(QuorumMember("real", step=0)))
    for i in range(500):
        m.heartbeat(f"junk{i}")
    assert len(m.snapshot().groups) == 501
    clock.now += 30
    m.tick()  # silent, but not for forget_after yet: still listed
    assert len(m.snapshot().groups) == 501
    clock.now += 31
    m.tick()
    # the real group is silent too, but it was in a quorum: it stays, with its history
    assert [g.replica_id for g in m.snapshot().groups] == ["real"]
    assert "forgotten" in events(m)
    m.heartbeat("junk0")  # a forgotten id that comes back is simply new again
    assert {g.replica_id for g in m.snapshot().groups} == {"real", "junk0"}


def test_the_tick_looks_for_ids_to_forget_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """the look walks every id; with 1024 groups it ran every 0.1 s tick for ids
    that are forgotten a minute after they went away at the earliest."""
    from ftlaunch.lighthouse import membership
    from ftlaunch.lighthouse.membership import FORGET_CHECK_EVERY

    m, clock = make()
    walks = []
    real = membership.forgettable

    def forgettable(*args: object, **kwargs: object) -> list[str]:
        walks.append(clock.now)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(membership, "forgettable", forgettable)
    for _ in range(25):  # 2.5 s of ticks
        m.tick()
        clock.now += 0.1
    assert FORGET_CHECK_EVERY == 1.0 and len(walks) == 3


def test_tracked_ids_are_capped() -> None:
    from ftlaunch.lighthouse.membership import TooManyGroups

    clock = Clock()
    m = Membership(QuorumOptions(heartbeat_timeout=5.0), clock=clock, wall_clock=clock, max_groups=10)
    for i in range(10):
        m.heartbeat(f"g{i}")
    with pytest.raises(TooManyGroups):
        m.heartbeat("one-too-many")
    clock.now += 6  # all silent now: room is made by forgetting those that never joined a quorum
    m.heartbeat("one-too-many")
    assert [g.replica_id for g in m.snapshot().groups] == ["one-too-many"]


def test_a_second_incarnation_cannot_take_a_live_id() -> None:
    from ftlaunch.lighthouse.membership import HeldElsewhere

    m, clock = make(min_replicas=2)
    parked = m.request_quorum(QuorumMember("a", step=1), incarnation="p1")
    with pytest.raises(HeldElsewhere):
        m.request_quorum(QuorumMember("a", step=1), incarnation="p2")
    with pytest.raises(HeldElsewhere):
        m.heartbeat("a", incarnation="p2")
    with pytest.raises(HeldElsewhere):
        m.leave("a", incarnation="p2")
    assert not parked.done  # the holder's request was not pushed out
    m.heartbeat("a", incarnation="p1")
    m.connection_lost("a")  # the holder died: its id is free for the next incarnation
    m.heartbeat("a", incarnation="p2")
    with pytest.raises(HeldElsewhere):  # and now p2 holds it
        m.heartbeat("a", incarnation="p1")


def test_a_far_ahead_step_is_refused_not_made_everyones_source() -> None:
    """A group claiming step 10**9 would be the only source of every healer (a poisoned model, its
    store as everyone's meeting point). Steps advance one per committed round."""
    from ftlaunch.lighthouse.membership import ImplausibleStep

    m, _ = make(min_replicas=1)
    for step in range(3):
        members(m.request_quorum(QuorumMember("a", step=step)))
    with pytest.raises(ImplausibleStep, match="step 10+, .*healing source"):
        m.request_quorum(QuorumMember("evil", step=10**9, address="evil:1"))
    with pytest.raises(ImplausibleStep):
        m.request_quorum(QuorumMember("a", step=50))  # a member of the last quorum too
    assert "evil" not in {g.replica_id for g in m.snapshot().groups}
    # what honest groups do stays allowed: the next step, a healer behind, a fresh group at 0
    assert members(m.request_quorum(QuorumMember("a", step=3))) == ("a",)
    m.request_quorum(QuorumMember("b", step=0))  # a fresh group (it will heal) is not refused
    assert m.snapshot().pending == ("b",)


def test_no_step_rule_before_the_first_quorum() -> None:
    """A new (or restarted) lighthouse has seen no quorum: groups resuming at step 5000 are accepted."""
    m, _ = make()
    assert members(m.request_quorum(QuorumMember("a", step=5000))) == ("a",)


def test_a_participant_is_told_which_members_of_its_quorum_were_lost_until_the_next_quorum() -> None:
    """The heartbeat answer's ``lost`` (worker/hang_abort.py aborts the step with it): a member that
    went silent, failed, was disconnected, evicted or left is listed to the live participants of the
    quorum in use; a member that is slow but beats is never listed; a revived one no longer is; after
    the next quorum forms nothing is (an answer about the old quorum would be stale)."""
    m, clock = make(heartbeat_timeout=5.0)
    for rid in "abcd":
        m.heartbeat(rid)
    q1 = ask(m, "a", "b", "c", "d")["a"].quorum
    assert q1 is not None and all(m.lost_in_quorum(r) is None for r in "abcd")
    for _ in range(3):  # b and c keep beating (slow steps); d stops (SIGSTOP)
        clock.now += 2.0
        for rid in "abc":
            m.heartbeat(rid)
        m.tick()
    assert m.lost_in_quorum("a") == (q1.quorum_id, ("d",))
    assert m.lost_in_quorum("d") == (q1.quorum_id, ("d",)) and m.lost_in_quorum("zz") is None
    m.report_failure("c", "agent saw exit code -9")
    assert m.lost_in_quorum("b") == (q1.quorum_id, ("c", "d"))
    m.heartbeat("d")  # SIGCONT: d beats again
    assert m.lost_in_quorum("b") == (q1.quorum_id, ("c",))
    m.leave("b")
    assert m.lost_in_quorum("a") == (q1.quorum_id, ("b", "c"))
    assert m.superseded_for("a") is None and m.superseded_for("d") is None  # still in the quorum in use
    clock.now += 6.0  # d stopped again; a beats and asks: the next quorum goes on without d
    m.heartbeat("a")
    m.tick()
    q2 = ask(m, "a")["a"].quorum
    assert q2 is not None and q2.quorum_id > q1.quorum_id and m.lost_in_quorum("a") is None
    # d resumes: it was in a quorum and is not in the current one, so it is told which one went on.
    m.heartbeat("d")
    assert m.superseded_for("d") == q2.quorum_id and m.superseded_for("a") is None
    m.heartbeat("newcomer")
    assert m.superseded_for("newcomer") is None  # never in a quorum: nothing of an older one to abort

    m2, _ = make()
    for rid in "ab":
        m2.heartbeat(rid)
    ask(m2, "a", "b")
    m2.connection_lost("b")
    assert m2.lost_in_quorum("a") is not None
    m3, _ = make()
    for rid in "ab":
        m3.heartbeat(rid)
    q = ask(m3, "a", "b")["a"].quorum
    m3.evict("b", "admin")
    assert q is not None and m3.lost_in_quorum("a") == (q.quorum_id, ("b",))


def test_every_group_lost_the_first_back_waits_for_the_others_then_both_form() -> None:
    m, clock = make(join_timeout=30.0)
    for rid in "ab":
        m.heartbeat(rid)
    assert members(ask(m, "a", "b", step=13)["a"]) == ("a", "b")
    m.connection_lost("a")  # every process of the job killed
    m.connection_lost("b")
    clock.now += 3.0
    first = m.request_quorum(QuorumMember("a", step=10))  # a restarted from the checkpoint of step 10
    for _ in range(20):
        clock.now += 1.0
        m.heartbeat("a")
        m.tick()
    assert not first.done and "come back" in m.snapshot().decision
    second = m.request_quorum(QuorumMember("b", step=10))
    assert members(first) == ("a", "b") and members(second) == ("a", "b")
    # A survivor at the job's step does not wait for the other's return.
    m.connection_lost("b")
    assert members(m.request_quorum(QuorumMember("a", step=11))) == ("a",)


def test_a_restarted_process_reads_as_step_0_until_it_asks() -> None:
    m, _ = make()
    m.heartbeat("a", incarnation="old")
    assert members(m.request_quorum(QuorumMember("a", step=13), incarnation="old")) == ("a",)
    m.connection_lost("a")
    m.heartbeat("a", incarnation="old")  # the same process back from a blip keeps its step
    assert m.snapshot().group("a").step == 13  # type: ignore[union-attr]
    m.connection_lost("a")
    m.heartbeat("a", incarnation="new")  # its agent restarted it: what it holds is not known yet
    assert m.snapshot().group("a").step == 0  # type: ignore[union-attr]
    m.request_quorum(QuorumMember("a", step=10), incarnation="new")
    assert m.snapshot().group("a").step == 10  # type: ignore[union-attr]
