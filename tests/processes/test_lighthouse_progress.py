"""Training progress at the lighthouse (ftlaunch.lighthouse.progress, its place in the membership and
the status, ``/metrics``), in one process with a hand-driven clock; one short test over real HTTP."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftlaunch.lighthouse.client import LighthouseClient
from ftlaunch.lighthouse.membership import Membership
from ftlaunch.lighthouse.metrics import families
from ftlaunch.lighthouse.progress import ProgressBook, ProgressReport, Rewind
from ftlaunch.lighthouse.quorum import QuorumIdAllocator, QuorumMember, QuorumOptions
from ftlaunch.lighthouse.server import LighthouseServer
from ftlaunch.lighthouse.status import LighthouseStatus


class Clock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def make(**options: object) -> tuple[Membership, Clock]:
    clock = Clock()
    opts = QuorumOptions(**options)  # type: ignore[arg-type]
    return Membership(opts, ids=QuorumIdAllocator(1_700_000_000_000), clock=clock, wall_clock=clock), clock


def rep(session: str, step: int, commits: int | None = None, **kw: object) -> ProgressReport:
    return ProgressReport(session, step=step, commits=step if commits is None else commits, **kw)  # type: ignore[arg-type]


def progress(m: Membership, rid: str):
    p = m.snapshot().group_progress(rid)
    assert p is not None
    return p


def test_reports_ride_on_quorum_requests_heartbeats_and_leave_and_add_up_over_sessions() -> None:
    m, clock = make()
    m.request_quorum(QuorumMember("a"), rep("s1", 0, heals=0))
    m.heartbeat(
        "a", rep("s1", 5, heal_seconds=0.0, step_seconds=0.02, quorum_seconds=0.005, commit_seconds=0.001)
    )
    p = progress(m, "a")
    assert (p.step, p.committed, p.sessions, p.restarts, p.step_seconds) == (5, 5, 1, 0, 0.02)
    clock.now += 1
    m.connection_lost("a")  # the process died ...
    m.request_quorum(
        QuorumMember("a"), rep("s2", 6, commits=1, heals=1, heal_seconds=0.25)
    )  # ... its restart healed
    p = progress(m, "a")
    assert (p.committed, p.sessions, p.restarts, p.failures, p.heals, p.heal_seconds) == (6, 2, 1, 1, 1, 0.25)
    assert p.session == "s2" and p.session_first_commit == clock.now and not p.finished
    m.leave("a", rep("s2", 9, commits=4, heals=1, heal_seconds=0.25, checksum="abc", finished=True))
    p = progress(m, "a")  # kept after the group left
    assert m.snapshot().group("a") is None
    assert (p.committed, p.step, p.checksum, p.checksum_step, p.finished) == (9, 9, "abc", 9, True)


def test_a_late_report_of_a_session_does_not_move_it_back() -> None:
    m, _ = make()
    m.heartbeat("a", rep("s1", 5))
    m.heartbeat("a", rep("s1", 3))
    assert progress(m, "a").committed == 5 and progress(m, "a").step == 5


def test_one_failure_per_incident() -> None:
    m, clock = make()
    m.heartbeat("a", rep("s1", 1))
    m.report_failure("a", "supervisor saw it die")
    m.connection_lost("a")  # the same death, noticed again
    clock.now += 10
    m.tick()  # and silent by now: still the same incident
    assert progress(m, "a").failures == 1
    m.heartbeat("a")  # back
    m.report_failure("a", "again")
    assert progress(m, "a").failures == 2
    m.evict("a", "admin")  # down already: not another failure
    assert progress(m, "a").failures == 2


def test_a_group_that_trains_from_behind_a_finished_peer_without_healing_is_unsynced() -> None:
    m, _ = make()
    m.leave("b", rep("b1", 10, checksum="x", finished=True))
    m.heartbeat("b", rep("b1", 10, finished=True))  # b is known, finished at step 10
    m.heartbeat("a", rep("a2", 1))  # a restarted: step 0 -> 1, no heal
    assert progress(m, "a").unsynced_sessions == 1
    m.heartbeat("c", rep("c2", 11, commits=1, heals=1))  # c healed to step 10 first: fine
    assert progress(m, "c").unsynced_sessions == 0


def test_a_quorum_below_the_step_the_job_reached_is_a_rewind() -> None:
    """The lighthouse sees the job go back when a quorum forms below the furthest step of the ones
    before it: no group holding that state was left."""
    book = ProgressBook()
    assert [book.quorum_formed(s, wall=float(s)) for s in (0, 0, 1, 2, 3)] == [None] * 5
    # Both groups died and restarted: the next quorum is at step 0.
    assert book.quorum_formed(0, wall=60.0) == Rewind(reached=3, restarted_at=0, wall=60.0)
    assert book.quorum_formed(1, wall=61.0) is None  # the new run goes on: no more rewinds
    # It lost its state again at step 2: this rewind is of the steps since the last one.
    book.quorum_formed(2, wall=80.0)
    assert book.quorum_formed(0, wall=81.0) == Rewind(reached=2, restarted_at=0, wall=81.0)
    assert book.rewinds() == (Rewind(3, 0, 60.0), Rewind(2, 0, 81.0))


def test_a_rewind_that_a_returning_group_undoes_is_recovered() -> None:
    """The only group at step 50 hung (not died); a restarted one went on alone from step 0; the hung
    one came back at step 50 and the others healed from it: the job lost nothing in the end."""
    book = ProgressBook()
    book.quorum_formed(50, wall=1.0)
    book.quorum_formed(0, wall=2.0)
    for step in range(1, 11):  # the restarted run goes on, a step per quorum
        book.quorum_formed(step, wall=3.0)
    assert book.rewinds() == (Rewind(50, 0, 2.0),)
    book.quorum_formed(50, wall=4.0)
    assert book.rewinds() == (Rewind(50, 0, 2.0, recovered=True),)
    # A restarted run that merely trains past the lost step recovers nothing: it was trained again.
    book = ProgressBook()
    book.quorum_formed(5, wall=1.0)
    book.quorum_formed(0, wall=2.0)
    for step in range(1, 9):
        book.quorum_formed(step, wall=3.0)
    assert book.rewinds() == (Rewind(5, 0, 2.0),)


def test_the_membership_records_a_rewind_in_its_status_and_history() -> None:
    m, _ = make()
    for step in (0, 1, 2):
        m.request_quorum(QuorumMember("a", store_address="a:1", step=step))
    assert m.snapshot().rewinds == ()
    m.request_quorum(QuorumMember("a", store_address="a:1", step=0))  # restarted with nothing to heal from
    status = m.snapshot()
    assert status.rewinds == m.rewinds() and [(r.reached, r.restarted_at) for r in status.rewinds] == [(2, 0)]
    assert any(h.event == "rewind" and h.detail == "step 2 -> 0" for h in status.history)
    assert LighthouseStatus.from_json(status.to_json()).rewinds == status.rewinds
    lost = {f.name: f.samples[0].value for f in families(status) if f.name == "ftlaunch_progress_lost"}
    assert lost == {"ftlaunch_progress_lost": 1.0}


def test_groups_starting_together_are_not_unsynced() -> None:
    m, _ = make()
    m.heartbeat("a", rep("a1", 3))
    m.heartbeat("b", rep("b1", 1))  # behind a running (not finished) group: normal start-up skew
    assert progress(m, "b").unsynced_sessions == 0


def test_step_rates_and_quorum_changes() -> None:
    m, clock = make()
    for step in range(1, 11):
        clock.now += 0.5
        m.heartbeat("a", rep("s", step))
        m.heartbeat("b", rep("t", step))
    status = m.snapshot()
    assert progress(m, "a").step_rate == pytest.approx(2.0)
    assert status.step_rate == pytest.approx(2.0, rel=0.1)  # the job: steps per second, not group-steps
    m.request_quorum(QuorumMember("a"))
    m.request_quorum(QuorumMember("b"))
    assert m.snapshot().quorum_changes >= 1
    clock.now += 60  # nothing committed for a while: no rate
    assert m.snapshot().step_rate == 0.0 and progress(m, "a").step_rate == 0.0


def test_kill_is_told_once_in_a_heartbeat_answer() -> None:
    m, _ = make()
    assert m.heartbeat("a") is None
    assert not m.kill("nobody", "x")
    assert m.kill("a", "from the dashboard")
    assert m.heartbeat("a") == "from the dashboard"
    assert m.heartbeat("a") is None


@pytest.mark.parametrize(
    "bad",
    [
        {"step": 1},
        {"session": "", "step": 1},
        {"session": "s", "step": -1},
        {"session": "s", "steps": 1},
        {"session": "s", "step": True},
        {"session": "s", "heal_seconds": float("nan")},
    ],
)
def test_reports_are_checked(bad: dict) -> None:
    with pytest.raises(ValueError):
        ProgressReport.from_json(bad)


def test_status_json_round_trip_keeps_progress() -> None:
    m, _ = make(expected_replicas=2)
    m.heartbeat("a", rep("s", 4, heals=1, heal_seconds=0.5))
    status = m.snapshot()
    again = LighthouseStatus.from_json(status.to_json())
    assert again.progress == status.progress and again.options.expected_replicas == 2
    assert LighthouseStatus.from_json({**status.to_json(), "progress": []}).progress == ()
    old = status.to_json()
    del old["progress"], old["quorum_changes"], old["step_rate"]
    assert LighthouseStatus.from_json(old).progress == ()  # an older lighthouse's document


def test_metrics_families_from_a_status() -> None:
    m, _ = make(expected_replicas=1)
    m.request_quorum(QuorumMember("a"), rep("s", 0))
    m.heartbeat("a", rep("s", 7, heals=1, heal_seconds=0.5, step_seconds=0.03, commit_seconds=0.002))
    m.heartbeat("b", rep("t", 2))
    m.leave("b", rep("t", 2, finished=True))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in families(m.snapshot())
        for s in fam.samples
    }
    a, b = (("replica_id", "a"),), (("replica_id", "b"),)
    assert samples[("ftlaunch_group_committed_steps_total", a)] == 7
    assert samples[("ftlaunch_group_heals_total", a)] == 1
    assert samples[("ftlaunch_group_heal_seconds_total", a)] == 0.5
    assert samples[("ftlaunch_group_step_seconds", a)] == 0.03
    assert samples[("ftlaunch_group_commit_seconds", a)] == 0.002
    assert samples[("ftlaunch_group_state", (("replica_id", "a"), ("state", "live")))] == 1
    assert samples[("ftlaunch_group_state", (("replica_id", "b"), ("state", "left")))] == 1
    assert samples[("ftlaunch_group_step", b)] == 2
    assert samples[("ftlaunch_groups", (("state", "left"),))] == 1
    assert samples[("ftlaunch_quorum_participants", ())] == 1
    assert samples[("ftlaunch_quorum_changes_total", ())] == 1
    assert samples[("ftlaunch_expected_replicas", ())] == 1
    assert ("ftlaunch_quorum_id", ()) in samples


def test_progress_and_metrics_over_http() -> None:
    """A client's progress rides on its quorum request and its leave; ``/metrics`` serves it."""
    with (
        LighthouseServer("127.0.0.1:0") as server,
        LighthouseClient(server.address, connect_timeout=5) as client,
    ):
        client.set_progress("rg0", rep("s", 3))
        client.quorum(QuorumMember("rg0"), timeout=5)
        assert server.progress()[0].committed == 3
        client.set_progress("rg0", rep("s", 4, checksum="c0ffee", finished=True))
        client.leave("rg0")
        (p,) = server.progress()
        assert (p.committed, p.checksum, p.finished) == (4, "c0ffee", True)
        with urllib.request.urlopen(server.address + "/metrics", timeout=5) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = resp.read().decode()
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"ftlaunch_group_committed_steps", "ftlaunch_quorum_changes", "ftlaunch_step_rate"} <= names
        assert 'ftlaunch_group_committed_steps_total{replica_id="rg0"} 4.0' in text


