"""a (re)starting group costs its peers nothing, and its start-up is measurable.

- `ProcessGroup.wait_ready` on each backend (Baby: the child serves; the others: no-op);
- the Manager asks the lighthouse -- and starts beating, which counts it as live -- only once every
  rank of its group is ready (fakes, one process);
- the opt-in phase log (`ftlaunch.phases`);
- `ftlaunch.bootstrap.prestart` runs a script as ``python`` would and hands its early Baby child over;
- real processes and a SIGKILL: a survivor keeps committing while the restarted group's Baby child
  is (artificially) slow to start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist
from test_manager_protocol import MemoryTransport, ScriptedLighthouse, UserState, in_step

from ftlaunch import env, phases
from ftlaunch.errors import CommunicationError
from ftlaunch.process_group import ErrorSwallowingProcessGroupWrapper, ProcessGroupBabyGloo, ProcessGroupGloo
from ftlaunch.process_group.baby import ProcessGroupBabyNCCL
from ftlaunch.process_group.fake import FakeProcessGroup
from ftlaunch.worker.manager import Manager

REPO = Path(__file__).resolve().parents[2]


class SlowToStart(FakeProcessGroup):
    """A fake whose `wait_ready` blocks until the test lets it go (a Baby child importing torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.waited = 0

    def wait_ready(self, timeout: timedelta | float | None = None) -> None:
        self.waited += 1
        assert self.go.wait(30), "the test never let the process group become ready"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        env.RANK,
        env.WORLD_SIZE,
        env.MASTER_ADDR,
        env.MASTER_PORT,
        env.TORCHELASTIC_RESTART_COUNT,
        env.REPLICA_GROUP_ID,
        env.FTLAUNCH_LIGHTHOUSE,
        env.TORCHFT_LIGHTHOUSE,
        env.FTLAUNCH_PHASE_LOG,
    ):
        monkeypatch.delenv(var, raising=False)


def manager(
    pg: FakeProcessGroup,
    client: ScriptedLighthouse | None,
    *,
    rank: int = 0,
    world_size: int = 1,
    store: dist.Store | None = None,
) -> Manager:
    user = UserState(pg)
    return Manager(
        pg=pg, load_state_dict=user.load, state_dict=user.save, replica_id="rg0", rank=rank,
        world_size=world_size, group_store=store if store is not None else dist.HashStore(),
        store_addr="10.0.0.1", store_port=29500, quorum_client=client,
        checkpoint_transport=MemoryTransport(f"rg0/r{rank}", pg), timeout=5.0,
    )  # fmt: skip


def one_step(m: Manager) -> bool:
    m.start_quorum()
    m.allreduce(torch.ones(4)).get_future().wait()
    return m.should_commit()


# ------------------------------------------------------------------------------ wait_ready per backend


def test_wait_ready_is_a_no_op_for_in_process_backends() -> None:
    gloo = ProcessGroupGloo(timeout=timedelta(seconds=5))
    gloo.wait_ready()  # nothing to wait for: built at configure, in this process
    gloo.shutdown()
    FakeProcessGroup().wait_ready()
    inner = SlowToStart()
    inner.go.set()
    ErrorSwallowingProcessGroupWrapper(inner).wait_ready()  # a wrapper waits for what it wraps
    assert inner.waited == 1


@pytest.mark.timeout(180)
def test_baby_wait_ready_returns_once_the_child_serves_and_replaces_a_dead_one() -> None:
    pg = ProcessGroupBabyGloo(timeout=30.0)
    try:
        pg.wait_ready()
        first = pg.child_pid
        assert first is not None and pg._child is not None and pg._child.ready
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while psutil.Process(first).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.02)  # dead, not yet reaped: nobody has noticed (the child was idle)
        pg.wait_ready()  # a dead child is replaced, and waited for
        assert pg.child_pid not in (None, first) and pg._child.ready
    finally:
        pg.shutdown()
    pg.wait_ready()  # shut down: nothing to wait for, and no child is started
    assert pg.child_pid is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_baby_nccl_wait_ready_without_cuda_refuses() -> None:
    pg = ProcessGroupBabyNCCL(timeout=5.0)
    with pytest.raises(NotImplementedError):
        pg.wait_ready()
    pg.shutdown()


