"""An agent whose supervisor dies ends its whole tree at once, stopped workers included.

``PR_SET_PDEATHSIG`` hands the agent a SIGTERM, which starts torchelastic's graceful stop: SIGTERM to
the workers, SIGKILL 30 s later. A SIGSTOPped worker cannot act on its SIGTERM, so it used to outlive
the supervisor by those 30 s. The agent now also watches the supervisor's pid (`lifetime.on_exit`)
and ends its descendants (`procs.end_descendants`). Here with plain processes: a "supervisor"
(``sleep``), an "agent" that runs the real watch, and a "worker" that ignores SIGTERM and is
SIGSTOPped. The whole ``ftlaunch`` path: tests/processes/test_faults_mid_step.py (slow).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(60)

AGENT = """
import subprocess, sys, time
from ftlaunch.launcher import procs
from ftlaunch.lifetime import on_exit
worker = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); \
time.sleep(120)"],
    stdout=subprocess.PIPE, start_new_session=True)
worker.stdout.readline()
on_exit(int(sys.argv[1]), lambda: procs.end_descendants(1.0))
print(worker.pid, flush=True)
time.sleep(120)
"""


def test_a_stopped_worker_dies_soon_after_the_supervisor() -> None:
    supervisor = subprocess.Popen(["sleep", "120"])
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(supervisor.pid)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert agent.stdout is not None
        worker = psutil.Process(int(agent.stdout.readline()))
        worker.send_signal(signal.SIGSTOP)
        worker.send_signal(signal.SIGTERM)  # what torchelastic sends: pending while stopped, ignored after
        time.sleep(0.5)
        assert worker.is_running() and worker.status() == psutil.STATUS_STOPPED
        supervisor.kill()
        supervisor.wait()
        deadline = time.monotonic() + 15  # the agent gives it 1 s; generous for a loaded machine
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "a stopped worker outlived its supervisor"
        assert agent.poll() is None  # the agent itself ends through torchelastic's SIGTERM (PDEATHSIG)
    finally:
        for p in (agent, supervisor):
            p.kill()
            p.wait()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE  # the agent reaps it only when it gets to it
    except psutil.Error:
        return False


def test_on_exit_fires_at_once_for_a_process_already_gone() -> None:
    from ftlaunch.lifetime import on_exit

    p = subprocess.Popen(["true"])
    p.wait()
    fired: list[bool] = []
    on_exit(p.pid, lambda: fired.append(True)).join(5)
    assert fired == [True]


def test_child_listing_and_zombie_reaping_see_every_thread_s_children() -> None:
    """`procs.child_pids` (the kernel's per-thread lists) finds children started from any thread,
    and `reap_zombies` reaps an exited child it does not own, leaves the ones `subprocess` owns to
    their `Popen`, and finds nothing to do while no child has exited."""
    import os
    import threading

    from ftlaunch.launcher import procs

    assert procs.reap_zombies(set()) == []
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in range(2)]
    from_thread: list[subprocess.Popen[bytes]] = []
    t = threading.Thread(
        target=lambda: from_thread.append(
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        )
    )
    t.start()
    t.join()
    owned = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        forked = os.fork()
        if forked == 0:
            os._exit(0)
        assert {p.pid for p in (*sleepers, *from_thread)} <= set(procs.child_pids())
        deadline = time.monotonic() + 20
        reaped: list[int] = []
        while forked not in reaped and time.monotonic() < deadline:
            reaped += procs.reap_zombies({owned.pid})
            time.sleep(0.05)
        assert forked in reaped
        assert owned.wait(20) == 0  # still its Popen's to reap
        assert procs.reap_zombies({owned.pid}) == []
    finally:
        for p in (*sleepers, *from_thread):
            p.kill()
            p.wait()
