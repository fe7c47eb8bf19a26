"""A replica group of two nodes restarts and rejoins: every rank agrees on the group's incarnation.

torchelastic's restart count goes up only on the node whose worker failed; the other node follows
the new rendezvous round without counting it. A group store keyed by that count put the two nodes'
ranks under different prefixes after a restart, each waiting for the other for ever (rank 0 for the
transport metadata, rank 1 for the quorum). The rendezvous now counts the group's rounds in the
group's own rendezvous store and every worker of a round gets the same count.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from workers.helpers import REPO, free_port, kill_tree

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TRAIN = os.path.join(REPO, "scripts", "train_ddp.py")
#: Long enough (0.3 s a step) for group 0 to be still training when group 1 is back on a loaded machine.
STEPS = 120


def _worker(group: int, rank: int) -> psutil.Process | None:
    """The training process of ``group``'s rank ``rank`` (not its torchrun agent)."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if not any(c.endswith("train_ddp.py") for c in cmd) or "torch.distributed.run" in cmd:
                continue
            e = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if e.get("REPLICA_GROUP_ID") == str(group) and e.get("RANK") == str(rank):
            return p
    return None


def _committed_steps(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"step=(\d+) committed=True", text)]


@pytest.mark.timeout(240)
def test_a_two_node_group_restarts_and_rejoins(tmp_path: Path) -> None:
    lighthouse_port, group_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{lighthouse_port}"
    env = {**os.environ, "FTLAUNCH_TOKEN": "tok", "LOGLEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    common = ["--rdzv-backend", "ftlaunch", "--rdzv-endpoint", endpoint, "--rdzv-id", "mn"]
    common += ["--max-restarts", "2", "--monitor-interval", "0.1"]
    script = [TRAIN, "--steps", str(STEPS), "--width", "32", "--step-sleep", "0.3", "--timeout", "30"]
    logs = [tmp_path / name for name in ("g0.log", "g1a.log", "g1b.log")]
    conf0 = "replica_group_id=0,num_replica_groups=2,start_lighthouse=false"
    conf1 = (
        "replica_group_id=1,num_replica_groups=2,start_lighthouse=false,"
        f"group_endpoint=127.0.0.1:{group_port}"
    )
    # Both groups have two workers (rank r of each group shares a shard): group 0 on one node,
    # group 1 on two nodes of one worker each.
    one_node = ["--nproc-per-node", "2", "--rdzv-conf", conf0]
    two_nodes = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-conf", conf1]
    commands = [[*TORCHRUN, *common, *one_node, *script]] + [[*TORCHRUN, *common, *two_nodes, *script]] * 2
    lighthouse = [sys.executable, "-m", "ftlaunch.lighthouse", "--bind", endpoint, "--expected-replicas", "2"]
    procs: list[subprocess.Popen[bytes]] = []
    keeper = subprocess.Popen([*lighthouse, "--token", "tok"], env=env, stdout=subprocess.DEVNULL)
    try:
        for cmd, log in zip(commands, logs, strict=True):
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 150
        # Group 1 trains (both nodes), then its rank 1 -- on the node that is not the group's rank 0
        # -- is SIGKILLed: that node's agent restarts (restart count 1), the other follows (0).
        victim = None
        while victim is None:
            assert time.monotonic() < deadline, "group 1 never trained: " + logs[1].read_text()[-3000:]
            text = logs[1].read_text() + logs[2].read_text()
            if len(_committed_steps(text)) >= 6:
                victim = _worker(1, 1)
            time.sleep(0.2)
        killed_at = time.time()
        victim.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in [*procs, keeper]:
            if p.poll() is None:
                kill_tree(p.pid)
    texts = [log.read_text() for log in logs]
    for p, text in zip(procs, texts, strict=True):
        assert p.returncode == 0, text[-4000:]
    # Every worker ended at the same step with the same weights: the restarted group healed.
    finals = [f for t in texts for f in re.findall(r"final_checksum=(\w+) step=(\d+)", t)]
    assert len(finals) == 4 and len(set(finals)) == 1 and finals[0][1] == str(STEPS), finals
    # ... and committed steps again after the kill, on both of its nodes (no deadlock).
    for text in texts[1:]:
        after = [float(t) for t in re.findall(r"committed=True .* t=([\d.]+)", text) if float(t) > killed_at]
        assert after, text[-3000:]
