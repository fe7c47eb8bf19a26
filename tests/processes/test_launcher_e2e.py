"""End to end: the real fault-tolerant training (scripts/train_ddp.py) under ``ftlaunch`` with
``--chaos``, under one ``torchrun --rdzv-backend ftlaunch`` per group, and under torchx local_cwd.

Every run must finish with all groups bit-identical (same ``final_checksum``) although groups were
killed. The training is slowed down (``--step-sleep``) so that a killed group is back (process
start, rendezvous, healing: a few seconds on a loaded 2-core machine) well before the others finish.
"""

from __future__ import annotations

import re
import signal
import sys

import pytest
from workers.helpers import FTLAUNCH, REPO, alive, finish, free_port, kill_tree, records, run, start, wait_for

TRAIN = "scripts/train_ddp.py"


def checksums(text: str) -> dict[int, str]:
    """Group -> final checksum, from ``[rgG/r0] ... final_checksum=X`` lines (or torchx's ``rgG/0``)."""
    found = {}
    for m in re.finditer(r"rg(\d+)[/\]][^\n]*?final_checksum=(\w+)", text):
        found[int(m.group(1))] = m.group(2)
    return found


def data_positions(text: str, group: int | None = None) -> dict[int, dict[int, str]]:
    """Group -> {committed step -> sampler position ``epoch:position``} from train_ddp's step lines."""
    found: dict[int, dict[int, str]] = {}
    pat = r"(?:rg(\d+)[/\]][^\n]*?)?step=(\d+) committed=True participants=\d+ [^\n]*?data=(\d+:\d+)"
    for m in re.finditer(pat, text):
        g = int(m.group(1)) if m.group(1) is not None else group
        assert g is not None, "a step line without a group prefix"
        found.setdefault(g, {})[int(m.group(2))] = m.group(3)
    return found


def assert_data_positions_agree(per_group: dict[int, dict[int, str]]) -> None:
    """Every group is at the same data position after every step they all committed — also the
    groups that were killed, restarted and healed: their sampler position travels with the heal
    (without it they would restart at position 0 and repeat their peers' finished batches). Within
    a group the position only moves forward (a step that was not committed used up its batch)."""
    common = set.intersection(*(set(v) for v in per_group.values()))
    assert len(common) >= 20, f"too few common committed steps: {sorted(common)}"
    for step in sorted(common):
        assert len({v[step] for v in per_group.values()}) == 1, (
            step,
            {g: v[step] for g, v in per_group.items()},
        )
    for v in per_group.values():
        pos = [tuple(map(int, v[s].split(":"))) for s in sorted(v)]
        assert all(a < b for a, b in zip(pos, pos[1:], strict=False)), pos


def summary_row(stdout: str, group: int) -> list[str]:
    for line in stdout.splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[0] == "[ftlaunch]" and fields[1] == f"rg{group}":
            return fields[2:]
    raise AssertionError(f"no summary row for rg{group} in:\n{stdout}")


def failure_story(res) -> str:
    """The supervisor's own lines about failures, injections and agents, and the summary."""
    told = [line for line in res.stderr.splitlines() if line.startswith("[ftlaunch] ") or "/agent]" in line]
    summary = res.stdout[res.stdout.find("[ftlaunch] summary") :]
    return "\n".join(told[-60:]) + "\n" + summary


