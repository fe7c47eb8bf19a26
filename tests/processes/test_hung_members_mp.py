"""A SIGSTOPped group is declared lost on evidence, in real processes (lighthouse/hung.py).

Short: a real lighthouse, this process as one group leader whose step is blocked (it reports so in
its heartbeats), and another leader in a subprocess that is SIGSTOPped; the heartbeat timeout is 30 s,
so only the evidence rule can declare it within this test's 25 s; the same for a member of the quorum a
restarted lighthouse adopted from a resume report. Slow: the real training
(scripts/train_ddp.py) under ``ftlaunch`` with a group SIGSTOPped for 6 s: the other goes on without
it, the stopped one rejoins when it wakes, all end bit-identical.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
from workers.helpers import FTLAUNCH, run

from ftlaunch.errors import QuorumTimeoutError
from ftlaunch.lighthouse.client import LighthouseClient
from ftlaunch.lighthouse.protocol import RESUME_KEY
from ftlaunch.lighthouse.quorum import Quorum, QuorumMember
from ftlaunch.lighthouse.reconnect import resume_report
from ftlaunch.lighthouse.server import LighthouseServer

_OTHER_LEADER = """
import sys, time
from ftlaunch.lighthouse.client import LighthouseClient
from ftlaunch.lighthouse.quorum import QuorumMember
c = LighthouseClient(sys.argv[1], connect_timeout=5.0)
c.start_heartbeat("rg1", 0.1)
q = c.quorum(QuorumMember("rg1", step=1), 20.0)
print("quorum", q.quorum_id, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(25)
def test_a_sigstopped_leader_is_declared_lost_while_a_peer_reports_being_blocked() -> None:
    server = LighthouseServer(
        "127.0.0.1:0", min_replicas=2, heartbeat_timeout=30.0, join_timeout=20.0
    ).start()
    client = LighthouseClient(server.address, connect_timeout=5.0)
    other = subprocess.Popen(
        [sys.executable, "-c", _OTHER_LEADER, server.address], stdout=subprocess.PIPE, text=True
    )
    try:
        blocked_since: list[float] = []
        lost: list[tuple[int, tuple[str, ...]]] = []
        client.on_quorum_lost(lambda _rid, qid, ids: lost.append((qid, ids)))
        got: list[Quorum] = []
        client.report_blocked(
            lambda: (got[0].quorum_id, time.monotonic() - blocked_since[0]) if blocked_since else None
        )
        client.start_heartbeat("rg0", 0.1)
        got.append(client.quorum(QuorumMember("rg0", step=1), 20.0))
        assert other.stdout is not None
        assert other.stdout.readline().split() == ["quorum", str(got[0].quorum_id)]
        time.sleep(0.5)  # both beat
        assert not lost
        other.send_signal(signal.SIGSTOP)  # alive, sockets open, silent
        blocked_since.append(time.monotonic())  # our step now waits for it in a collective
        deadline = time.monotonic() + 15
        while not any("rg1" in ids for _, ids in lost) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (got[0].quorum_id, ("rg1",)) in lost  # well before the 30 s heartbeat timeout
        hung = [h for h in server.snapshot().history if h.replica_id == "rg1" and h.event == "failed"]
        assert hung and hung[0].detail.startswith("hung: no heartbeat"), hung
        blocked_since.clear()
        other.send_signal(signal.SIGCONT)  # it wakes: its next heartbeat revives it
        deadline = time.monotonic() + 10
        while server.snapshot().live_count < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.snapshot().live_count == 2
    finally:
        _end(other, client, server)


def _end(other: subprocess.Popen, client: LighthouseClient, server: LighthouseServer) -> None:
    """End the other leader (woken first: the test may have left it stopped), then this test's
    client and lighthouse."""
    other.send_signal(signal.SIGCONT)
    other.kill()
    other.wait(10)
    if other.stdout is not None:
        other.stdout.close()
    client.close()
    server.shutdown()


_BEATING_LEADER = """
import sys, time
from ftlaunch.lighthouse.client import LighthouseClient
c = LighthouseClient(sys.argv[1], connect_timeout=5.0)
c.start_heartbeat("rg1", 0.1)
print("beating", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(25)
@pytest.mark.parametrize("via", ["request", "heartbeat"])
def test_a_restarted_lighthouse_declares_a_sigstopped_member_of_the_adopted_quorum_lost(via: str) -> None:
    """The lighthouse restarted (it never formed a quorum); rg0 and rg1 step on their last quorum
    OLD through the outage. rg1 reconnected (its heartbeats reach the new lighthouse); rg0's resume
    report (OLD: rg0, rg1) reached it on a quorum request that timed out (a group stepping through an
    outage waits a second for an answer), or on its heartbeats (`LighthouseClient.report_resume`: no
    request at all). Then rg1 is SIGSTOPped while rg0 reports being blocked on OLD: rg0 is told
    ``lost`` on OLD well before the 30 s heartbeat timeout."""
    old_id = 1_699_000_000_000 << 20
    server = LighthouseServer(
        "127.0.0.1:0", min_replicas=1, heartbeat_timeout=30.0, join_timeout=20.0
    ).start()
    client = LighthouseClient(server.address, connect_timeout=5.0)
    other = subprocess.Popen(
        [sys.executable, "-c", _BEATING_LEADER, server.address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "beating"
        lost: list[tuple[int, tuple[str, ...]]] = []
        client.on_quorum_lost(lambda _rid, qid, ids: lost.append((qid, ids)))
        blocked_since: list[float] = []
        client.report_blocked(
            lambda: (old_id, time.monotonic() - blocked_since[0]) if blocked_since else None
        )
        report = resume_report(Quorum(old_id, (QuorumMember("rg0"), QuorumMember("rg1")), created=0.0))
        if via == "heartbeat":
            client.report_resume(lambda: report)
        client.start_heartbeat("rg0", 0.1)
        if via == "request":
            with pytest.raises(QuorumTimeoutError):  # rg1 does not ask: it steps on OLD
                client.quorum(QuorumMember("rg0", step=40, data={RESUME_KEY: report}), 1.0)
        deadline = time.monotonic() + 10
        while "resumed" not in [h.event for h in server.snapshot().history] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "resumed" in [h.event for h in server.snapshot().history]
        time.sleep(0.3)  # rg1 beats on
        beats = {g.replica_id: g.heartbeats for g in server.snapshot().groups}
        assert beats["rg1"] >= 2, beats  # it reached the new lighthouse
        other.send_signal(signal.SIGSTOP)
        blocked_since.append(time.monotonic())  # rg0's step now waits for it in OLD's collective
        deadline = time.monotonic() + 15
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost and lost[0] == (old_id, ("rg1",)), lost
        hung = [h for h in server.snapshot().history if h.replica_id == "rg1" and h.event == "failed"]
        assert hung and hung[0].detail.startswith("hung: no heartbeat"), hung
    finally:
        _end(other, client, server)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_training_goes_on_without_a_sigstopped_group_which_rejoins_when_it_wakes() -> None:
    """scripts/train_ddp.py, 2 groups; rg0 SIGSTOPped for 6 s at step 40. The lighthouse declares it
    hung (not silent: that would take the 5 s heartbeat timeout), rg1 commits steps while rg0 is
    still stopped, rg0 is told ``superseded`` when it wakes, heals, and both end bit-identical."""
    res = run(
        [*FTLAUNCH, "--replicas", "2", "--chaos", "steps=40,group=0,signal=STOP,stop_for=6",
         "scripts/train_ddp.py", "--steps", "150", "--step-sleep", "0.05"],
        timeout=190,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "2/2 groups ended bit-identical" in res.stdout, out[-4000:]
    assert re.search(r"lighthouse: replica rg0 failed: hung: no heartbeat", out), out[-4000:]
    assert re.search(r"was superseded by quorum \d+", out), out[-4000:]
    # rg1 committed steps alone while rg0 was stopped (participants=1).
    assert re.search(r"\[rg1/r0\][^\n]*committed=True participants=1", out), out[-4000:]
