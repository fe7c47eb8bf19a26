"""A group started while the lighthouse is down waits for it within the outage budget.

Running workers ride out a lighthouse outage (`ftlaunch.lighthouse.reconnect`), but a group whose
agent the ``ftlaunch`` supervisor respawned during the outage used to fail its first contact after
the connect timeout: its workers are torchelastic's restart 0 and had never reached the lighthouse,
so a dead lighthouse looked like a wrong address. The supervisor (and the rendezvous, once it found
the lighthouse) now tells the workers the job reached it (``FTLAUNCH_LIGHTHOUSE_REACHED``): the
first quorum -- and with hot spares the slot claim -- waits for it like a running group does.

Real processes: scripts/train_ddp.py started as a respawned agent's worker would be, with the
lighthouse's port closed and a 2 s connect timeout; the lighthouse comes back on the same port after
the worker has noticed the outage and waited past that timeout; the worker must then train to the
end. Without the variable the worker fails after 2 s (checked too: the test can fail).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from workers.helpers import REPO, finish, free_port, kill_tree, wait_for

from ftlaunch import env
from ftlaunch.lighthouse.client import LighthouseClient

pytestmark = pytest.mark.timeout(240)

CONNECT_TIMEOUT = 2.0


def start_lighthouse(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftlaunch.lighthouse", "--bind", f"127.0.0.1:{port}", "--min-replicas", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = LighthouseClient(f"127.0.0.1:{port}", connect_timeout=1.0)

    def answers() -> bool:
        try:
            client.status()
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    try:
        wait_for(answers, 60, "the lighthouse to answer", interval=0.2)
    finally:
        client.close()
    return proc


def start_worker(port: int, log: Path, reached: bool, spares: int) -> subprocess.Popen:
    job_env = {
        **os.environ,
        env.REPLICA_GROUP_ID: "0",
        env.NUM_REPLICA_GROUPS: "1",
        env.FTLAUNCH_LIGHTHOUSE: f"http://127.0.0.1:{port}",
        env.FTLAUNCH_CONNECT_TIMEOUT: str(CONNECT_TIMEOUT),
        env.FTLAUNCH_LIGHTHOUSE_OUTAGE: "120",
        env.FTLAUNCH_SPARES: str(spares),
        "PYTHONUNBUFFERED": "1",
    }
    if reached:
        job_env[env.FTLAUNCH_LIGHTHOUSE_REACHED] = "1"  # what the supervisor gives a respawned agent
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, "scripts/train_ddp.py", "--steps", "5", "--max-seconds", "200"],
            cwd=REPO,
            env=job_env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )


def waits_for_the_lighthouse(log: Path) -> bool:
    text = log.read_text(errors="replace")
    return "for the lighthouse to come back" in text


def run_with_outage(tmp_path: Path, reached: bool, spares: int = 0) -> tuple[int, str]:
    port = free_port()  # nothing listens: the lighthouse is down when the worker starts
    log = tmp_path / "worker.log"
    worker = start_worker(port, log, reached, spares)
    lighthouse: subprocess.Popen | None = None
    try:
        wait_for(
            lambda: waits_for_the_lighthouse(log) or worker.poll() is not None,
            150,
            "the worker to notice the outage",
            interval=0.2,
        )
        if worker.poll() is None:
            time.sleep(CONNECT_TIMEOUT + 1.0)  # past the connect timeout: the old failure point
            lighthouse = start_lighthouse(port)
        code = finish(worker, 150).returncode
    finally:
        kill_tree(worker.pid)
        worker.wait()
        if lighthouse is not None:
            lighthouse.kill()
            lighthouse.wait()
    return code, log.read_text(errors="replace")


def test_a_group_started_during_an_outage_waits_for_the_lighthouse(tmp_path: Path) -> None:
    code, out = run_with_outage(tmp_path, reached=True)
    assert code == 0 and "final_checksum=" in out, out[-3000:]


@pytest.mark.slow
def test_without_the_launchers_word_a_dead_lighthouse_is_still_reported_at_once(tmp_path: Path) -> None:
    """A worker started by hand against a lighthouse never reached: a wrong address fails fast."""
    code, out = run_with_outage(tmp_path, reached=False)
    assert code != 0 and "ftlaunch: error: lighthouse http://127.0.0.1:" in out, out[-3000:]
    assert "No lighthouse has answered there" in out and "Traceback" not in out, out[-3000:]


@pytest.mark.slow
def test_a_hot_spare_job_claims_its_slot_after_the_outage(tmp_path: Path) -> None:
    code, out = run_with_outage(tmp_path, reached=True, spares=1)
    assert code == 0 and "final_checksum=" in out, out[-3000:]
