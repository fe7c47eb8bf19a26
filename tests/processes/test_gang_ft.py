"""``ft.gangs()`` end to end: a fairseq2-style training loop (tests/workers/gang_worker.py) under the
real ``ftlaunch`` launcher, a replica group SIGKILLed by ``--chaos`` and restarted by its agent.

The job must end with every group bit-identical, the killed group healed, the replica gang's size
having followed the quorum (2 -> 1 -> 2), the fault-tolerant gangs doing at step 0 what `FakeGang`
simulates, and ``gangs.close()`` leaving no child process, thread or socket in any worker.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gang_scenarios as sc
import pytest
from workers.helpers import FTLAUNCH, run

WORKER = "tests/workers/gang_worker.py"


def incarnations(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def check_job(out: Path, stdout: str, groups: int, nproc: int) -> list[dict[str, Any]]:
    """What every run must show: identical ends, a kill healed, the tables, a clean teardown."""
    assert f"{groups}/{groups} groups ended bit-identical" in stdout, stdout[-3000:]
    assert "[ftlaunch] chaos: 1 injection(s)" in stdout and "group committed again" in stdout
    records = incarnations(out)
    # every worker of every group finished (the killed group in its second incarnation)
    finished = {(r["group"], r["rank"]) for r in records if "final_step" in r}
    assert finished == {(g, k) for g in range(groups) for k in range(nproc)}, records
    assert any(r["restart"] > 0 for r in records), "no group was restarted"
    assert len({r["final_step"] for r in records if "final_step" in r}) == 1
    # the replica gang's size followed the quorum: alone while the other group was down
    sizes = [r["rdp_sizes"] for r in records if "rdp_sizes" in r]
    assert any(1 in s and 2 in s for s in sizes), sizes
    # at step 0, both groups there: rdp (Manager + Baby Gloo), dp = rdp x sdp and root = rdp x the
    # group's root did, rank by rank, what the table expects of a gang of identical peers
    first = [r for r in records if "tables" in r]
    assert {(r["group"], r["rank"]) for r in first} == {(g, k) for g in range(groups) for k in range(nproc)}
    for r in first:
        assert r["table_committed"] is True
        for name, table in r["tables"].items():
            rank, size = r["table_sizes"][name]
            assert table == sc.expected_table(rank, size), (name, r["group"], r["rank"])
    # gangs.close() left nothing: no Baby child, no socket, no thread beyond those before init
    for r in records:
        if "after" in r:
            b, a = r["before"], r["after"]
            assert a["children"] == [] and a["sockets"] == 0 and a["py_threads"] == ["MainThread"], r
            assert a["threads"] <= b["threads"], (b, a)
    return records


@pytest.mark.timeout(200)
def test_gangs_training_survives_a_killed_group_and_ends_identical(tmp_path: Path) -> None:
    res = run(
        [*FTLAUNCH, "--replicas", "2", "--max-restarts", "3", "--chaos", "steps=15,seed=1",
         WORKER, "--out", str(tmp_path), "--steps", "60", "--step-sleep", "0.1"],
        timeout=190,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    check_job(tmp_path, res.stdout, groups=2, nproc=1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gangs_with_two_workers_per_group_shard_inside_and_replicate_across(tmp_path: Path) -> None:
    """sdp is a real gloo gang of the group's two workers; dp = rdp x sdp spans 4 processes."""
    res = run(
        [*FTLAUNCH, "--replicas", "2", "--nproc-per-node", "2", "--max-restarts", "3",
         "--chaos", "steps=15,seed=3", WORKER, "--out", str(tmp_path), "--steps", "60", "--step-sleep",
         "0.1"],
        timeout=290,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    records = check_job(tmp_path, res.stdout, groups=2, nproc=2)
    sizes = {tuple(r["table_sizes"]["dp"]) for r in records if "tables" in r}
    assert sizes == {(0, 4), (1, 4), (2, 4), (3, 4)}
