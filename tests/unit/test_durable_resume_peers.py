"""Which peers a (re)started group weighs before it reads a durable checkpoint: the live ones other
than its own id (whose entry is the dead process it replaces), at the step of their last request."""

from __future__ import annotations

from ftlaunch.lighthouse.quorum import Health
from ftlaunch.lighthouse.status import GroupStatus, LighthouseStatus
from ftlaunch.worker.durable import live_peer_steps


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
