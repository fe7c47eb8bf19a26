"""Training through a lighthouse that dies (issue 17, item 3), with real processes.

A standalone ``ftlaunch-lighthouse`` process serves ``ftlaunch --lighthouse ADDR`` with three groups
of scripts/train_ddp.py. Mid-run the lighthouse is killed (SIGKILL, or SIGTERM: it answers its parked
requests 503 and exits), stays down for longer than the workers' connect timeout (10 s: before the
fix this ended every worker with `LighthouseUnavailableError`) and is restarted on the same port.
Every group must finish with the same weights, every group's committed steps must be 1..N once each
(none committed twice, none lost), and the new lighthouse's first quorum must hold all three groups
(formed from their resume reports, not from whoever reconnected first), under a higher id.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
from workers.helpers import FTLAUNCH, finish, free_port, kill_tree, start, wait_for

from ftlaunch.lighthouse.client import LighthouseClient

TRAIN = "scripts/train_ddp.py"
STEPS = 120


def start_lighthouse(port: int) -> subprocess.Popen:
    proc = start([sys.executable, "-m", "ftlaunch.lighthouse", "--bind", f"127.0.0.1:{port}",
                  "--heartbeat-timeout", "5", "--log-level", "INFO"])
    client = LighthouseClient(f"127.0.0.1:{port}", connect_timeout=1.0)
    try:
        wait_for(lambda: _answers(client), 60, "the lighthouse to answer")
    finally:
        client.close()
    return proc


def _answers(client: LighthouseClient) -> bool:
    try:
        client.status()
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


def max_step(port: int) -> int:
    client = LighthouseClient(f"127.0.0.1:{port}", connect_timeout=1.0)
    try:
        return max((g.step for g in client.snapshot().groups), default=0)
    except Exception:  # noqa: BLE001 - not up yet
        return 0
    finally:
        client.close()


def committed_steps(stdout: str) -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for m in re.finditer(r"rg(\d+)[/\]][^\n]*?step=(\d+) committed=True", stdout):
        found.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_training_survives_a_lighthouse_restart_longer_than_the_connect_timeout(sig: int) -> None:
    port = free_port()
    lighthouse = start_lighthouse(port)
    job = start([*FTLAUNCH, "--replicas", "3", "--lighthouse", f"http://127.0.0.1:{port}",
                 TRAIN, "--steps", str(STEPS), "--step-sleep", "0.1"])
    new_lighthouse: subprocess.Popen | None = None
    try:
        wait_for(lambda: max_step(port) >= 20, 150, "20 steps before the lighthouse dies", interval=0.5)
        lighthouse.send_signal(sig)
        lighthouse.communicate(timeout=30)
        time.sleep(12.0)  # > the workers' 10 s connect timeout
        assert job.poll() is None, "the job must not end while the lighthouse is down"
        new_lighthouse = start_lighthouse(port)
        res = finish(job, 200)
    finally:
        kill_tree(job.pid)
        for p in (lighthouse, new_lighthouse):
            if p is not None and p.poll() is None:
                p.terminate()
                p.communicate(timeout=30)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    sums = dict(re.findall(r"rg(\d+)[/\]][^\n]*?final_checksum=(\w+)", res.stdout))
    assert set(sums) == {"0", "1", "2"} and len(set(sums.values())) == 1, sums
    for group, steps in committed_steps(res.stdout).items():
        assert steps == list(range(1, STEPS + 1)), f"rg{group} committed {steps}"
    assert "waits up to 300s for the lighthouse to come back" in out
    assert new_lighthouse is not None
    _, lh_err = new_lighthouse.communicate(timeout=1) if new_lighthouse.poll() is not None else ("", "")
    assert "LighthouseUnavailableError" not in out


@pytest.mark.timeout(120)
def test_a_restarted_lighthouse_forms_its_first_quorum_from_every_reported_group() -> None:
    """The restart with real worker processes but no training: three Managers (one process each)
    loop on quorums; the lighthouse is SIGKILLed and restarted after 12 s; the new one's first quorum
    holds all three groups, above the old ids, and nobody raised."""
    port = free_port()
    lighthouse = start_lighthouse(port)
    workers = [
        start([sys.executable, "-m", "workers.manager_worker", "--quorum-loop", "--replica", f"rg{i}",
               "--lighthouse", f"http://127.0.0.1:{port}", "--seconds", "40"], cwd="tests")
        for i in range(3)
    ]
    new_lighthouse: subprocess.Popen | None = None
    try:
        wait_for(lambda: max_step(port) >= 5, 60, "quorums before the lighthouse dies", interval=0.3)
        old = LighthouseClient(f"127.0.0.1:{port}", connect_timeout=1.0)
        old_id = old.snapshot().quorum_id
        old.close()
        lighthouse.kill()
        lighthouse.communicate(timeout=30)
        time.sleep(12.0)
        assert all(w.poll() is None for w in workers)
        new_lighthouse = start_lighthouse(port)
        client = LighthouseClient(f"127.0.0.1:{port}", connect_timeout=1.0)
        wait_for(lambda: client.snapshot().quorum is not None, 30, "the new lighthouse's first quorum", interval=0.2)
        first = next(h for h in reversed(client.snapshot().history) if h.event == "quorum")
        client.close()
        assert first.participants == ("rg0", "rg1", "rg2") and old_id is not None and first.quorum_id is not None
        assert first.quorum_id > old_id
        results = [finish(w, 90) for w in workers]
    finally:
        for w in workers:
            kill_tree(w.pid)
        for p in (lighthouse, new_lighthouse):
            if p is not None and p.poll() is None:
                p.terminate()
                p.communicate(timeout=30)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