@pytest.mark.timeout(170)
def test_ftlaunch_two_groups_with_chaos_end_identical() -> None:
    res = run(
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--max-restarts",
            "5",
            "--chaos",
            "steps=10/30,seed=1",
            TRAIN,
            "--steps",
            "200",
            "--step-sleep",
            "0.1",
        ],
        timeout=160,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    sums = checksums(res.stdout)
    assert set(sums) == {0, 1} and len(set(sums.values())) == 1, sums
    assert "2/2 groups ended bit-identical" in res.stdout
    assert "[ftlaunch] chaos: 2 injection(s)" in res.stdout and res.stdout.count("group committed again") == 2
    # failures column: one per kill (if not, the message shows what the supervisor counted and why)
    assert sum(int(summary_row(res.stdout, g)[3]) for g in (0, 1)) == 2, failure_story(res)
    assert "training finished despite 2 failure(s); " in res.stdout  # and nothing about lost progress
    assert "progress lost" not in res.stdout.lower() and "logs kept" not in res.stdout
    assert_data_positions_agree(data_positions(res.stdout))
    assert (
        "ftlaunch.init: replica group 1 of 2, rank 0 of 1, backend baby-gloo, transport pg"
        in res.stdout + res.stderr
    )


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ftlaunch_three_groups_of_two_with_chaos_end_identical() -> None:
    res = run(
        [
            *FTLAUNCH,
            "--replicas",
            "3",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "5",
            "--chaos",
            "steps=10/30/50,seed=7",
            TRAIN,
            "--steps",
            "200",
            "--step-sleep",
            "0.1",
        ],
        timeout=190,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    sums = checksums(res.stdout)
    assert set(sums) == {0, 1, 2} and len(set(sums.values())) == 1, sums
    assert "3/3 groups ended bit-identical" in res.stdout
    assert "ftlaunch.init: replica group 2 of 3, rank 1 of 2" in res.stdout + res.stderr  # intra-group PG too
    assert "[ftlaunch] chaos: 3 injection(s)" in res.stdout
    assert sum(int(summary_row(res.stdout, g)[3]) for g in (0, 1, 2)) == 3, failure_story(res)


@pytest.mark.timeout(170)
def test_torchrun_per_group_with_a_killed_group(tmp_path) -> None:
    """One ``torchrun --rdzv-backend ftlaunch`` per group, started here; group 0's node hosts the
    lighthouse (it is on the endpoint host). We SIGKILL group 1's worker: torchelastic restarts it,
    it heals from group 0, and both end identical."""
    port = free_port()
    common = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--rdzv-backend",
        "ftlaunch",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "2",
    ]
    train = [TRAIN, "--steps", "150", "--step-sleep", "0.1"]
    g0 = start(
        [*common, "--rdzv-conf", "replica_group_id=0,num_replica_groups=2,lighthouse_linger=60", *train]
    )
    wait_for(lambda: _worker_of(g0.pid) is not None, 60, "group 0's worker")
    g1 = start([*common, "--rdzv-conf", "replica_group_id=1,num_replica_groups=2", *train])
    try:
        wait_for(lambda: _worker_of(g1.pid) is not None, 60, "group 1's worker")
        victim = _worker_of(g1.pid)
        import time

        time.sleep(3.0)  # let it train a little
        victim.send_signal(signal.SIGKILL)
        r0, r1 = finish(g0, 150), finish(g1, 150)
    finally:
        for p in (g0, g1):
            kill_tree(p.pid)
    assert r0.returncode == 0 and r1.returncode == 0, r0.stderr[-3000:] + r1.stderr[-3000:]
    s0 = re.search(r"final_checksum=(\w+)", r0.stdout)
    s1 = re.search(r"final_checksum=(\w+)", r1.stdout)
    assert s0 and s1 and s0.group(1) == s1.group(1)
    assert r1.stdout.count("final_checksum=") == 1
    assert_data_positions_agree({**data_positions(r0.stdout, 0), **data_positions(r1.stdout, 1)})
    assert "ftlaunch.init: replica group 1 of 2" in r1.stderr
    assert not alive(victim.pid)


def _worker_of(agent_pid: int):
    import psutil

    try:
        for child in psutil.Process(agent_pid).children():
            if "train_ddp.py" in " ".join(child.cmdline()):
                return child
    except psutil.Error:
        return None
    return None


@pytest.mark.timeout(170)
def test_torchx_local_cwd_train_ddp_end_identical() -> None:
    res = run(
        [
            sys.executable,
            "-m",
            "torchx.cli.main",
            "run",
            "-s",
            "local_cwd",
            "ftlaunch:hsdp",
            "--replicas",
            "2",
            "--workers_per_replica",
            "2",
            "--script",
            TRAIN,
            "--",
            "--steps",
            "60",
            "--step-sleep",
            "0.05",
        ],
        timeout=160,
        cwd=REPO,
    )
    text = res.stdout + res.stderr
    assert res.returncode == 0 and "SUCCEEDED" in text, text[-4000:]
    sums = checksums(text)
    assert set(sums) == {0, 1} and len(set(sums.values())) == 1, sums
    assert "ftlaunch.init: replica group 1 of 2, rank 1 of 2" in text


@pytest.mark.timeout(120)
def test_sigterm_during_training_with_baby_gloo_leaves_nothing(tmp_path) -> None:
    """Baby process groups run the backend in a child of each worker: SIGTERM to the launcher must
    take those grandchildren down too (the autouse fixture fails the test on any survivor)."""
    proc = start(
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--grace-period",
            "10",
            "--log-dir",
            str(tmp_path),
            TRAIN,
            "--steps",
            "100000",
            "--backend",
            "baby-gloo",
            "--step-sleep",
            "0.05",
        ]
    )
    wait_for(lambda: len(_tree(proc.pid)) >= 6, 90, "agents, workers and baby children")
    pids = [p.pid for p in _tree(proc.pid)]
    proc.send_signal(signal.SIGTERM)
    res = finish(proc, 60)
    assert res.returncode == 128 + signal.SIGTERM, res.stderr[-3000:]
    assert not [pid for pid in pids if alive(pid)]
    assert records is not None  # helpers imported for the shared kill/wait utilities


def _tree(pid: int):
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
