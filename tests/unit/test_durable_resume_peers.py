"""Which peers a (re)started group weighs before it reads a durable checkpoint: the live ones other
than its own id (whose entry is the dead process it replaces), at the step of their last request."""

from __future__ import annotations

from ftlaunch.lighthouse.quorum import Health, Quorum, QuorumMember
from ftlaunch.lighthouse.status import GroupStatus, LighthouseStatus
from ftlaunch.worker.durable import live_peer_steps, reached_step


def test_only_other_live_groups_count() -> None:
    status = LighthouseStatus(
        groups=(
            GroupStatus("rg0", Health.LIVE, step=57),  # this group's own (dead) predecessor
            GroupStatus("rg1", Health.LIVE, step=40),
            GroupStatus("rg2", Health.DISCONNECTED, step=60),  # killed with the others
        )
    )
    assert live_peer_steps(status, "rg0") == [40]
    assert live_peer_steps(LighthouseStatus(), "rg0") == []


def test_the_step_the_job_reached_is_its_last_quorums() -> None:
    quorum = Quorum(5, (QuorumMember("rg0", step=13), QuorumMember("rg1", step=0)), created=0.0)
    assert reached_step(LighthouseStatus(quorum=quorum)) == 13
    assert reached_step(LighthouseStatus()) is None
