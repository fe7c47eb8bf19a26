"""Faults in the middle of things, with real processes.

A group killed while it heals (as the receiver, and its source), both non-leader groups killed at
once, a Baby child killed under a training Manager, one rank of a two-rank group SIGSTOPped, and the
``ftlaunch`` supervisor SIGKILLed (nothing of the job may outlive it). Each run must end with every
group bit-identical and the survivors committing throughout. The hung-training-thread case is in
tests/processes/test_progress_watchdog.py, the lighthouse's death in
tests/processes/test_lighthouse_restart_e2e.py; corrupted and truncated heal payloads are rejected by
tests/processes/test_checkpointing_http.py and tests/unit/test_checkpointing_serialization.py, and a failed
heal is not committed
(tests/unit/test_manager_protocol.py::test_a_failed_heal_is_not_committed_and_loads_nothing).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from workers.helpers import FTLAUNCH, alive, finish, kill_tree, start, wait_for

from ftlaunch.lighthouse.server import LighthouseServer
from tests.mp_harness import Group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Slow enough that a survivor is still training when a restarted group is back (a process start takes
# tens of seconds on a loaded 2-core machine; a group that comes back after the others finished has
# nobody to heal from).
ARGS = [
    "--step-sleep",
    "0.2",
    "--timeout",
    "10",
    "--quorum-timeout",
    "20",
    "--connect-timeout",
    "2",
    "--max-seconds",
    "250",
]


@pytest.fixture
def lighthouse() -> Iterator[LighthouseServer]:
    with LighthouseServer(
        "127.0.0.1:0", min_replicas=1, join_timeout=2.0, heartbeat_timeout=3.0, quorum_tick=0.05
    ).start() as lh:
        yield lh


def last_step(g: Group) -> int:
    steps = g.steps() if g.out().exists() else []
    return max((r["after"] for r in steps if r["committed"]), default=0)


def healing_since(g: Group, t: float) -> dict | None:
    for r in g.records() if g.out().exists() else []:
        if r.get("healing") and r["t"] > t:
            return r
    return None


def committed_between(g: Group, t0: float, t1: float) -> int:
    return sum(1 for r in g.steps() if r["committed"] and t0 < r["t"] < t1)


def assert_all_identical(gs: list[Group], steps: int) -> None:
    finals = [g.final() for g in gs]
    assert all(f is not None and f["step"] == steps for f in finals), finals
    assert len({f["checksum"] for f in finals if f is not None}) == 1, finals


def test_a_receiver_killed_while_it_heals(
    tmp_path: Path, lighthouse: LighthouseServer, groups: list[Group]
) -> None:
    steps = 250
    gs = [
        Group(i, 1, lighthouse.address, tmp_path, ["--steps", str(steps), "--heal-delay", "2", *ARGS])
        for i in range(2)
    ]
    groups.extend(gs)
    for g in gs:
        g.start()
    wait_for(lambda: last_step(gs[0]) >= 10, 120, "10 steps")
    gs[1].kill()
    t_restart = time.time()
    gs[1].restart()
    wait_for(lambda: healing_since(gs[1], t_restart) is not None, 120, "rg1 to start healing")
    t_kill = gs[1].kill()  # in the middle of its heal: the source is serving it
    gs[1].restart()
    for g in gs:
        assert g.wait(250) == [0], g.log_tail()
    assert committed_between(gs[0], t_kill, t_kill + 10) >= 3, "the source stalled after its healer died"
    assert_all_identical(gs, steps)


def test_the_source_killed_while_it_serves_a_heal(
    tmp_path: Path, lighthouse: LighthouseServer, groups: list[Group]
) -> None:
    steps = 250
    gs = [
        Group(i, 1, lighthouse.address, tmp_path, ["--steps", str(steps), "--heal-delay", "2", *ARGS])
        for i in range(3)
    ]
    groups.extend(gs)
    for g in gs:
        g.start()
    wait_for(lambda: min(last_step(g) for g in gs) >= 10, 150, "10 steps in every group")
    gs[2].kill()
    t_restart = time.time()
    gs[2].restart()
    wait_for(lambda: healing_since(gs[2], t_restart) is not None, 120, "rg2 to start healing")
    src_url = healing_since(gs[2], t_restart)["src"]  # type: ignore[index]
    urls = {r["transport"]: g for g in gs[:2] for r in g.records() if "transport" in r}
    source = urls[src_url]
    other = gs[1] if source is gs[0] else gs[0]
    t_kill = source.kill()  # the healer fetches from a dead source: its step fails, it heals again
    source.restart()
    for g in gs:
        assert g.wait(250) == [0], g.log_tail()
    assert committed_between(other, t_kill, t_kill + 15) >= 3, "the surviving group stalled"
    heals = [r for r in gs[2].records() if r.get("healing") and r["t"] > t_restart]
    assert len(heals) >= 2, "the healer did not try again after its source died"
    assert_all_identical(gs, steps)


def test_both_non_leader_groups_killed_at_once(
    tmp_path: Path, lighthouse: LighthouseServer, groups: list[Group]
) -> None:
    """rg0 hosts the cross-group rendezvous (first participant); rg1 and rg2 die in the same instant."""
    steps = 250
    gs = [Group(i, 1, lighthouse.address, tmp_path, ["--steps", str(steps), *ARGS]) for i in range(3)]
    groups.extend(gs)
    for g in gs:
        g.start()
    wait_for(lambda: min(last_step(g) for g in gs) >= 10, 150, "10 steps in every group")
    for g in gs[1:]:
        for p in g.procs:
            p.send_signal(signal.SIGKILL)
    t_kill = time.time()
    for g in gs[1:]:
        g.kill()  # reaps them
        g.restart()
    wait_for(lambda: committed_between(gs[0], t_kill, time.time()) >= 3, 60, "rg0 to go on alone")
    for g in gs:
        assert g.wait(250) == [0], g.log_tail()
    assert_all_identical(gs, steps)


def test_a_baby_child_killed_costs_steps_not_the_worker(
    tmp_path: Path, lighthouse: LighthouseServer, groups: list[Group]
) -> None:
    steps = 80
    gs = [
        Group(i, 1, lighthouse.address, tmp_path, ["--steps", str(steps), "--backend", "baby-gloo", *ARGS])
        for i in range(2)
    ]
    groups.extend(gs)
    for g in gs:
        g.start()
    wait_for(lambda: min(last_step(g) for g in gs) >= 10, 150, "10 steps in every group")
    worker = psutil.Process(gs[1].procs[0].pid)
    children = [c for c in worker.children() if "process_group.baby.child" in " ".join(c.cmdline())]
    assert children, f"no Baby child under the worker: {[c.cmdline() for c in worker.children()]}"
    t_kill = time.time()
    for c in children:
        c.kill()
    for g in gs:
        assert g.wait(250) == [0], g.log_tail()
    assert len({r["pid"] for r in gs[1].steps()}) == 1, "the worker itself must survive its child"
    failed = [r for g in gs for r in g.steps() if not r["committed"] and r["t"] > t_kill]
    assert len(failed) <= 6, f"a killed child should cost a step or two, not {len(failed)}"
    assert_all_identical(gs, steps)


def test_one_rank_of_a_two_rank_group_sigstopped(
    tmp_path: Path, lighthouse: LighthouseServer, groups: list[Group]
) -> None:
    """Rank 1 of rg1 stops. rg1's healthy leader used to bring the group into every quorum, so every
    step of both groups failed on the stopped rank for as long as it stayed stopped. Now the leader
    finds a rank missing from the group's commit vote and ends (CommunicationError), its agent
    (here: the test) restarts the whole group, rg0 goes on meanwhile, and rg1 heals."""
    steps = 150
    args = [
        "--steps",
        str(steps),
        "--step-sleep",
        "0.2",
        "--timeout",
        "4",
        "--quorum-timeout",
        "8",
        "--connect-timeout",
        "2",
        "--max-seconds",
        "250",
    ]
    g0 = Group(0, 2, lighthouse.address, tmp_path, args)  # ranks pair up across groups: same size
    g1 = Group(1, 2, lighthouse.address, tmp_path, args)
    groups.extend([g0, g1])
    g0.start()
    g1.start()
    wait_for(lambda: min(last_step(g0), last_step(g1)) >= 10, 150, "10 steps in both groups")
    g1.procs[1].send_signal(signal.SIGSTOP)
    g1.procs[0].wait(timeout=60)  # the leader ends: a rank did not vote
    assert g1.procs[0].returncode != 0
    exc = [r for r in g1.records(0) if "exception" in r]
    assert exc and exc[-1]["exception"] == "CommunicationError" and "did not vote" in exc[-1]["message"], exc
    t_leader_gone = time.time()
    wait_for(lambda: committed_between(g0, t_leader_gone, time.time()) >= 3, 60, "rg0 to go on without rg1")
    g1.procs[1].send_signal(signal.SIGCONT)
    g1.kill()  # the agent restarts a group whose worker failed (SIGKILL for the stopped rank)
    g1.restart()
    for g in (g0, g1):
        assert g.wait(250) == [0] * g.nworkers, g.log_tail()
    sums = {g.final(r)["checksum"] for g in (g0, g1) for r in range(2)}  # type: ignore[index]
    assert len(sums) == 1, sums


def test_a_sigkilled_supervisor_leaves_no_process_behind(tmp_path: Path) -> None:
    """Agents die with the supervisor (PR_SET_PDEATHSIG -> SIGTERM), workers with their agents, Baby
    children with their workers; also a SIGSTOPped worker, which cannot act on torchelastic's SIGTERM:
    the agent watches the supervisor's pid and ends its tree within 2 s (before: 30 s, torchelastic's
    SIGKILL). The bound is generous for a loaded machine, and under the old 30 s."""
    proc = start(
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--nproc-per-node",
            "2",
            "--no-status",
            "--chaos",
            "steps=15,group=1,signal=STOP,stop_for=100",
            "--log-dir",
            str(tmp_path / "logs"),
            "scripts/train_ddp.py",
            "--steps",
            "100000",
            "--step-sleep",
            "0.05",
        ]
    )
    try:

        def tree() -> list[psutil.Process]:
            try:
                return psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                return []

        # The SIGSTOP comes at step 15: every worker has its Baby child by then (a fork of the worker,
        # so no command line tells it apart).
        wait_for(
            lambda: any(p.status() == psutil.STATUS_STOPPED for p in tree()), 270, "the SIGSTOP", interval=0.5
        )
        pids = [p.pid for p in tree()]
        proc.send_signal(signal.SIGKILL)
        finish(proc, 30)
        deadline = time.monotonic() + 15
        while [p for p in pids if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in pids if alive(p)]
    finally:
        kill_tree(proc.pid)
    assert len(pids) >= 10 and not left, f"{len(left)} of {len(pids)} processes outlived the supervisor"
