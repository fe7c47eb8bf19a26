"""scripts/train_ddp.py run by hand against a lighthouse (no launcher): the two-line form and the
torchft-style ``--long-form`` both train two groups to bit-identical weights, and a group killed
mid-run and started again by hand heals (weights and data position) and ends identical."""

from __future__ import annotations

import os
import re
import signal
import sys

import pytest
from test_launcher_e2e import assert_data_positions_agree, data_positions
from workers.helpers import finish, kill_tree, start, wait_for

from ftlaunch import env
from ftlaunch.lighthouse.server import LighthouseServer

pytestmark = pytest.mark.timeout(200)

TRAIN = [sys.executable, "scripts/train_ddp.py"]


def _env(lh: LighthouseServer, group: int) -> dict[str, str]:
    e = {
        k: v
        for k, v in os.environ.items()
        if k not in (env.RANK, env.WORLD_SIZE, env.MASTER_ADDR, env.MASTER_PORT)
    }
    e.update(
        {env.REPLICA_GROUP_ID: str(group), env.NUM_REPLICA_GROUPS: "2", env.FTLAUNCH_LIGHTHOUSE: lh.address}
    )
    return e


def _step(lh: LighthouseServer, replica_id: str) -> int:
    """The committed step a group last reported to the lighthouse (with its quorum request)."""
    return next((g["step"] for g in lh.status()["groups"] if g["replica_id"] == replica_id), -1)


def _checksum(text: str) -> str:
    m = re.search(r"final_checksum=(\w+)", text)
    assert m, text[-3000:]
    return m.group(1)


@pytest.mark.parametrize(
    "form",
    [
        pytest.param([], id="two-line"),
        pytest.param(
            ["--long-form", "--backend", "gloo", "--transport", "http"],
            id="long-form",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_by_hand_two_groups_one_killed_and_restarted(form: list[str]) -> None:
    # 300 steps: at the load of a shared 2-core machine the restarted group needs several seconds to
    # import torch and start its Baby child (over 10 s at load 12); group 0 must still be training when
    # it comes back.
    args = [*TRAIN, *form, "--steps", "300", "--step-sleep", "0.05", "--timeout", "20"]
    with LighthouseServer(
        "127.0.0.1:0", min_replicas=1, join_timeout=1.0, heartbeat_timeout=5.0, quorum_tick=0.05
    ).start() as lh:
        g0 = start(args, env=_env(lh, 0))
        g1 = start(args, env=_env(lh, 1))
        procs = [g0, g1]
        try:
            # Kill group 1 once it has committed some steps together with group 0, then restart it.
            wait_for(lambda: _step(lh, "rg1") >= 5 and _step(lh, "rg0") >= 5, 90, "both groups at step 5")
            g1.send_signal(signal.SIGKILL)
            first = finish(g1, 30)
            g1b = start(args, env=_env(lh, 1))
            procs.append(g1b)
            r0, r1 = finish(g0, 150), finish(g1b, 150)
        finally:
            for p in procs:
                kill_tree(p.pid)
    assert r0.returncode == 0 and r1.returncode == 0, r0.stderr[-3000:] + r1.stderr[-3000:]
    assert _checksum(r0.stdout) == _checksum(r1.stdout), r0.stderr[-3000:] + "\n-----\n" + r1.stderr[-3000:]
    assert "healing from rg0" in r1.stderr and "healed: loaded state" in r1.stderr
    killed_steps = data_positions(first.stdout, 1).get(1, {})
    assert killed_steps, "group 1 was killed before committing anything"
    assert_data_positions_agree({**data_positions(r0.stdout, 0), **data_positions(r1.stdout, 1)})
