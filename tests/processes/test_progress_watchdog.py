"""Progress-based hang detection: a group whose training thread hangs while its
heartbeat thread keeps beating is noticed from its step calls (ftlaunch.worker.watchdog)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ftlaunch import env
from ftlaunch.errors import ConfigurationError
from ftlaunch.lighthouse.server import LighthouseServer
from ftlaunch.worker.watchdog import ProgressWatchdog, progress_timeout
from tests.mp_harness import Group


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(limit: float = 10.0, waiting: bool = False) -> tuple[ProgressWatchdog, Clock, list[str]]:
    clock, calls = Clock(), []
    w = ProgressWatchdog(
        0.0,
        on_stall=lambda age: calls.append(f"stall {age:g}"),
        on_resume=lambda: calls.append("resume"),
        waiting=lambda: waiting,
        clock=clock,
    )
    w.limit = limit  # no thread: the test drives check()
    return w, clock, calls


def test_not_armed_before_the_first_step_then_stalls_once_and_resumes_at_the_next_step() -> None:
    w, clock, calls = make()
    clock.now += 1000
    assert not w.check() and calls == []  # a long compile before the first step is not a hang
    w.touch()
    clock.now += 10
    assert not w.check()
    clock.now += 0.5
    assert w.check() and w.stalled and calls == ["stall 10.5"]
    clock.now += 100
    assert not w.check() and calls == ["stall 10.5"]  # once
    w.touch()
    assert calls == ["stall 10.5", "resume"] and not w.stalled


def test_waiting_for_a_quorum_is_not_a_hang() -> None:
    w, clock, calls = make(waiting=True)
    w.touch()
    clock.now += 1000
    assert not w.check() and calls == []


def test_progress_timeout_default_env_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def limit() -> float:
        return progress_timeout(60.0, env.WorkerEnv.from_environ().progress_timeout)

    monkeypatch.delenv("FTLAUNCH_PROGRESS_TIMEOUT", raising=False)
    assert limit() == 90.0
    monkeypatch.setenv("FTLAUNCH_PROGRESS_TIMEOUT", "2m")
    assert limit() == 120.0
    monkeypatch.setenv("FTLAUNCH_PROGRESS_TIMEOUT", "0")
    assert limit() == 0.0
    for bad in ("later", "0.001", "-1", "inf"):  # 1 ms would make a healthy leader leave every step
        monkeypatch.setenv("FTLAUNCH_PROGRESS_TIMEOUT", bad)
        with pytest.raises(ConfigurationError, match="FTLAUNCH_PROGRESS_TIMEOUT"):
            limit()
    with pytest.raises(ConfigurationError, match="progress timeout"):
        progress_timeout(60.0, float("nan"))


def test_a_thread_watchdog_fires_and_close_stops_it() -> None:
    calls: list[str] = []
    w = ProgressWatchdog(
        0.2, on_stall=lambda age: calls.append("stall"), on_resume=lambda: calls.append("resume")
    )
    try:
        w.touch()
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls == ["stall"]
        w.touch()
        assert calls == ["stall", "resume"]
    finally:
        w.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_group_hung_with_live_heartbeats_is_left_behind_and_heals_when_it_resumes(tmp_path: Path) -> None:
    """Two groups: rg1's training thread hangs 15 s at step 8 while its heartbeat thread beats on.
    Without the watchdog rg0 could never form a quorum alone (the split-brain guard needs more than
    half of the live groups, and rg1 stays live) and its quorum request would give up. With it, rg1
    leaves after 1.5x the collective timeout, rg0 trains alone, and rg1 heals when it steps again."""
    with LighthouseServer(
        "127.0.0.1:0", min_replicas=1, join_timeout=2.0, heartbeat_timeout=3.0, quorum_tick=0.05
    ).start() as lh:
        args = [
            "--steps",
            "250",
            "--step-sleep",
            "0.1",
            "--timeout",
            "4",
            "--quorum-timeout",
            "8",
            "--connect-timeout",
            "2",
            "--max-seconds",
            "200",
        ]
        g0 = Group(0, 1, lh.address, tmp_path, args)
        g1 = Group(1, 1, lh.address, tmp_path, [*args, "--hang-at-step", "8", "--hang-seconds", "15"])
        try:
            for g in (g0, g1):
                g.start()
            for g in (g0, g1):
                assert g.wait(200) == [0], g.log_tail()
        finally:
            for g in (g0, g1):
                g.close()
    hang = next(r for r in g1.records() if r.get("hang"))
    t_hang, t_back = hang["t"], hang["t"] + 15
    alone = [r for r in g0.steps() if t_hang < r["t"] < t_back and r["committed"]]
    assert len(alone) >= 5, "rg0 did not go on while rg1 hung"
    assert g0.final()["step"] == 250 and g0.steps()[-1]["participants"] == 2, (
        "rg1 never trained with rg0 again"
    )
    assert alone[0]["t"] - t_hang < 20, "rg0 waited longer than the progress timeout and its quorum"
    back = [r for r in g1.steps() if r["t"] > t_back and r["committed"]]
    assert back and back[0]["after"] > 12, "rg1 did not heal to rg0's step"
    assert "leaving the lighthouse" in (tmp_path / "rg1_r0_a0.log").read_text()
    assert g0.final()["checksum"] == g1.final()["checksum"]  # type: ignore[index]
