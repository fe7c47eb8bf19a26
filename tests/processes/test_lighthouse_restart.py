"""A lighthouse that dies and comes back.

In one process: the restarted lighthouse's adoption of the groups' resume reports
(`resume.adoption` applied by `Membership`, hand-driven clock), and the leader's `OutageTolerantClient`
waiting out an outage (scripted inner client). Over real sockets: a `LighthouseClient` whose
lighthouse is stopped and restarted on the same port longer than its connect timeout. The
multi-process runs (workers training through a SIGKILLed / SIGTERMed lighthouse) are in
tests/processes/test_lighthouse_restart_e2e.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from ftlaunch import env
from ftlaunch.errors import ConfigurationError, LighthouseUnavailableError, QuorumTimeoutError
from ftlaunch.lighthouse.client import LighthouseClient
from ftlaunch.lighthouse.membership import Membership
from ftlaunch.lighthouse.protocol import RESUME_KEY
from ftlaunch.lighthouse.quorum import (
    Quorum,
    QuorumIdAllocator,
    QuorumMember,
    QuorumOptions,
    decode_quorum_id,
)
from ftlaunch.lighthouse.reconnect import OutageTolerantClient, resume_report
from ftlaunch.lighthouse.server import LighthouseServer


class Clock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def fresh(heartbeat_timeout: float = 5.0, wall_ms: int = 1_700_000_000_000) -> tuple[Membership, Clock]:
    clock = Clock()
    options = QuorumOptions(min_replicas=1, join_timeout=60.0, heartbeat_timeout=heartbeat_timeout)
    return Membership(options, ids=QuorumIdAllocator(wall_ms), clock=clock, wall_clock=clock), clock


def report(quorum_id: int, *members: str) -> dict:
    return {RESUME_KEY: {"quorum_id": quorum_id, "members": list(members)}}


# ------------------------------------------------------------------ the restarted lighthouse


def test_without_reports_the_first_group_back_forms_a_quorum_alone() -> None:
    """The behaviour the reports fix: a fresh lighthouse forms from whoever asked first."""
    m, _ = fresh()
    t = m.request_quorum(QuorumMember("rg0", step=7))
    assert t.done and t.quorum is not None and t.quorum.replica_ids == ("rg0",)


def test_a_reported_quorum_forms_at_once_when_its_members_are_back_under_a_higher_id() -> None:
    m, _ = fresh(wall_ms=1_600_000_000_000)  # this lighthouse's clock is behind the old one's
    old_id = QuorumIdAllocator(1_700_000_000_000).take()
    a = m.request_quorum(QuorumMember("rg0", step=7, data=report(old_id, "rg0", "rg1", "rg2")))
    assert not a.done, "it must wait for the other reported members, not form alone"
    status = m.snapshot()
    assert {g.replica_id for g in status.groups} == {"rg0", "rg1", "rg2"} and status.live_count == 3
    b = m.request_quorum(QuorumMember("rg1", step=7, data=report(old_id, "rg0", "rg1", "rg2")))
    assert not b.done
    c = m.request_quorum(QuorumMember("rg2", step=7))  # one that never noticed the outage: no report
    for t in (a, b, c):
        assert t.done and t.quorum is not None and t.quorum.replica_ids == ("rg0", "rg1", "rg2")
    q = a.quorum
    assert q is not None and q.quorum_id > old_id, "ids are never reused across lighthouses"
    assert decode_quorum_id(q.quorum_id)[0] > decode_quorum_id(old_id)[0]
    assert all(RESUME_KEY not in p.data for p in q.participants), "the report is consumed, not echoed"
    assert "resumed" in [h.event for h in m.snapshot().history]


def test_a_reported_member_that_never_comes_back_is_waited_for_only_a_heartbeat_timeout() -> None:
    m, clock = fresh(heartbeat_timeout=5.0)
    a = m.request_quorum(QuorumMember("rg0", data=report(10, "rg0", "rg1", "rg2")))
    b = m.request_quorum(QuorumMember("rg1"))
    m.tick()
    assert not a.done and not b.done
    clock.now += 4.0
    m.heartbeat("rg0"), m.heartbeat("rg1")
    m.tick()
    assert not a.done
    clock.now += 1.5  # rg2 (known only from the report) is now silent: form without it
    m.heartbeat("rg0"), m.heartbeat("rg1")
    m.tick()
    assert a.done and a.quorum is not None and a.quorum.replica_ids == ("rg0", "rg1")


def test_the_newest_report_wins_and_reports_are_ignored_once_this_lighthouse_formed_one() -> None:
    m, _ = fresh()
    a = m.request_quorum(QuorumMember("rg0", data=report(5, "rg0", "rg1", "rg2")))
    b = m.request_quorum(QuorumMember("rg1", data=report(9, "rg0", "rg1")))  # newer: rg2 had left
    assert a.done and b.done and a.quorum is not None and a.quorum.replica_ids == ("rg0", "rg1")
    first = a.quorum.quorum_id
    # The next round: a late report of an old quorum changes nothing.
    a2 = m.request_quorum(QuorumMember("rg0", data=report(9, "rg0", "rg1", "rg7")))
    b2 = m.request_quorum(QuorumMember("rg1"))
    assert a2.done and b2.done and a2.quorum is not None and a2.quorum.quorum_id == first
    assert "rg7" not in {g.replica_id for g in m.snapshot().groups}


def test_a_restarted_lighthouse_forms_no_quorum_of_fresh_groups_during_its_grace() -> None:
    """A group restarted from scratch must not start a lineage of its own before the groups that
    hold the job's state are back (they were waiting out the outage with backoff)."""
    clock = Clock()
    m = Membership(
        QuorumOptions(heartbeat_timeout=5.0),
        ids=QuorumIdAllocator(1_700_000_000_000),
        clock=clock,
        wall_clock=clock,
        startup_grace=5.0,
    )
    fresh_group = m.request_quorum(QuorumMember("rg2", step=0))
    m.tick()
    assert not fresh_group.done and "resume reports" in m.snapshot().decision
    holder = m.request_quorum(QuorumMember("rg0", step=244, data=report(7, "rg0", "rg1", "rg2")))
    m.tick()
    assert not holder.done  # rg1 was reported: wait for it (at most a heartbeat timeout)
    back = m.request_quorum(QuorumMember("rg1", step=244))
    for t in (fresh_group, holder, back):
        assert t.done and t.quorum is not None and t.quorum.replica_ids == ("rg0", "rg1", "rg2")
    # without any report, the grace ends and the usual rules apply
    m2 = Membership(QuorumOptions(), clock=clock, wall_clock=clock, startup_grace=5.0)
    t = m2.request_quorum(QuorumMember("rg0"))
    clock.now += 5.1
    m2.heartbeat("rg0")
    m2.tick()
    assert t.done


