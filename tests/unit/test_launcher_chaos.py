"""``--chaos`` scheduling, target choice and injection (ftlaunch.launcher.chaos) in one process: the
signals go to a recording fake instead of ``os.kill``; a slowdown's duty cycle
(ftlaunch.launcher.throttle) on a real busy process."""

from __future__ import annotations

import io
import random
import signal
import statistics
import subprocess
import sys
import time

import psutil
import pytest

from ftlaunch.launcher.chaos import Chaos, ChaosSchedule, choose_target
from ftlaunch.launcher.group import Group
from ftlaunch.launcher.options import ChaosSpec
from ftlaunch.launcher.output import Console
from ftlaunch.launcher.throttle import MAX_STOP, Throttle


def training(n: int, stepped: bool = True) -> list[Group]:
    groups = []
    for gid in range(n):
        g = Group(gid)
        g.agent_started()
        g.workers_started(0, {0: 100 + gid}, now=0.0)
        if stepped:
            g.step_line(1, True, now=0.0)
        groups.append(g)
    return groups


class Kills:
    def __init__(self, dead: frozenset[int] = frozenset()) -> None:
        self.sent: list[tuple[int, int]] = []
        self._dead = dead

    def __call__(self, pid: int, sig: int) -> None:
        if pid in self._dead:
            raise ProcessLookupError(pid)
        self.sent.append((pid, sig))


def chaos(spec: ChaosSpec, groups: list[Group], kills: Kills) -> tuple[Chaos, io.StringIO]:
    err = io.StringIO()
    return Chaos(spec, groups, Console(io.StringIO(), err, status=False), started=100.0, kill=kills), err


def test_every_counts_from_the_first_step_line_and_restarts_after_each_injection() -> None:
    s = ChaosSchedule(ChaosSpec(every=10), started=100.0)
    assert not s.due(200.0, training_started=None, step=None)  # no training yet: the clock has not started
    assert not s.due(115.0, training_started=110.0, step=3)
    assert s.due(120.0, training_started=110.0, step=5)
    s.injected(121.0, step=5)
    assert not s.due(130.0, 110.0, 9) and s.due(131.0, 110.0, 9)


def test_start_counts_from_launch() -> None:
    s = ChaosSchedule(ChaosSpec(every=5, start=1), started=100.0)
    assert not s.due(105.9, training_started=None, step=None) and s.due(106.0, None, None)


def test_steps_are_due_in_order_and_consumed_once_injected() -> None:
    s = ChaosSchedule(ChaosSpec(steps=(10, 30)), started=0.0)
    assert not s.due(1.0, 0.0, 9) and s.due(1.0, 0.0, 10)
    s.injected(1.0, 12)
    assert not s.due(2.0, 0.0, 29) and s.due(2.0, 0.0, 31)
    s.injected(2.0, 31)
    assert not s.due(3.0, 0.0, 1000)


def test_target_is_never_the_last_healthy_group() -> None:
    rng = random.Random(0)
    groups = training(2)
    groups[0].worker_exited(100, 0, 0, True, "killed", now=1.0)  # recovering
    assert choose_target(ChaosSpec(every=1), groups, 0.0, rng) is None
    assert choose_target(ChaosSpec(every=1, group=1), groups, 0.0, rng) is None
    groups = training(2)
    assert choose_target(ChaosSpec(every=1, group=1), groups, 0.0, rng) is groups[1]
    assert choose_target(ChaosSpec(every=1), groups, 0.0, rng) in groups
    assert choose_target(ChaosSpec(every=1), training(1), 0.0, rng) is not None  # a one-group job may be hit


def test_target_must_be_training_once_training_has_started() -> None:
    rng = random.Random(0)
    groups = training(2, stepped=False)
    assert choose_target(ChaosSpec(every=1), groups, training_started=5.0, rng=rng) is None
    assert choose_target(ChaosSpec(every=1), groups, training_started=None, rng=rng) is not None


def test_kill_injection_is_recorded_and_measured_until_the_group_rejoins() -> None:
    groups, kills = training(2), Kills()
    c, err = chaos(ChaosSpec(steps=(1,), group=1), groups, kills)
    c.tick(110.0, training_started=105.0, agent_pids={0: 50, 1: 51})
    assert kills.sent == [(101, signal.SIGKILL)]
    assert "[ftlaunch] chaos: SIGKILL -> replica group 1 workers (pids 101) at step 1" in err.getvalue()
    c.tick(111.0, 105.0, {0: 50, 1: 51})
    assert len(c.injections) == 1  # steps=1 is consumed
    c.rejoined(1, now=114.0)
    assert c.injections[0].rejoined_after == 4.0


