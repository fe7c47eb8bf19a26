"""DiLoCo, Streaming DiLoCo and LocalSGD with real processes: scripts/train_diloco.py per replica
group against an in-process lighthouse, Baby Gloo across groups, SIGKILLs.

Equivalences (parameters dumped after every sync): LocalSGD with ``sync_every=1`` equals DDP step for
step; DiLoCo with an outer SGD(lr=1) equals LocalSGD; one group of DiLoCo equals a plain
single-process DiLoCo (tests/workers/diloco_variants.py). Faults: a group killed in the middle of
its inner loop is left out of the next sync and, restarted, heals the global parameters, the outer
optimizer state and the schedule, then holds the same bytes as the others from its first sync on; a
group killed during a sync fails that sync everywhere, which is retried; two sets of groups that
started apart are reconciled.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from workers.helpers import Result, finish, kill_tree, start, wait_for

from ftlaunch import env
from ftlaunch.lighthouse.server import LighthouseServer

TRAIN = [sys.executable, "scripts/train_diloco.py"]
VARIANTS = [sys.executable, "tests/workers/diloco_variants.py"]
SYNC_LINE = re.compile(
    r"step=(\d+) committed=(True|False) participants=(\d+) loss=\S+"
    r"(?: syncs=(\d+) global=(\w+) outer=(\w+))?"
)


def _env(lh: LighthouseServer, group: int, groups: int) -> dict[str, str]:
    e = {
        k: v
        for k, v in os.environ.items()
        if k not in (env.RANK, env.WORLD_SIZE, env.MASTER_ADDR, env.MASTER_PORT)
    }
    e.update({env.REPLICA_GROUP_ID: str(group), env.NUM_REPLICA_GROUPS: str(groups),
              env.FTLAUNCH_LIGHTHOUSE: lh.address})  # fmt: skip
    return e


def _lighthouse(min_replicas: int = 1) -> LighthouseServer:
    """A lighthouse that waits up to 10 s for a straggler: on a loaded machine groups drift apart by
    more than a second, and a quorum that leaves one out near the end would leave it to do its last
    sync alone. (A dead group leaves the live set at once, so a kill costs no wait.)"""
    return LighthouseServer("127.0.0.1:0", min_replicas=min_replicas, join_timeout=10.0,
                            heartbeat_timeout=5.0,
                            quorum_tick=0.05)  # fmt: skip


def _step(lh: LighthouseServer, replica_id: str) -> int:
    return next((g["step"] for g in lh.status()["groups"] if g["replica_id"] == replica_id), -1)


def run_groups(args: list[str], groups: int, timeout: float = 150) -> list[Result]:
    """Run ``groups`` groups to the end; every quorum has all of them (equivalences need that)."""
    with _lighthouse(min_replicas=groups).start() as lh:
        procs = [start([*TRAIN, *args], env=_env(lh, g, groups)) for g in range(groups)]
        try:
            return [finish(p, timeout) for p in procs]
        finally:
            for p in procs:
                kill_tree(p.pid)


def final_checksum(res: Result) -> str:
    m = re.search(r"final_checksum=(\w+)", res.stdout)
    assert m, res.stdout[-2000:] + res.stderr[-3000:]
    return m.group(1)


def syncs_of(res: Result) -> dict[int, tuple[str, str, int]]:
    """DiLoCo's committed syncs: sync count -> (global checksum, outer checksum, participants)."""
    found = {}
    for m in SYNC_LINE.finditer(res.stdout):
        if m.group(2) == "True" and m.group(4) is not None:
            found[int(m.group(4))] = (m.group(5), m.group(6), int(m.group(3)))
    return found


def assert_same_bytes_at_every_common_sync(*runs: Result, at_least: int = 5) -> None:
    per = [syncs_of(r) for r in runs]
    common = set.intersection(*(set(p) for p in per))
    assert len(common) >= at_least, [sorted(p) for p in per]
    for k in sorted(common):
        assert len({p[k][:2] for p in per}) == 1, (k, [p[k] for p in per])