def test_a_kill_not_yet_told_dies_with_the_process_it_was_meant_for() -> None:
    m, _ = make()
    m.heartbeat("a")
    m.kill("a", "x")
    m.connection_lost("a")  # it died anyway before its next heartbeat
    assert m.heartbeat("a") is None  # its restarted process is not killed


def test_admin_kill_kills_the_group_leaders_process() -> None:
    """What the dashboard's Kill button does to a real process: its heartbeat thread hears the
    kill and the process dies by SIGKILL; the lighthouse sees the group's connection close."""
    import subprocess
    import sys
    import time

    code = (
        "import sys, time\n"
        "from ftlaunch.lighthouse.client import LighthouseClient\n"
        "c = LighthouseClient(sys.argv[1], connect_timeout=5, token='t')\n"
        "c.start_heartbeat('rg0', 0.05)\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    with LighthouseServer("127.0.0.1:0", token="t") as server:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, server.address], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
            deadline = time.monotonic() + 20
            while server.snapshot().group("rg0") is None and time.monotonic() < deadline:
                time.sleep(0.05)
            with LighthouseClient(server.address, connect_timeout=5, token="t") as admin:
                admin.kill("rg0", "from the test")
            assert proc.wait(timeout=20) == -9
            while server.snapshot().group("rg0").health.value == "live" and time.monotonic() < deadline:  # type: ignore[union-attr]
                time.sleep(0.05)
            assert server.snapshot().group("rg0").health.value == "disconnected"  # type: ignore[union-attr]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_each_groups_step_over_time_is_kept_and_served() -> None:
    """The dashboard's picture: (wall time, step) per group, flat through a death, in ``/status``."""
    m, clock = make()
    for step in range(1, 5):
        clock.now += 0.5
        m.heartbeat("a", rep("s1", step))
    clock.now += 10  # a dies; its restart heals to step 30
    m.heartbeat("a", rep("s2", 30, commits=1, heals=1))
    # A point a second at most (the latest report shown too), flat through the silence, then the jump.
    assert progress(m, "a").timeline == (
        (1000.5, 1),
        (1001.0, 2),
        (1001.5, 3),
        (1002.0, 4),
        (1012.0, 4),
        (1012.0, 30),
    )
    clock.now += 0.1
    m.heartbeat("a", rep("s2", 31, commits=2, heals=1))
    clock.now += 0.1
    m.heartbeat("a", rep("s2", 32, commits=3, heals=1))  # within the second: waits as the latest
    assert progress(m, "a").timeline[-2:] == ((1012.0, 30), (1012.2, 32))
    status = m.snapshot()
    assert LighthouseStatus.from_json(status.to_json()) == status
    assert status.to_json()["progress"][0]["timeline"][-1] == [1012.2, 32]
    with pytest.raises(ValueError, match="timeline"):
        LighthouseStatus.from_json(
            {**status.to_json(), "progress": [{"replica_id": "a", "timeline": [[1, 2, 3]]}]}
        )


def test_a_job_of_many_groups_keeps_fewer_points_per_group() -> None:
    from ftlaunch.lighthouse.progress import TIMELINE_POINTS, ProgressBook, timeline_points

    assert [timeline_points(n) for n in (1, 128, 129, 256, 257, 512, 513, 4096)] == [
        64,
        64,
        32,
        32,
        16,
        16,
        8,
        8,
    ]
    book = ProgressBook()
    for step in range(1, 200):
        for g in range(300):  # 300 groups: 16 points each (+ the latest report)
            book.report(f"g{g}", rep(f"s{g}", step * (1 + step % 3)), wall=float(step))
    assert max(len(p.timeline) for p in book.snapshot(300.0)) <= 17
    small = ProgressBook()
    for step in range(1, 200):
        small.report("a", rep("s", step * (1 + step % 3)), wall=float(step))
    assert TIMELINE_POINTS // 2 <= len(small.snapshot(300.0)[0].timeline) <= TIMELINE_POINTS + 1