def test_agent_target_and_gone_processes() -> None:
    groups, kills = training(2), Kills(dead=frozenset({101}))
    c, _ = chaos(ChaosSpec(every=1, group=1, target="agent"), groups, kills)
    c.tick(110.0, 105.0, agent_pids={1: 51})
    assert kills.sent == [(51, signal.SIGKILL)]
    groups, kills = training(2), Kills(dead=frozenset({101}))
    c, _ = chaos(ChaosSpec(every=1, group=1), groups, kills)
    c.tick(110.0, 105.0, {})
    assert c.injections == []  # nothing was there to hit: try again later


def test_stop_hangs_the_group_then_resumes_it() -> None:
    groups, kills = training(2), Kills()
    c, _ = chaos(ChaosSpec(steps=(1,), group=0, signal="STOP", stop_for=3), groups, kills)
    c.tick(110.0, 105.0, {})
    assert kills.sent == [(100, signal.SIGSTOP)] and groups[0].paused and not groups[0].healthy
    c.tick(112.9, 105.0, {})
    assert groups[0].paused
    c.tick(113.0, 105.0, {})
    assert kills.sent[-1] == (100, signal.SIGCONT) and not groups[0].paused


def test_resume_all_before_teardown() -> None:
    groups, kills = training(2), Kills()
    c, _ = chaos(ChaosSpec(steps=(1,), group=0, signal="STOP", stop_for=100), groups, kills)
    c.tick(110.0, 105.0, {})
    c.resume_all()
    assert kills.sent[-1] == (100, signal.SIGCONT)


def test_count_and_ending_jobs_stop_the_chaos() -> None:
    groups, kills = training(3), Kills()
    c, _ = chaos(ChaosSpec(every=1, count=1, seed=1), groups, kills)
    c.tick(110.0, 105.0, {})
    victim = next(g for g in groups if g.worker_pids[0] == kills.sent[0][0])
    victim.worker_exited(victim.worker_pids[0], 0, 0, True, "killed by SIGKILL", now=110.1)
    victim.workers_started(1, {0: 200}, now=111.0)
    victim.step_line(5, True, now=112.0)
    assert all(g.healthy for g in groups)  # a target is available again, but count=1 is spent
    c.tick(120.0, 105.0, {})
    assert len(kills.sent) == 1
    groups, kills = training(3), Kills()
    groups[2].worker_exited(102, 0, 0, False, "exited with code 0", now=1.0)  # the training is ending
    c, _ = chaos(ChaosSpec(every=1), groups, kills)
    c.tick(110.0, 105.0, {})
    assert kills.sent == []


class FakeThrottle:
    """What `Chaos` needs of a `Throttle`: its pids, factor, duration, whether it runs, stop."""

    def __init__(self, pids: tuple[int, ...], factor: float, duration: float) -> None:
        self.pids, self.factor, self.duration = pids, factor, duration
        self.running = True
        self.ended: float | None = None

    def stop(self) -> None:
        self.running = False


def test_slow_throttles_the_workers_without_a_hang_then_releases_them() -> None:
    groups, kills = training(3), Kills()
    started: list[FakeThrottle] = []

    def slow(group: Group, agent_pid: int | None) -> FakeThrottle:
        assert agent_pid == 51  # the standby's forks are found under the agent
        started.append(FakeThrottle(tuple(p + 1000 for p in group.worker_pids.values()), 2.0, 60.0))
        return started[-1]

    err = io.StringIO()
    spec = ChaosSpec.parse("steps=1,group=1,slow=2,slow_for=60")
    c = Chaos(spec, groups, Console(io.StringIO(), err, status=False), 100.0, kill=kills, slow=slow)  # type: ignore[arg-type]
    c.tick(110.0, 105.0, {0: 50, 1: 51, 2: 52})
    assert kills.sent == [] and len(started) == 1  # no signal of its own: the throttle's duty cycle
    assert (
        "[ftlaunch] chaos: replica group 1 workers slowed down 2x for 60s (pids 1101; stopped while they "
        "work, 1x as long as each step's work or 20 ms of CPU time took) at step 1" in err.getvalue()
    )
    inj = c.injections[0]
    assert (inj.signal, inj.group, inj.factor, inj.until) == ("SLOW", 1, 2.0, 170.0)
    assert groups[1].healthy and not groups[1].paused  # slow, not hung
    # Its stops (of the fork, mirrored to the proxy torchelastic watches) are no hang.
    assert c.throttling(1101, 111.0) and c.throttling(101, 111.0) and not c.throttling(100, 111.0)
    # Not hit again while slowed, and released when its time is up.
    c.tick(111.0, 105.0, {})
    assert len(started) == 1
    started[0].running, started[0].ended = False, 170.0
    c.tick(170.1, 105.0, {})
    assert inj.lasted == 60.0 and "runs at full speed again after 60.0s" in err.getvalue()
    assert c.throttling(1101, 171.0) and not c.throttling(1101, 172.5)  # late stop reports only