def dumps(directory: Path, name: str) -> torch.Tensor:
    return torch.tensor(torch.load(directory / name))


def ok(res: Result) -> None:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]


# ------------------------------------------------------------------------------ equivalences

EQUIV = ["--same-init", "--inner", "sgd", "--lr", "0.05", "--width", "32", "--dataset-size", "2048"]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_local_sgd_every_step_equals_ddp_step_for_step(tmp_path: Path) -> None:
    runs = {}
    for algo, extra in (("ddp", []), ("local_sgd", ["--sync-every", "1"])):
        res = run_groups(
            ["--algorithm", algo, *extra, *EQUIV, "--steps", "30", "--dump", str(tmp_path / algo)], 2
        )
        for r in res:
            ok(r)
        runs[algo] = res
    ddp, lsgd = dumps(tmp_path / "ddp", "rg0_r0.pt"), dumps(tmp_path / "local_sgd", "rg0_r0.pt")
    assert ddp.shape == lsgd.shape == (30, ddp.shape[1])
    # Averaging the parameters after an SGD-with-momentum step = stepping with the averaged
    # gradient (both are linear): equal up to float rounding, at every step.
    torch.testing.assert_close(lsgd, ddp, rtol=0, atol=2e-5)
    assert torch.equal(dumps(tmp_path / "ddp", "rg1_r0.pt"), ddp)  # DDP: the groups bit-identical


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_diloco_with_outer_sgd_lr_1_equals_local_sgd_over_two_groups(tmp_path: Path) -> None:
    common = [*EQUIV, "--steps", "60", "--sync-every", "10"]
    for algo, extra in (("diloco", ["--outer-lr", "1", "--outer-momentum", "0"]), ("local_sgd", [])):
        for r in run_groups(["--algorithm", algo, *extra, *common, "--dump", str(tmp_path / algo)], 2):
            ok(r)
    d, ls = dumps(tmp_path / "diloco", "rg0_r0.pt"), dumps(tmp_path / "local_sgd", "rg0_r0.pt")
    assert d.shape == ls.shape and d.shape[0] == 6
    torch.testing.assert_close(
        d, ls, rtol=0, atol=1e-5
    )  # global - 1 x mean(global - local_i) = mean(local_i)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_one_group_of_diloco_equals_a_plain_single_process_diloco(tmp_path: Path) -> None:
    args = ["--same-init", "--width", "32", "--dataset-size", "1024", "--steps", "60", "--sync-every", "10",
            "--dump", str(tmp_path)]  # fmt: skip
    (res,) = run_groups(args, 1)
    ok(res)
    ref = subprocess.run([*VARIANTS, "reference", *args], capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ours, theirs = dumps(tmp_path, "rg0_r0.pt"), dumps(tmp_path, "reference.pt")
    assert ours.shape == theirs.shape and ours.shape[0] == 6
    assert torch.equal(ours, theirs)  # same operations in the same order: the same bytes
    assert final_checksum(res) == re.search(r"final_checksum=(\w+)", ref.stdout).group(1)  # type: ignore[union-attr]


# ------------------------------------------------------------------------------ failures


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_group_killed_mid_inner_loop_is_left_out_and_its_restart_heals_bit_identical() -> None:
    args = [*TRAIN, "--steps", "300", "--sync-every", "10", "--step-sleep", "0.03", "--width", "64"]
    with _lighthouse().start() as lh:
        g0 = start(args, env=_env(lh, 0, 2))
        g1 = start(args, env=_env(lh, 1, 2))
        procs = [g0, g1]
        try:
            wait_for(
                lambda: _step(lh, "rg0") >= 4 and _step(lh, "rg1") >= 4, 120, "both groups synced 3 times"
            )
            time.sleep(0.15)  # a sync point was just passed: now in the middle of the inner loop
            g1.send_signal(signal.SIGKILL)
            killed = finish(g1, 30)
            at_kill = _step(lh, "rg0")
            wait_for(lambda: _step(lh, "rg0") >= at_kill + 2, 60, "rg0 syncing alone")
            g1b = start(args, env=_env(lh, 1, 2))
            procs.append(g1b)
            r0, r1 = finish(g0, 180), finish(g1b, 180)
        finally:
            for p in procs:
                kill_tree(p.pid)
    ok(r0)
    ok(r1)
    assert final_checksum(r0) == final_checksum(r1)
    alone = [s for s, (_, _, n) in syncs_of(r0).items() if n == 1]
    assert alone, "rg0 never synced alone after the kill"
    assert "healing from rg0" in r1.stderr and "healed: loaded state" in r1.stderr
    # The restarted group holds the same global parameters and outer optimizer state as rg0 from
    # its first committed sync on (that first one included).
    first = min(syncs_of(r1))
    assert first > max(syncs_of(killed)), "the restarted group did not resume the job's schedule"
    assert_same_bytes_at_every_common_sync(r0, r1)
    assert first in syncs_of(r0)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_streaming_quantized_a_group_killed_during_a_sync_fails_it_everywhere_then_heals(
    tmp_path: Path,
) -> None:
    """Three groups, two fragments with one overlap step and 4-bit pseudo-gradients; rg2 dies inside
    its 4th sync point with its all-reduce in flight. The survivors retry that sync with 2 groups and
    go on; after their 6th sync they wait until the restarted rg2 asks to join: a new Python process
    takes longer to start on a loaded host (10-20 s to import torch) than their whole remaining run."""
    common = [
        "--steps",
        "240",
        "--sync-every",
        "20",
        "--fragments",
        "2",
        "--fragment-sync-delay",
        "3",
        "--quantize",
        "4",
        "--fragment-update-alpha",
        "0.5",
        "--step-sleep",
        "0.02",
        "--width",
        "64",
    ]
    gate = tmp_path / "gate"
    with _lighthouse().start() as lh:
        procs = [
            start([*VARIANTS, "pause-at-sync", "6", str(gate), *common], env=_env(lh, g, 3)) for g in range(2)
        ]
        victim = start([*VARIANTS, "die-in-sync", "4", *common], env=_env(lh, 2, 3))
        procs.append(victim)
        try:
            died = finish(victim, 150)
            assert died.returncode == -signal.SIGKILL and "die-in-sync: SIGKILL" in died.stdout, died.stderr[
                -3000:
            ]
            again = start([*TRAIN, *common], env=_env(lh, 2, 3))
            procs.append(again)
            wait_for(lambda: "rg2" in lh.status()["pending"], 150, "the restarted rg2 asking to join")
            gate.touch()
            r0, r1, r2 = finish(procs[0], 200), finish(procs[1], 200), finish(again, 200)
        finally:
            for p in procs:
                kill_tree(p.pid)
    for r in (r0, r1, r2):
        ok(r)
    assert final_checksum(r0) == final_checksum(r1) == final_checksum(r2)
    # The sync the victim died in did not commit in the survivors; they went on with 2 groups.
    assert "committed=False" in r0.stdout and "committed=False" in r1.stdout
    assert any(n == 2 for _, _, n in syncs_of(r0).values())
    assert "healing from" in r2.stderr
    # rg2 joined at the survivors' 7th sync point: it holds their bytes at every sync from there on.
    assert_same_bytes_at_every_common_sync(r0, r1, r2, at_least=15)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_two_sets_of_groups_that_started_apart_are_reconciled(tmp_path: Path) -> None:
    """rg0 joins alone; rg1 and rg2 then form their own first quorum. Both sets meet at their first
    sync at the same step with different global parameters: the agreement sees two lineages,
    nobody commits, and the older lineage heals from the newer one at the next sync."""
    common = ["--steps", "100", "--sync-every", "10", "--width", "32", "--step-sleep", "0.02"]
    gate0, gate12 = tmp_path / "gate0", tmp_path / "gate12"
    with _lighthouse().start() as lh:
        procs = [start([*VARIANTS, "gate-after-join", str(gate0), *common], env=_env(lh, 0, 3))]
        try:
            wait_for(lambda: Path(f"{gate0}.joined").exists(), 120, "rg0 joined alone")
            procs += [
                start([*VARIANTS, "gate-after-join", str(gate12), *common], env=_env(lh, g, 3))
                for g in (1, 2)
            ]
            wait_for(lambda: Path(f"{gate12}.joined").exists(), 120, "rg1 and rg2 joined without rg0")
            gate0.touch()  # rg0 trains to its first sync point and waits there
            wait_for(lambda: _step(lh, "rg0") >= 1, 60, "rg0 asking at its first sync point")
            gate12.touch()  # rg1 and rg2 reach theirs: the three meet at step 1
            results = [finish(p, 200) for p in procs]
        finally:
            for p in procs:
                kill_tree(p.pid)
    for r in results:
        ok(r)
    assert len({final_checksum(r) for r in results}) == 1
    text = "".join(r.stderr for r in results)
    assert "different global parameters" in text and "heals at the next sync" in text
    assert_same_bytes_at_every_common_sync(*results)


@pytest.mark.timeout(240)
@pytest.mark.slow
@pytest.mark.parametrize("sync_every, steps", [(1, 12), (2, 26)], ids=["at-the-last-sync", "one-sync-after"])
def test_a_local_sgd_group_joining_inside_its_first_step_keeps_its_peers_steps_and_data(
    tmp_path: Path, sync_every: int, steps: int
) -> None:
    """rg0 runs LocalSGD alone and waits before its 12th sync until rg1, a late group that joins
    inside its first training step (its first forward), asks to join: that sync is rg1's join.
    rg1's step counts as rg0's sync step, so it ends where rg0 does, after the same quorum, and its
    exactly-once sampler is at rg0's position (the batch it drew before its heal does not size the
    join's slices). Starting over at inner step 0, with a sync every step its first step took a
    second quorum of its own (one no one else asks for: alone once rg0 has left, or a hang if it
    needed rg0); with two its next sync came one batch early."""
    common = ["--algorithm", "local_sgd", "--sync-every", str(sync_every), "--steps", str(steps),
              "--step-sleep", "0.02", "--width", "32"]  # fmt: skip
    gate = tmp_path / "gate"
    with _lighthouse().start() as lh:
        procs = [start([*VARIANTS, "pause-at-sync", "11", str(gate), *common], env=_env(lh, 0, 2))]
        try:
            wait_for(lambda: Path(f"{gate}.reached").exists(), 120, "rg0 before its 12th sync")
            procs.append(start([*VARIANTS, "join-in-step", *common], env=_env(lh, 1, 2)))
            wait_for(lambda: "rg1" in lh.status()["pending"], 150, "rg1 asking to join")
            gate.touch()
            r0, r1 = finish(procs[0], 120), finish(procs[1], 120)
        finally:
            for p in procs:
                kill_tree(p.pid)
    ok(r0)
    ok(r1)
    assert "healing from rg0" in r1.stderr
    ends = [re.search(r"final_checksum=\w+ step=(\d+)", r.stdout) for r in (r0, r1)]
    assert all(ends), r1.stdout[-2000:]
    assert [int(m.group(1)) for m in ends if m] == [steps, steps], r1.stderr[-4000:]
    # The data position after the last sync (samples the job trained) is the same in both.
    assert len({re.findall(r" data=(\d+:\d+)", r.stdout)[-1] for r in (r0, r1)}) == 1, r1.stdout[-2000:]
    if steps > 12 * sync_every:  # a sync after the join: the same average
        assert final_checksum(r0) == final_checksum(r1)
