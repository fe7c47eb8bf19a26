"""The end-of-run race (docs/launcher.md, *End of a run*), in one process: a group restarting just as
the others finish must not get a quorum of itself alone behind the finished step. The lighthouse
answers `TrainingFinished` (HTTP 412), the client raises `TrainingFinishedError`, and the supervisor
counts the group as stopped after the end, not as a result or a failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftlaunch.errors import TrainingFinishedError
from ftlaunch.launcher.group import STOPPED, SUCCEEDED, Group
from ftlaunch.lighthouse.channel import raise_for
from ftlaunch.lighthouse.membership import Membership, QuorumTicket, TrainingFinished
from ftlaunch.lighthouse.progress import GroupProgress, ProgressReport
from ftlaunch.lighthouse.quorum import QuorumIdAllocator, QuorumMember, QuorumOptions
from ftlaunch.lighthouse.routes import ERROR_STATUS


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make() -> Membership:
    clock = Clock()
    options = QuorumOptions(min_replicas=1, join_timeout=60.0, heartbeat_timeout=5.0)
    return Membership(options, ids=QuorumIdAllocator(1_700_000_000_000), clock=clock, wall_clock=clock)


def finish(m: Membership, rid: str, step: int) -> None:
    """``rid`` trained to ``step`` with the others and its leader left with "finished"."""
    m.leave(rid, ProgressReport(session=f"s-{rid}", step=step, commits=step, finished=True))


def ask(m: Membership, rid: str, step: int) -> QuorumTicket:
    """A (restarted) process's first request: no progress yet (a leader reports once it commits)."""
    return m.request_quorum(QuorumMember(rid, step=step))


def trained_together(m: Membership, step: int, *rids: str) -> None:
    for rid in rids:
        m.heartbeat(rid)
    tickets = [m.request_quorum(QuorumMember(rid, step=step)) for rid in rids]
    assert all(t.quorum is not None and t.quorum.replica_ids == rids for t in tickets)


def progress_of(m: Membership, rid: str) -> GroupProgress:
    return next(p for p in m.progress() if p.replica_id == rid)


def test_a_late_request_behind_a_finished_peer_is_refused_with_nobody_to_heal_from() -> None:
    m = make()
    trained_together(m, 11, "a", "b")
    finish(m, "a", 12)
    late = ask(m, "b", 5)  # b restarted from step 5 (say) just as a finished at 12
    assert late.done and late.quorum is None and isinstance(late.error, TrainingFinished)
    assert late.error.finished_step == 12
    assert "the training finished at step 12; nothing left to heal from" in str(late.error)
    status = m.snapshot()
    assert status.pending == () and status.quorum is not None and status.quorum.replica_ids == ("a", "b")
    assert [h.event for h in status.history][0] == "refused_finished"
    m.leave("b", ProgressReport(session="s2-b", step=5))  # the refused process's final report
    assert progress_of(m, "b").stopped_after_end and not progress_of(m, "a").stopped_after_end
    assert GroupProgress.from_json(progress_of(m, "b").to_json()).stopped_after_end  # travels in /status
    m.heartbeat("b", ProgressReport(session="s3-b", step=0))  # a later process of b is judged afresh
    assert not progress_of(m, "b").stopped_after_end


def test_a_request_at_or_past_the_finished_step_still_forms() -> None:
    m = make()
    trained_together(m, 11, "a", "b")
    finish(m, "a", 12)
    t = ask(m, "b", 12)
    assert t.quorum is not None and t.quorum.replica_ids == ("b",)
    assert all(not p.stopped_after_end for p in m.progress()) and "refused_finished" not in {
        h.event for h in m.snapshot().history
    }


def test_a_late_group_with_a_healer_in_its_quorum_still_forms() -> None:
    m = make()
    trained_together(m, 11, "a", "b", "c")
    finish(m, "a", 12)
    m.heartbeat("b")
    behind = ask(m, "c", 3)  # c restarted; b is still at the finished step and heals it
    assert not behind.done
    healer = ask(m, "b", 12)
    assert (
        behind.quorum is not None
        and behind.quorum.replica_ids == ("b", "c")
        and healer.quorum is behind.quorum
    )


def test_normal_quorums_without_a_finished_group_are_unaffected() -> None:
    m = make()
    trained_together(m, 11, "a", "b")
    m.leave("a", ProgressReport(session="s-a", step=12, commits=12))  # left, not finished
    t = ask(m, "b", 5)
    assert t.quorum is not None and t.quorum.replica_ids == ("b",)


def test_the_refusal_reads_412_and_the_client_raises_training_finished() -> None:
    assert ERROR_STATUS[TrainingFinished] == 412
    with pytest.raises(TrainingFinishedError, match="nothing left to heal from"):
        raise_for(
            412, {"error": "the training finished at step 12; nothing left to heal from"}, "quorum request"
        )


def test_a_group_the_lighthouse_ended_after_the_finish_is_stopped_not_succeeded() -> None:
    def exited(stopped_after_end: bool) -> Group:
        g = Group(1)
        g.agent_started()
        g.workers_started(0, {0: 100}, now=0.0)
        g.lighthouse_progress(
            GroupProgress("rg1", session="s", stopped_after_end=stopped_after_end), 1.0, 0.0
        )
        g.worker_exited(100, 0, 0, False, "exited with code 0", now=2.0)
        outcome = g.agent_exited(0, {"status": "succeeded"}, max_agent_restarts=3, now=2.0)
        assert not outcome.respawn and outcome.report is None
        return g

    straggler = exited(True)
    assert straggler.state == STOPPED and straggler.failures == 0 and straggler.checksum is None
    assert exited(False).state == SUCCEEDED


@pytest.mark.timeout(120)
def test_a_group_starting_after_the_training_finished_ends_cleanly(tmp_path: Path) -> None:
    """Real processes: group 0 trains to the end and leaves "finished"; group 1 (two workers) comes
    up afterwards at step 0. Its leader's first quorum request is refused (412), every rank ends
    with exit status 0 without committing a step, and the lighthouse shows it stopped after the end."""
    from ftlaunch.lighthouse.server import LighthouseServer
    from tests.mp_harness import Group as Workers

    with LighthouseServer(
        "127.0.0.1:0", min_replicas=1, join_timeout=5.0, heartbeat_timeout=5.0, quorum_tick=0.05
    ).start() as lh:
        first = Workers(0, 1, lh.address, tmp_path, ["--steps", "3"])
        late = Workers(1, 2, lh.address, tmp_path, ["--steps", "3"])
        try:
            first.start()
            assert first.wait(60) == [0], first.log_tail()
            late.start()
            assert late.wait(60) == [0, 0], late.log_tail()
        finally:
            first.close()
            late.close()
        progress = {p.replica_id: p for p in lh.progress()}
    assert first.final() is not None and first.final()["step"] == 3  # type: ignore[index]
    assert all(late.final(r) is None and late.steps(r) == [] for r in range(2)), late.records()
    assert "nothing left to heal from" in late.log_tail(20000)
    done, straggler = progress["rg0"], progress["rg1"]
    assert done.finished and not done.stopped_after_end
    assert straggler.stopped_after_end and straggler.committed == 0 and not straggler.finished
    assert straggler.unsynced_sessions == 0