def test_slow_ends_at_teardown() -> None:
    groups, kills = training(2), Kills()
    throttle = FakeThrottle((100,), 3.0, 600.0)
    c = Chaos(ChaosSpec(steps=(1,), group=0, slow=3.0), groups, Console(io.StringIO(), io.StringIO(),
                                                                        status=False),
              100.0, kill=kills, slow=lambda g, a: throttle)  # type: ignore[arg-type]  # fmt: skip
    c.tick(110.0, 105.0, {})
    c.resume_all()
    assert not throttle.running and c.injections[0].lasted is not None


@pytest.mark.timeout(60)
def test_a_real_throttle_slows_a_process_by_its_factor_and_leaves_it_running() -> None:
    """A busy process slowed 2x for 3 s gets clearly less CPU time than a busy sibling left alone
    beside it, is never stopped for long (each stop is at most `MAX_STOP`: no hang), and ends
    continued."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        p, sibling = (psutil.Process(q.pid) for q in procs)
        time.sleep(0.5)
        cpu0, other0, t0 = sum(p.cpu_times()[:2]), sum(sibling.cpu_times()[:2]), time.monotonic()
        throttle = Throttle([p], 2.0, 3.0).start()
        longest_stop, stopped_since = 0.0, None
        while throttle.running:
            now = time.monotonic()
            if p.status() == psutil.STATUS_STOPPED:
                stopped_since = stopped_since if stopped_since is not None else now
                longest_stop = max(longest_stop, now - stopped_since)
            else:
                stopped_since = None
            time.sleep(0.002)
        used = sum(p.cpu_times()[:2]) - cpu0
        other = sum(sibling.cpu_times()[:2]) - other0
        share = used / (time.monotonic() - t0)
        assert throttle.periods >= 5 and share <= 0.75 and used < 0.75 * other, (
            throttle.periods,
            used,
            other,
        )
        assert longest_stop < MAX_STOP + 0.1, longest_stop  # far below the hung rule's half second
        time.sleep(0.05)
        assert p.status() != psutil.STATUS_STOPPED
    finally:
        for q in procs:
            q.kill()
            q.wait()


#: WORK ms of CPU work (argv[1]), then a 30 ms sleep, over and over; each line: the work's and the
#: sleep's wall time.
WORK_THEN_SLEEP = """
import sys, time
work = float(sys.argv[1]) / 1e3
while True:
    t0 = time.perf_counter(); until = time.thread_time() + work
    while time.thread_time() < until:
        pass
    t1 = time.perf_counter(); time.sleep(0.03); t2 = time.perf_counter()
    print(f"{t1 - t0:.5f} {t2 - t1:.5f}", flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("work_ms", [20, 5])
def test_the_throttle_slows_every_step_s_work_and_not_the_waits(tmp_path, work_ms: int) -> None:
    """A slow GPU makes a group's work slow, not its waits: the stops land while the process works,
    in every step's work. Two processes alternate ``work_ms`` of CPU work and a 30 ms sleep; the one
    slowed 2x takes clearly longer for its work than its sibling left alone beside it (same machine,
    same load) -- the median step, also where a step's work is shorter than the `RUN_CPU` a stop
    may wait for -- and its sleeps stay about as long as the sibling's (a stop in a sleep would
    lengthen them as much as the work)."""
    outs = [tmp_path / f"p{i}.txt" for i in range(2)]
    command = [sys.executable, "-c", WORK_THEN_SLEEP, str(work_ms)]
    procs = [subprocess.Popen(command, stdout=out.open("w"), text=True) for out in outs]
    try:
        time.sleep(0.5)
        marks = [len(out.read_text().splitlines()) for out in outs]
        throttle = Throttle([psutil.Process(procs[0].pid)], 2.0, 4.0).start()
        while throttle.running:
            time.sleep(0.05)
    finally:
        for q in procs:
            q.kill()
            q.wait()
    rows = [
        [tuple(map(float, line.split())) for line in out.read_text().splitlines()[m + 2 : -1]]
        for out, m in zip(outs, marks, strict=True)
    ]
    slowed, alone = ([statistics.median(r[k] for r in rs) for k in (0, 1)] for rs in rows)
    assert len(rows[0]) >= 5 and throttle.periods >= 10, (len(rows[0]), throttle.periods)
    assert slowed[0] >= 1.5 * alone[0], (slowed, alone)  # its work: ~2x
    # Its waits: as they were, give or take a stop that caught it woken but not yet run (a busy CPU).
    assert slowed[1] - alone[1] <= max(0.015, 0.5 * (slowed[0] - alone[0])), (slowed, alone)


def test_throttle_refuses_nonsense_and_skips_gone_processes() -> None:
    with pytest.raises(ValueError, match="factor"):
        Throttle([], 1.0, 1.0)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    p = psutil.Process(proc.pid)
    proc.wait()
    throttle = Throttle([p], 2.0, 30.0).start()
    throttle._thread.join(timeout=5)  # nothing left to slow: it ends at once
    assert not throttle.running and throttle.periods == 0
