"""scripts/train_torchtitan_ft.py builds what torchtitan's torchft integration builds - the Manager
with ``load_state_dict=None, state_dict=None`` and the state functions set afterwards,
``ManagedProcessGroup(manager).register("dp_replicate")`` all-reduced through with
``dist.all_reduce(group=...)``, ``Optimizer`` around an optimizers container, ``ProcessGroupGloo``;
and for semi-synchronous training ``local_sgd.DiLoCo`` over per-fragment module lists with one
outer optimizer each - from ftlaunch (``import ftlaunch as torchft``), and trains under the
launcher while a group is killed."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from test_launcher_e2e import checksums
from workers.helpers import FTLAUNCH, finish, kill_tree, start, wait_for

SCRIPT = "scripts/train_torchtitan_ft.py"


def _launch(tmp_path: Path, *script_args: str, kill_at: int, timeout: float) -> str:
    """Run the script under ``ftlaunch --replicas 2``; SIGKILL group 1's worker once it reports step
    ``kill_at``. (torchtitan names its groups itself, ``replica_id="torchtitan_ft_<i>"``, so the
    launcher, which knows them as rg<i>, cannot time its own ``--chaos`` by their steps.)"""
    proc = start([*FTLAUNCH, "--replicas", "2", "--max-restarts", "3", SCRIPT, *script_args,
                  "--progress-dir", str(tmp_path)])  # fmt: skip
    progress = tmp_path / "rg1"
    try:
        killed: list[int] = []

        def reached() -> bool:
            try:
                pid, step = (int(v) for v in progress.read_text().split())
            except (OSError, ValueError):
                return False
            if step >= kill_at:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return True
            return proc.poll() is not None

        wait_for(reached, timeout / 2, f"group 1 at step {kill_at}", interval=0.05)
        res = finish(proc, timeout / 2)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    out = res.stdout
    assert res.returncode == 0, out[-4000:] + res.stderr[-4000:]
    assert killed, "group 1 never reached the step to kill it at"
    restarted = int(progress.read_text().split()[0])
    assert restarted != killed[0], "group 1's worker was not restarted:\n" + out[-3000:]
    return out


@pytest.mark.timeout(200)
def test_torchtitan_ft_sync_training_survives_a_kill(tmp_path: Path) -> None:
    out = _launch(tmp_path, "--steps", "150", "--step-sleep", "0.1", kill_at=10, timeout=190)
    sums = checksums(out)
    assert set(sums) == {0, 1} and len(set(sums.values())) == 1, sums
    assert set(re.findall(r"final_checksum=\w+ step=(\d+)", out)) == {"150"}
    # Both groups averaged through the registered ManagedProcessGroup once they met.
    assert re.search(r"\[rg\d/r0\] step=\d+ committed=True participants=2 ", out)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchtitan_ft_diloco_fragments_survive_a_kill(tmp_path: Path) -> None:
    out = _launch(
        tmp_path, "--semi-sync", "diloco", "--steps", "60", "--step-sleep", "0.1", kill_at=4, timeout=230
    )
    found = {g: (c, s) for g, c, s in re.findall(r"\[rg(\d)/r0\] global_checksum=(\w+) step=(\d+)", out)}
    assert set(found) == {"0", "1"} and len(set(found.values())) == 1, found