def test_baby_wait_ready_reports_a_child_that_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from ftlaunch.bootstrap import prestart

    monkeypatch.setattr(prestart, "CHILD_ARGV", ["-c", "import sys; sys.exit(3)"])
    pg = ProcessGroupBabyGloo(timeout=5.0)
    try:
        with pytest.raises(CommunicationError, match="exited during startup"):
            pg.wait_ready()
    finally:
        pg.shutdown()


# ------------------------------------------------------------------------------ the Manager's order


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("clean_env")
def test_manager_asks_and_beats_only_once_its_process_group_is_ready() -> None:
    pg, lighthouse = SlowToStart(), ScriptedLighthouse(in_step(1, "rg1"))
    m = manager(pg, lighthouse)
    try:
        # The quorum thread now waits for the process group; a first step waits for its quorum (it
        # may heal before its forward pass), so the training thread waits too.
        first = threading.Thread(target=m.start_quorum)
        first.start()
        deadline = time.monotonic() + 10
        while not pg.waited and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pg.waited == 1
        time.sleep(0.2)  # would be plenty for a request to go out, were it allowed to
        assert lighthouse.asked == [] and lighthouse.heartbeats == []  # not counted as live, not asking
        pg.go.set()
        first.join(timeout=10)
        m.allreduce(torch.ones(4)).get_future().wait()
        assert m.should_commit()
        assert [a.step for a in lighthouse.asked] == [0] and lighthouse.heartbeats == ["rg0"]
        assert one_step(m) and pg.waited == 1  # once: later steps do not wait again
    finally:
        m.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("clean_env")
def test_group_leader_asks_only_once_every_rank_is_ready() -> None:
    store = dist.HashStore()
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"))
    pgs = [SlowToStart(), SlowToStart()]
    ms = [
        manager(pgs[r], lighthouse if r == 0 else None, rank=r, world_size=2, store=store) for r in range(2)
    ]
    try:
        pgs[0].go.set()  # the leader is ready, rank 1 is not
        with_threads = [threading.Thread(target=lambda m=m: results.append(one_step(m))) for m in ms]
        results: list[bool] = []
        for t in with_threads:
            t.start()
        deadline = time.monotonic() + 10
        while pgs[1].waited == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert lighthouse.asked == [] and lighthouse.heartbeats == []
        pgs[1].go.set()
        for t in with_threads:
            t.join(30)
        assert results == [True, True]
        assert len(lighthouse.asked) == 1 and lighthouse.asked[0].data["ckpt"] == [
            "mem://rg0/r0",
            "mem://rg0/r1",
        ]
    finally:
        for m in ms:
            m.shutdown()


# ------------------------------------------------------------------------------ the phase log


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("clean_env")
def test_phase_log_records_the_start_up_in_order_and_stops_after_the_first_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "phases.jsonl"
    phases.mark("nothing")  # off: no file
    assert not log.exists() and not phases.enabled()
    monkeypatch.setenv(env.FTLAUNCH_PHASE_LOG, str(log))
    monkeypatch.setenv(env.REPLICA_GROUP_ID, "0")
    pg = FakeProcessGroup()
    m = manager(pg, ScriptedLighthouse(in_step(1, "rg1")))
    try:
        assert one_step(m)
        written = phases.read(log)
        assert one_step(m) and phases.read(log) == written  # the step path records nothing more
    finally:
        m.shutdown()
    assert [r["phase"] for r in written] == ["manager_up", "ready", "quorum", "configured", "first_commit"]
    assert all(r["pid"] == os.getpid() and r["replica"] == "0" for r in written)
    times = [r["t"] for r in written]
    assert times == sorted(times)
    started = phases.process_start_time()
    assert started is not None and started <= time.time()
    assert started == pytest.approx(psutil.Process().create_time(), abs=2.0)  # psutil rounds the boot time


# ------------------------------------------------------------------------------ ftlaunch.bootstrap.prestart