@pytest.mark.parametrize(
    "bad",
    [
        None,
        3,
        {"quorum_id": "1", "members": ["a"]},
        {"quorum_id": 1, "members": []},
        {"quorum_id": 1, "members": [""]},
        {"quorum_id": True, "members": ["a"]},
        {"quorum_id": -1, "members": ["a"]},
        {"quorum_id": 1, "members": "rg0"},
        {"quorum_id": 1, "members": ["x" * 300]},
    ],
)
def test_a_malformed_report_is_ignored_and_stripped(bad: object) -> None:
    m, _ = fresh()
    t = m.request_quorum(QuorumMember("rg0", data={RESUME_KEY: bad, "ckpt": ["x"]}))
    assert t.done and t.quorum is not None and t.quorum.participants[0].data == {"ckpt": ["x"]}


# ------------------------------------------------------------------ the leader's client


class ScriptedClient:
    """Inner client: fails ``down`` times with LighthouseUnavailableError, then answers."""

    def __init__(self, down: int, error: Exception | None = None) -> None:
        self.down = down
        self.error = error or LighthouseUnavailableError("lighthouse http://x:1 unreachable")
        self.requests: list[QuorumMember] = []
        self.next_id = 100
        self.closed = False

    def quorum(self, member: QuorumMember, timeout: float) -> Quorum:
        self.requests.append(member)
        if self.down > 0:
            self.down -= 1
            raise self.error
        self.next_id += 1
        return Quorum(self.next_id, (QuorumMember(member.replica_id), QuorumMember("rg9")), created=0.0)

    def start_heartbeat(self, replica_id: str, interval: float) -> object:
        return None

    def leave(self, replica_id: str) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_the_client_waits_out_an_outage_and_then_reports_its_last_quorum() -> None:
    inner = ScriptedClient(down=0)
    client = OutageTolerantClient(inner, outage_timeout=30.0)
    q1 = client.quorum(QuorumMember("rg0", step=1), timeout=5.0)
    assert RESUME_KEY not in inner.requests[-1].data, "no report while the lighthouse answered"
    inner.down = 3
    q2 = client.quorum(QuorumMember("rg0", step=2, data={"ckpt": []}), timeout=5.0)
    assert len(inner.requests) == 5 and q2.quorum_id > q1.quorum_id
    sent = inner.requests[-1].data
    assert sent[RESUME_KEY] == resume_report(q1) and sent["ckpt"] == []
    client.quorum(QuorumMember("rg0", step=3), timeout=5.0)
    assert RESUME_KEY not in inner.requests[-1].data, "one report per outage"


