"""Failures the supervisor could not tell a dead hosted lighthouse are told to the restarted one
(`ftlaunch.launcher.outage_reports`), once it knows the group again and while no process of the
group runs. In one process: the bookkeeping on `Group`s, and a real hosted lighthouse that crashes,
restarts, learns the group from a resume report and then takes the report."""

from __future__ import annotations

from ftlaunch.launcher.group import Group
from ftlaunch.launcher.lighthouse_host import HostedLighthouse, LighthouseSettings
from ftlaunch.launcher.outage_reports import KEEP_S, UnreportedFailures
from ftlaunch.lighthouse.protocol import RESUME_KEY
from ftlaunch.lighthouse.quorum import Health, QuorumMember


def down(gid: int, at: float = 10.0) -> Group:
    """A group whose agent died at ``at`` and is being respawned (no workers yet)."""
    g = Group(gid)
    g.agent_started()
    g.workers_started(0, {0: 100 + gid}, at - 5)
    g.agent_exited(-9, {}, max_agent_restarts=5, now=at)
    g.worker_pids = {}
    g.agent_started()
    return g


def test_a_report_waits_until_the_lighthouse_knows_the_group_and_is_sent_once() -> None:
    groups = [down(0), down(1)]
    pending = UnreportedFailures()
    pending.failed(1, "agent killed by SIGKILL", 10.0)
    assert pending.due(groups, ["rg0"], 11.0) == []  # restarted, but no resume report named rg1 yet
    assert len(pending) == 1
    assert pending.due(groups, ["rg0", "rg1"], 11.1) == [(groups[1], "agent killed by SIGKILL")]
    assert pending.due(groups, ["rg0", "rg1"], 11.2) == [] and len(pending) == 0


def test_no_report_for_a_group_that_runs_again_is_back_ended_well_or_too_old() -> None:
    running, back, stopped, old, gone = down(0), down(1), down(2), down(3), down(4)
    running.workers_started(0, {0: 200}, 12.0)  # its replacement may be talking to the new lighthouse
    back.failure_at = None  # it committed again
    stopped.stopped_by_launcher()
    gone.agent_exited(-9, {}, max_agent_restarts=0, now=10.0)  # failed for good: still reported
    groups = [running, back, stopped, old, gone]
    pending = UnreportedFailures()
    for g in groups:
        pending.failed(g.gid, "killed", 10.0)
    assert pending.due(groups, ["rg0", "rg1", "rg2", "rg4"], 11.0) == [(gone, "killed")]
    assert len(pending) == 1  # rg3 (not known yet) kept ...
    assert pending.due(groups, ["rg3"], 10.0 + KEEP_S + 1) == [] and len(pending) == 0  # ... until too old


def test_the_restarted_hosted_lighthouse_takes_the_report_once_a_resume_report_names_the_group() -> None:
    """Without it the restarted lighthouse counts the dead group live for its heartbeat timeout (it
    was a member of the reported quorum), and the survivors' quorum waits for it."""
    lh = HostedLighthouse.start(LighthouseSettings(bind="127.0.0.1:0", heartbeat_timeout=5.0))
    try:
        groups = [down(0), down(1)]
        pending = UnreportedFailures()
        lh.crash()
        assert pending.resend(lh, groups, 1.0) == []  # down: nothing to do
        pending.failed(1, "agent killed by SIGKILL", 1.0)
        lh.restart()
        assert pending.resend(lh, groups, 2.0) == []  # the restarted lighthouse knows no group yet
        report = {"quorum_id": 7, "members": ["rg0", "rg1"]}
        member = QuorumMember("rg0", data={RESUME_KEY: report})
        lh._running()._membership.request_quorum(member)  # rg0 asks, reporting quorum 7 of rg0 and rg1
        health = {g.replica_id: g.health for g in lh.snapshot().groups}
        assert health["rg1"] is Health.LIVE  # taken on the report's word: the quorum would wait for it
        due = pending.resend(lh, groups, 3.0)
        assert due == [(groups[1], "agent killed by SIGKILL")]
        lh.report_failure("rg1", due[0][1])  # what the supervisor then does
        health = {g.replica_id: g.health for g in lh.snapshot().groups}
        assert health["rg1"] is not Health.LIVE  # the next quorum goes on without it
    finally:
        lh.stop()
