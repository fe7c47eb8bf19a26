"""A hung quorum member is declared lost on evidence (lighthouse/hung.py), and a
configure that waits on a dead rendezvous store is released by the lost-peer abort.

The lighthouse's rule on `Membership` with a hand-driven clock; the worker's side (what its
heartbeats report, the configure) on the Manager with fakes (tests/unit/test_manager_protocol.py).
The real-process SIGSTOP runs are in tests/processes/test_hung_members_mp.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import test_manager_protocol
import torch
from test_lighthouse_membership import ask, events, make
from test_manager_protocol import Group, ScriptedLighthouse, in_step

from ftlaunch.errors import CommunicationError
from ftlaunch.lighthouse.hung import PARKED_FOR, QUICK_SILENCE, parse_blocked
from ftlaunch.lighthouse.membership import Membership
from ftlaunch.lighthouse.protocol import BLOCKED_FOR
from ftlaunch.lighthouse.quorum import QuorumMember

make_group = test_manager_protocol.make  # the fixture: a Manager on fakes

pytestmark = pytest.mark.timeout(60)


def beat(m: Membership, clock: Callable[[], float] | object, rids: str, seconds: float, *, every: float = 0.1,
         blocked: dict[str, tuple[int, float]] | None = None) -> None:  # fmt: skip
    """``rids`` heartbeat every ``every`` seconds for ``seconds``; ``blocked[rid] = (quorum id, since)``
    (on the clock) makes ``rid`` report how long it has been blocked, as a worker does."""
    assert hasattr(clock, "now")
    end = clock.now + seconds  # type: ignore[attr-defined]
    while clock.now < end - 1e-9:  # type: ignore[attr-defined]
        clock.now += every  # type: ignore[attr-defined]
        for rid in rids:
            b = (blocked or {}).get(rid)
            m.heartbeat(rid, blocked=None if b is None else (b[0], clock.now - b[1]))  # type: ignore[attr-defined]
        m.tick()


def formed(*rids: str) -> tuple[Membership, object, int]:
    m, clock = make(heartbeat_timeout=5.0)
    for rid in rids:
        m.heartbeat(rid)
    q = ask(m, *rids)[rids[0]].quorum
    assert q is not None
    return m, clock, q.quorum_id


def test_a_silent_member_that_a_peer_waits_for_is_lost_at_once() -> None:
    """c stops (SIGSTOP): its heartbeats stop; a and b block in the step's allreduce. Once c has been
    silent QUICK_SILENCE and a blocked BLOCKED_FOR, c is lost (failed): far below the heartbeat
    timeout (5 s). When c wakes it is live again, and superseded once the others went on."""
    m, clock, q = formed("a", "b", "c")
    beat(m, clock, "abc", 0.5)  # learns their usual gap (0.1 s)
    since = clock.now  # type: ignore[attr-defined]
    beat(m, clock, "ab", BLOCKED_FOR - 0.1, blocked={"a": (q, since), "b": (q, since)})
    assert m.lost_in_quorum("a") is None  # not yet: blocked less than BLOCKED_FOR
    beat(m, clock, "ab", 0.4, blocked={"a": (q, since), "b": (q, since)})
    assert m.lost_in_quorum("a") == (q, ("c",))
    assert "failed" in events(m, "c")
    assert "hung" in m.snapshot().history[0].detail
    q2 = ask(m, "a", "b")["a"].quorum  # they abort the step and go on without c
    assert q2 is not None and q2.replica_ids == ("a", "b")
    m.heartbeat("c")  # SIGCONT
    assert m.superseded_for("c") == q2.quorum_id


def test_a_member_stopped_between_steps_holds_its_peers_quorum_requests_until_declared() -> None:
    """c stops after a commit, before its next quorum request: a and b park theirs (the fast path
    waits for c). Once c has been silent QUICK_SILENCE and their requests parked PARKED_FOR, c is
    lost and the quorum forms without it -- not after the heartbeat timeout (5 s)."""
    m, clock, q = formed("a", "b", "c")
    beat(m, clock, "abc", 0.5)
    tickets = ask(m, "a", "b")
    beat(m, clock, "ab", 0.3)
    assert not tickets["a"].done
    beat(m, clock, "ab", 0.3)
    assert tickets["a"].quorum is not None and tickets["a"].quorum.replica_ids == ("a", "b")
    assert tickets["a"].quorum.quorum_id != q and "failed" in events(m, "c")
    m2, clock2, _ = formed("a", "b", "c")
    tickets = ask(m2, "a", "b")
    beat(m2, clock2, "abc", 3.0)  # c is slow to ask but beats: waited for (join timeout), not lost
    assert not tickets["a"].done and "failed" not in events(m2, "c")


def test_a_member_that_woke_inside_an_abandoned_step_is_told_to_abort_it() -> None:
    """c was declared hung and woke (revived) before a and b, which aborted the step, asked for the
    next quorum: they wait for c (it is live), c waits in quorum q's collective for them. c's
    heartbeat (blocked on q) is answered with the members that left the step, so c aborts it too."""
    m, clock, q = formed("a", "b", "c")
    since = clock.now  # type: ignore[attr-defined]
    beat(m, clock, "abc", 1.2, blocked={"c": (q, since)})
    assert m.left_behind("c") is None  # its peers are in the step with it (nobody asked)
    tickets = ask(m, "a", "b")
    beat(m, clock, "abc", 0.3, blocked={"c": (q, since)})
    assert m.left_behind("c") is None and not tickets["a"].done  # not parked long enough yet
    beat(m, clock, "abc", 0.3, blocked={"c": (q, since)})
    assert m.left_behind("c") == (q, ("a", "b"))
    assert m.left_behind("a") is None  # not blocked itself
    beat(m, clock, "abc", 0.1)  # c no longer blocked (aborted): nothing more to say
    assert m.left_behind("c") is None
    m.request_quorum(QuorumMember("c"))
    assert tickets["a"].done and tickets["a"].quorum is not None and len(tickets["a"].quorum.replica_ids) == 3


def test_a_slow_member_that_still_beats_is_never_declared_lost() -> None:
    """Under load c's training thread is slow (a and b wait for it for seconds), but its heartbeat
    thread beats: c stays live."""
    m, clock, q = formed("a", "b", "c")
    since = clock.now  # type: ignore[attr-defined]
    beat(m, clock, "abc", 4.0, blocked={"a": (q, since), "b": (q, since)})
    assert m.lost_in_quorum("a") is None and "failed" not in events(m, "c")


def test_silence_alone_or_a_block_on_another_quorum_waits_for_the_heartbeat_timeout() -> None:
    m, clock, q = formed("a", "b", "c")
    beat(m, clock, "ab", 3.0)  # c silent, nobody blocked (c stopped between steps)
    assert m.lost_in_quorum("a") is None
    since = clock.now  # type: ignore[attr-defined]
    beat(m, clock, "ab", 1.5, blocked={"a": (q - 1, since)})  # blocked, but on an older quorum
    assert m.lost_in_quorum("a") is None
    beat(m, clock, "ab", 0.6)  # past the heartbeat timeout: silent, as before
    assert m.lost_in_quorum("a") == (q, ("c",)) and "silent" in events(m, "c")


def test_a_member_that_usually_beats_slowly_gets_a_longer_limit() -> None:
    """c beats every 0.5 s (a loaded machine): a 1.2 s silence is within five of its gaps, not evidence."""
    m, clock, q = formed("a", "b", "c")
    for _ in range(6):
        beat(m, clock, "ab", 0.5)
        m.heartbeat("c")
    assert m.silence_limit("c") == pytest.approx(2.5, abs=0.11)
    since = clock.now  # type: ignore[attr-defined]
    beat(m, clock, "ab", 1.2, blocked={"a": (q, since)})
    assert m.lost_in_quorum("a") is None
    beat(m, clock, "ab", 1.5, blocked={"a": (q, since)})
    assert m.lost_in_quorum("a") == (q, ("c",))


def test_a_stale_block_of_a_member_that_stopped_itself_is_no_evidence() -> None:
    """a reported being blocked, then stopped too: its report says nothing about b any more."""
    m, clock, q = formed("a", "b", "c")
    since = clock.now  # type: ignore[attr-defined]
    beat(
        m, clock, "ab", BLOCKED_FOR - 0.2, blocked={"a": (q, since)}
    )  # c silent, a blocked (not long enough yet)
    beat(m, clock, "b", 1.5)  # then a stops too; b is not blocked
    assert m.lost_in_quorum("b") is None


def test_the_blocked_field_is_parsed_strictly() -> None:
    assert parse_blocked({"quorum_id": 7, "seconds": 1.5}) == (7, 1.5)
    for bad in (
        None,
        [],
        {"quorum_id": "7", "seconds": 1},
        {"quorum_id": True, "seconds": 1},
        {"quorum_id": 7, "seconds": -1},
        {"quorum_id": 7, "seconds": float("nan")},
        {"quorum_id": 7},
    ):
        assert parse_blocked(bad) is None
    assert QUICK_SILENCE >= 0.5 and PARKED_FOR >= 0.5 and BLOCKED_FOR > 0


# ------------------------------------------------------------------ the worker's side


def test_the_leaders_heartbeats_report_a_step_blocked_in_a_collective(
    make_group: Callable[..., Group],
) -> None:
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"), in_step(1, "rg1"))
    probes: list[Callable[[], tuple[int, float] | None]] = []
    lighthouse.report_blocked = probes.append  # type: ignore[attr-defined]
    g = make_group(lighthouse, init_sync=False)
    assert len(probes) == 1
    blocked = probes[0]
    assert blocked() is None  # no quorum yet
    assert g.step()[0] and blocked() is None  # a step that does not wait reports nothing
    g.m.start_quorum()
    g.pg.hang_next("allreduce")
    g.m.allreduce(torch.full((4,), 6.0))
    assert blocked() is None  # pending, but not for BLOCKED_FOR yet
    time.sleep(BLOCKED_FOR + 0.1)
    got = blocked()
    assert got is not None and got[0] == 1 and got[1] >= BLOCKED_FOR
    g.pg.resume()
    assert g.m.should_commit() and blocked() is None


def test_a_configure_waiting_on_a_dead_store_is_aborted_when_the_lighthouse_says_so(
    make_group: Callable[..., Group],
) -> None:
    """Quorum 2's rendezvous store belongs to rg1, which died right after the quorum formed: the
    configure waits on it (60 s and more before). The lighthouse's ``lost`` for quorum 2 aborts it
    (the notice comes after BLOCKED_FOR here, so the heartbeats said the step was blocked); the
    step is not committed and quorum 3 (without rg1) commits. The collective timeout here is 120 s,
    above this test's own timeout."""
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"), in_step(2, "rg1"), in_step(3))
    g = make_group(lighthouse, init_sync=False, timeout=120.0)
    assert g.step()[0]
    released = threading.Event()
    blocked: list[tuple[int, float] | None] = []
    real_configure = g.pg._configure

    def configure(store_addr: str, rank: int, world_size: int) -> None:
        if "/q2/" in store_addr:
            deadline = time.monotonic() + 100
            while g.pg.aborts == 0 and time.monotonic() < deadline:  # the store's host is gone: only an abort
                time.sleep(0.02)  # ends this (as a Baby group's abort kills the child that waits)
            released.set()
            blocked.append(g.m._blocked())  # what the heartbeats said meanwhile
            raise CommunicationError("configure aborted")
        real_configure(store_addr, rank, world_size)

    g.pg._configure = configure  # type: ignore[method-assign]
    threading.Timer(BLOCKED_FOR + 0.3, lighthouse.tell_lost, args=(2, "rg1")).start()
    t0 = time.monotonic()
    committed, _ = g.step()
    assert not committed and released.is_set() and time.monotonic() - t0 < 30
    assert blocked and blocked[0] is not None and blocked[0][0] == 2  # the heartbeats said so meanwhile
    assert g.step()[0]  # quorum 3, alone
    assert g.pg.configure_calls[-1][0].endswith("/q3/r0")