def test_before_the_first_quorum_an_unreachable_lighthouse_fails_at_once() -> None:
    """A wrong address must not look like an outage: nothing to ride out yet."""
    inner = ScriptedClient(down=1)
    with pytest.raises(LighthouseUnavailableError, match="No lighthouse has answered there: start one"):
        OutageTolerantClient(inner, outage_timeout=600).quorum(QuorumMember("rg0"), timeout=5.0)
    assert len(inner.requests) == 1


def test_a_restarted_worker_waits_for_the_lighthouse_from_its_first_request() -> None:
    inner = ScriptedClient(down=2)
    q = OutageTolerantClient(inner, outage_timeout=30, known_reachable=True).quorum(QuorumMember("rg0"), 5.0)
    assert q.quorum_id == 101 and len(inner.requests) == 3


def test_the_client_gives_up_after_the_outage_timeout() -> None:
    inner = ScriptedClient(down=0)
    client = OutageTolerantClient(inner, outage_timeout=0.3)
    client.quorum(QuorumMember("rg0"), timeout=5.0)
    inner.down = 10**6
    start = time.monotonic()
    with pytest.raises(LighthouseUnavailableError, match="outage timeout"):
        client.quorum(QuorumMember("rg0"), timeout=5.0)
    assert time.monotonic() - start >= 0.3


def test_outage_timeout_zero_raises_at_once_and_other_errors_are_not_retried() -> None:
    for outage, error, exc in (
        (0, None, LighthouseUnavailableError),
        (30, QuorumTimeoutError("408"), QuorumTimeoutError),
    ):
        inner = ScriptedClient(down=0, error=error)
        client = OutageTolerantClient(inner, outage_timeout=outage)
        client.quorum(QuorumMember("rg0"), timeout=5.0)
        inner.down = 1
        with pytest.raises(exc):
            client.quorum(QuorumMember("rg0"), timeout=5.0)
        assert len(inner.requests) == 2


def test_close_ends_a_wait_in_progress() -> None:
    inner = ScriptedClient(down=0)
    client = OutageTolerantClient(inner, outage_timeout=600.0)
    client.quorum(QuorumMember("rg0"), timeout=5.0)
    inner.down = 10**6
    threading.Timer(0.3, client.close).start()
    start = time.monotonic()
    with pytest.raises(LighthouseUnavailableError):
        client.quorum(QuorumMember("rg0"), timeout=5.0)
    assert time.monotonic() - start < 30 and inner.closed


def test_outage_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FTLAUNCH_LIGHTHOUSE_OUTAGE", raising=False)
    assert env.WorkerEnv.from_environ().lighthouse_outage == 300.0
    monkeypatch.setenv("FTLAUNCH_LIGHTHOUSE_OUTAGE", "2m")
    assert env.WorkerEnv.from_environ().lighthouse_outage == 120.0
    assert OutageTolerantClient(ScriptedClient(down=0), 7).outage_timeout == 7.0
    for bad in ("soon", "-5", "inf", "25h"):
        monkeypatch.setenv("FTLAUNCH_LIGHTHOUSE_OUTAGE", bad)
        with pytest.raises(ConfigurationError, match="FTLAUNCH_LIGHTHOUSE_OUTAGE"):
            env.WorkerEnv.from_environ()
    for value in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigurationError, match="lighthouse outage timeout"):
            OutageTolerantClient(ScriptedClient(down=0), value)


# ------------------------------------------------------------------ over real sockets