PRESTART_PROBE = """
import json, os, sys
from ftlaunch.bootstrap import prestart
early = prestart._started.get("gloo")
out = {"name": __name__, "argv": sys.argv, "path0": sys.path[0], "early": early[0].pid if early else None}
if early:
    from ftlaunch.process_group import ProcessGroupBabyGloo
    pg = ProcessGroupBabyGloo(timeout=30.0)
    out["adopted"] = pg.child_pid
    pg.wait_ready()
    out["ready"] = pg._child.ready
    pg.shutdown()
    out["left"] = list(prestart._started)
print(json.dumps(out))
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["", "gloo"])
def test_prestart_runs_the_script_as_python_would_and_hands_its_child_over(
    tmp_path: Path, backend: str
) -> None:
    (tmp_path / "pkg").mkdir()
    script = tmp_path / "pkg" / "probe.py"
    script.write_text(PRESTART_PROBE)
    run_env = {**os.environ, env.FTLAUNCH_BACKEND: backend, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(
        [sys.executable, "-u", "-m", "ftlaunch.bootstrap.prestart", str(script), "a", "--b"],
        capture_output=True,
        text=True,
        timeout=150,
        env=run_env,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["name"] == "__main__" and out["argv"] == [str(script), "a", "--b"]
    assert out["path0"] == str(script.parent)
    if backend == "gloo":  # the job chose plain Gloo: no Baby child was started
        assert out["early"] is None
    else:
        assert (
            out["early"] is not None and out["adopted"] == out["early"] and out["ready"] and out["left"] == []
        )
    # -m MODULE: run as `python -m` would
    res = subprocess.run(
        [sys.executable, "-m", "ftlaunch.bootstrap.prestart", "-m", "pkg.probe", "x"],
        capture_output=True,
        text=True,
        timeout=150,
        env={**run_env, env.FTLAUNCH_BACKEND: "gloo"},
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["name"] == "__main__" and out["argv"] == [str(script), "x"]


# ------------------------------------------------------------------------------ real processes


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_survivor_keeps_committing_while_a_restarted_group_is_slow_to_start(
    tmp_path: Path, groups: list[Any]
) -> None:
    """The restarted group's Baby child sleeps 4 s before importing torch. The
    survivor must not stall that long (in the lighthouse's split-brain wait for a live, silent
    joiner, or in the configure with it): it keeps committing until the joiner is ready,
    and the two end bit-identical."""
    from ftlaunch.lighthouse.server import LighthouseServer
    from tests.mp_harness import Group

    log = tmp_path / "phases.jsonl"
    args = ["--steps", "400", "--step-sleep", "0.1", "--backend", "baby-gloo", "--transport", "pg"]
    with LighthouseServer(min_replicas=1, join_timeout=30.0).start() as lh:
        gs = [
            Group(i, 1, lh.address, tmp_path, args, env={env.FTLAUNCH_PHASE_LOG: str(log)}) for i in range(2)
        ]
        groups.extend(gs)
        for g in gs:
            g.start()
        gs[1].wait_for_step(5, 150)
        t_kill = gs[1].kill()
        gs[1].restart(["--child-start-delay", "4"])
        for g in gs:
            assert g.wait(300) == [0], g.log_tail()
    joiner = [r for r in phases.read(log) if r["replica"] == "1" and r["t"] > t_kill]
    at = {r["phase"]: r["t"] for r in reversed(joiner)}  # the first of each
    assert at["manager_up"] < at["ready"] < at["quorum"] < at["first_commit"], joiner
    survivor = [r["t"] for r in gs[0].steps() if r["committed"]]
    # The survivor commits on while the joiner waits for its child (~4 s at 0.1 s per step).
    assert sum(at["manager_up"] < t < at["ready"] for t in survivor) >= 5, (at, survivor)
    restarted = [r for r in gs[1].steps() if r["t"] > t_kill and r["committed"]]
    assert restarted and restarted[0]["after"] > 1  # healed, did not start over
    assert gs[0].final()["checksum"] == gs[1].final()["checksum"]  # type: ignore[index]


def test_the_launcher_runs_python_workers_through_prestart_and_other_programs_as_given() -> None:
    from ftlaunch.launcher.agent import _worker_args
    from ftlaunch.launcher.options import LaunchOptions

    py = sys.executable
    assert _worker_args(LaunchOptions(py, ["-u", "train.py", "--x"])) == [
        "-u", "-m", "ftlaunch.bootstrap.prestart", "train.py", "--x"]  # fmt: skip
    assert _worker_args(LaunchOptions(py, ["-u", "-m", "pkg.train"])) == [
        "-u",
        "-m",
        "ftlaunch.bootstrap.prestart",
        "-m",
        "pkg.train",
    ]
    assert _worker_args(LaunchOptions("run_script_path", ["/abs/train.py"], run_path=True)) == [
        "/abs/train.py"
    ]
    assert _worker_args(LaunchOptions("/usr/bin/env", ["-u", "x"])) == ["-u", "x"]  # --no-python: a program