def test_a_configure_of_a_quorum_that_lost_a_participant_is_aborted_at_once(
    make_group: Callable[..., Group],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A configure cannot complete without every participant, so the lighthouse's ``lost`` aborts
    one in flight at once -- not only after it waited BLOCKED_FOR, as an allreduce must (a dead
    peer makes that fail by itself). In the soak the store's host died as the quorum formed: the
    joining group's configure waited a second for nothing, its peers in the next quorum with it.
    (BLOCKED_FOR is made longer than this test's timeout: only the at-once rule can release it.)"""
    from ftlaunch.worker import manager

    monkeypatch.setattr(manager, "BLOCKED_FOR", 1000.0)
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"), in_step(2, "rg1"), in_step(3))
    g = make_group(lighthouse, init_sync=False, timeout=120.0)
    assert g.step()[0]
    real_configure = g.pg._configure

    def configure(store_addr: str, rank: int, world_size: int) -> None:
        if "/q2/" in store_addr:
            deadline = time.monotonic() + 40
            while g.pg.aborts == 0 and time.monotonic() < deadline:  # only an abort ends this
                time.sleep(0.02)
            raise CommunicationError("configure aborted" if g.pg.aborts else "never aborted")
        real_configure(store_addr, rank, world_size)

    g.pg._configure = configure  # type: ignore[method-assign]
    threading.Timer(0.3, lighthouse.tell_lost, args=(2, "rg1")).start()
    committed, _ = g.step()
    assert not committed and g.pg.aborts == 1
    assert g.step()[0] and g.pg.configure_calls[-1][0].endswith("/q3/r0")