def test_three_leaders_ride_out_a_lighthouse_restart_longer_than_the_connect_timeout() -> None:
    """Stop the lighthouse, keep it down for 3x the connect timeout, start a new one on the same
    port: every leader's parked quorum request gets the new lighthouse's quorum, all together,
    under an id above the old one."""
    server = LighthouseServer("127.0.0.1:0", heartbeat_timeout=5.0, join_timeout=30.0).start()
    port = int(server.address.rsplit(":", 1)[1])
    clients = [
        OutageTolerantClient(LighthouseClient(server.address, connect_timeout=0.5), outage_timeout=60.0)
        for _ in range(3)
    ]
    rids = [f"rg{i}" for i in range(3)]
    try:
        for c, rid in zip(clients, rids, strict=True):
            c.start_heartbeat(rid, 0.2)
        results: dict[str, Quorum] = {}

        def ask_all(step: int) -> None:
            threads = [
                threading.Thread(
                    target=lambda c=c, r=r: results.__setitem__(r, c.quorum(QuorumMember(r, step=step), 60.0))
                )
                for c, r in zip(clients, rids, strict=True)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)

        deadline = time.monotonic() + 30
        while server.snapshot().live_count < 3 and time.monotonic() < deadline:  # every heartbeat arrived
            time.sleep(0.05)
        ask_all(1)
        first = results["rg0"].quorum_id
        assert {results[r].quorum_id for r in rids} == {first}
        results.clear()
        server.shutdown()  # answers nothing more: the leaders now ask a dead port
        threads = threading.Thread(target=ask_all, args=(2,))
        threads.start()
        time.sleep(1.5)  # 3x the connect timeout
        assert not results
        server = LighthouseServer(f"127.0.0.1:{port}", heartbeat_timeout=5.0, join_timeout=30.0).start()
        threads.join(60)
        assert set(results) == set(rids), "every leader got a quorum from the new lighthouse"
        q = results["rg0"]
        assert q.replica_ids == tuple(rids) and q.quorum_id > first
        assert {results[r].quorum_id for r in rids} == {q.quorum_id}
        assert "resumed" in [h.event for h in server.snapshot().history]
    finally:
        for c in clients:
            c.close()
        server.shutdown()


class _CountingClient(ScriptedClient):
    """Counts failed connections as LighthouseClient does, and takes the heartbeats' report probe."""

    connection_failures = 0
    probe = None

    def quorum(self, member: QuorumMember, timeout: float) -> Quorum:
        try:
            return super().quorum(member, timeout)
        except LighthouseUnavailableError:
            self.connection_failures += 1
            raise

    def report_resume(self, probe) -> None:  # type: ignore[no-untyped-def]
        self.probe = probe


def test_the_heartbeats_report_the_last_quorum_while_the_lighthouse_may_have_restarted() -> None:
    """Groups stepping on their last quorum through an outage ask for no quorum while a stopped peer
    blocks their step: the report must reach a restarted lighthouse on their heartbeats too."""
    inner = _CountingClient(down=0)
    client = OutageTolerantClient(inner, outage_timeout=30.0)
    assert inner.probe is not None and inner.probe() is None  # no quorum yet
    q1 = client.quorum(QuorumMember("rg0", step=1), timeout=5.0)
    assert inner.probe() is None  # the lighthouse answered since
    inner.connection_failures += 1  # a heartbeat found the lighthouse gone
    assert inner.probe() == resume_report(q1)
    client.quorum(QuorumMember("rg0", step=2), timeout=5.0)
    assert inner.probe() is None


def test_a_heartbeat_delivers_the_resume_report_once_per_outage_and_an_older_lighthouse_is_beaten_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ftlaunch.lighthouse import routes

    server = LighthouseServer("127.0.0.1:0", heartbeat_timeout=5.0).start()
    seen: list[object] = []
    real = server._membership.heartbeat

    def spy(replica_id: str, *args: object, **kwargs: object) -> str | None:
        seen.append(kwargs.get("resume"))
        return real(replica_id, *args, **kwargs)  # type: ignore[arg-type]

    server._membership.heartbeat = spy  # type: ignore[method-assign]
    client = LighthouseClient(server.address, connect_timeout=2.0)
    old = LighthouseClient(server.address, connect_timeout=2.0)
    try:
        report = {"quorum_id": 77, "members": ["rg0", "rg1"]}
        client.report_resume(lambda: report)
        client.heartbeat("rg0")
        client.heartbeat("rg0")
        assert seen == [report, None], "delivered once"
        assert "resumed" in [h.event for h in server.snapshot().history]
        client.connection_failures += 1  # the lighthouse may have restarted again: tell it again
        client.heartbeat("rg0")
        assert seen[-1] == report
        monkeypatch.delitem(routes._HEARTBEAT_OPTIONAL, "resume")  # a lighthouse older than the field
        old.report_resume(lambda: report)
        old.heartbeat("rg1")
        old.heartbeat("rg1")
        assert seen[-2:] == [None, None] and "resume" in old._refused
    finally:
        client.close()
        old.close()
        server.shutdown()
