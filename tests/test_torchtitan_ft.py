"""scripts/train_torchtitan_ft.py builds what torchtitan's torchft integration builds - the Manager
with ``load_state_dict=None, state_dict=None`` and the state functions set afterwards,
``ManagedProcessGroup(manager).register("dp_replicate")`` all-reduced through with
``dist.all_reduce(group=...)``, ``Optimizer`` around an optimizers container, ``ProcessGroupGloo``;
and for semi-synchronous training ``local_sgd.DiLoCo`` over per-fragment module lists with one
outer optimizer each - from ftlaunch (``import ftlaunch as torchft``), and trains under the
launcher while a group is killed."""

from __future__ import annotations

import re

import pytest
from test_launcher_e2e import checksums
from workers.helpers import FTLAUNCH, run

SCRIPT = "scripts/train_torchtitan_ft.py"


def _launch(*script_args: str, chaos: str, timeout: float) -> str:
    res = run(
        [*FTLAUNCH, "--replicas", "2", "--max-restarts", "3", "--chaos", chaos, SCRIPT, *script_args],
        timeout=timeout,
    )
    out = res.stdout
    assert res.returncode == 0, out[-4000:] + res.stderr[-4000:]
    # torchtitan names its groups itself (replica_id="torchtitan_ft_<i>"), so the launcher, which
    # knows them as rg<i>, sees no step progress: the kill is timed from launch.
    assert re.search(r"\[ftlaunch\] chaos: SIG\w+ -> replica group \d", out), out[-3000:]
    return out


@pytest.mark.timeout(200)
def test_torchtitan_ft_sync_training_survives_a_kill() -> None:
    out = _launch("--steps", "150", "--step-sleep", "0.1", chaos="every=600,start=25,seed=1", timeout=190)
    sums = checksums(out)
    assert set(sums) == {0, 1} and len(set(sums.values())) == 1, sums
    assert len(set(re.findall(r"final_checksum=\w+ step=(\d+)", out))) == 1
    # Both groups averaged through the registered ManagedProcessGroup once they met.
    assert re.search(r"\[rg\d/r0\] step=\d+ committed=True participants=2 ", out)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchtitan_ft_diloco_fragments_survive_a_kill() -> None:
    out = _launch(
        "--semi-sync", "diloco", "--steps", "30", "--step-sleep", "0.1", chaos="every=600,start=25,seed=1",
        timeout=230,
    )  # fmt: skip
    found = {g: (c, s) for g, c, s in re.findall(r"\[rg(\d)/r0\] global_checksum=(\w+) step=(\d+)", out)}
    assert set(found) == {"0", "1"} and len(set(found.values())) == 1, found
