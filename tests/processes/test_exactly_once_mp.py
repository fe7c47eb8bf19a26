"""Every sample exactly once per epoch, with real processes: ``ftlaunch`` runs scripts/train_ddp.py
``--print-ids`` (each worker prints the ``epoch:index`` of the samples every committed step of its
group trained) while the test kills, hangs and adds groups; the ids of the committed steps' batches
are then exactly the dataset, once per epoch. The fixed shards (``--sampler shard``) lose the
samples of a group that is down, and of every step that does not commit.

Faults are sent right after the victim printed a step (the workers sleep between steps), so a killed
worker never dies between its step's commit and the line that reports it.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections import Counter

import pytest
from test_spares_mp import TOKEN, Job
from workers.helpers import finish, kill_tree, start

from ftlaunch import env

TRAIN = "scripts/train_ddp.py"
STEP = re.compile(
    r"^(?:\[rg(\d+)/r(\d+)\] )?step=(\d+) committed=True participants=(\d+) .*? ids=(\S+)$", re.M
)


def trained(text: str) -> Counter[tuple[int, int]]:
    """(epoch, index) of every sample a committed step trained, with how often."""
    out: Counter[tuple[int, int]] = Counter()
    for m in STEP.finditer(text):
        if m[5] != "-":
            out.update(tuple(map(int, s.split(":"))) for s in m[5].split(","))  # type: ignore[misc]
    return out


def epoch_counts(samples: Counter[tuple[int, int]], epoch: int) -> Counter[int]:
    return Counter({i: n for (e, i), n in samples.items() if e == epoch})


def args(size: int, epochs: int, *extra: str) -> list[str]:
    return [TRAIN, "--dataset-size", str(size), "--batch-size", "4", "--epochs", str(epochs), "--width", "32",
            "--step-sleep", "0.25", "--print-ids", *extra]  # fmt: skip


@pytest.fixture
def jobs():
    started: list[Job] = []

    def start_job(cli: list[str]) -> Job:
        job = Job(cli)
        started.append(job)
        return job

    yield start_job
    for job in started:
        job.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["exact", "shard"])
def test_a_killed_group_loses_no_sample_and_the_fixed_shards_lose_its_share(jobs, mode: str) -> None:
    """Two groups of two workers; group 1 is killed mid-epoch, restarted by its agent, heals."""
    size = 256
    job = jobs(["--replicas", "2", "--nproc-per-node", "2", *args(size, 2, "--sampler", mode)])
    job.wait_for(r"^\[rg1/r1\] step=6 committed=True", 200)
    job.signal_workers(1, signal.SIGKILL)
    text = job.finish(250)
    samples = trained(text)
    back = [m for m in STEP.finditer(text) if m[1] == "1" and int(m[3]) > 8 and m[5] != "-"]
    assert back, "the restarted group never trained again:\n" + text[-4000:]
    alone = [m for m in STEP.finditer(text) if m[1] == "0" and m[4] == "1" and int(m[3]) > 6]
    assert alone, "group 0 never stepped alone while group 1 was down"
    for epoch in (0, 1):
        counts = epoch_counts(samples, epoch)
        assert all(n == 1 for n in counts.values()), {i: n for i, n in counts.items() if n > 1}
        if mode == "exact":
            assert set(counts) == set(range(size)), sorted(set(range(size)) - set(counts))
    if mode == "shard":  # the killed group's shard, while it was down, is not trained
        skipped = size - len(epoch_counts(samples, 0))
        assert skipped >= 4 * 2 * len(alone[:1]), skipped


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kills_a_hang_a_spare_and_an_added_group_lose_no_sample(jobs) -> None:
    """Two groups and a hot spare. Group 1 is killed (the spare takes its slot; its agent restarts
    it as a spare), a third group joins by hand past the two the job started with, group 0 hangs
    (SIGSTOP: the restarted group takes its slot; group 0 wakes fenced and waits as a spare). Over
    three epochs every sample is trained exactly once per epoch."""
    size = 240
    job = jobs(["--replicas", "2", "--spares", "1", "--heartbeat-timeout", "2",
                *args(size, 3, "--timeout", "10")])  # fmt: skip
    address = job.wait_for(r"lighthouse (http://\S+),", 60)[1]
    job.wait_for(r"^\[rg1/r0\] step=4 committed=True", 200)
    job.signal_workers(1, signal.SIGKILL)
    job.wait_for(r"^\[rg2/r0\] .*took over replica group 1", 120)
    added_env = {
        k: v
        for k, v in os.environ.items()
        if k not in (env.RANK, env.WORLD_SIZE, env.MASTER_ADDR, env.MASTER_PORT)
    }
    added_env.update({
        env.REPLICA_GROUP_ID: "2", env.NUM_REPLICA_GROUPS: "3", env.FTLAUNCH_LIGHTHOUSE: address,
        env.FTLAUNCH_TOKEN: TOKEN,
    })  # fmt: skip
    added = start([sys.executable, *args(size, 3, "--timeout", "10")], env=added_env)
    try:
        job.wait_for(r"^\[rg1/r0\] .*waiting for a replica-group slot", 120)  # group 1 is back, a spare
        deadline = time.monotonic() + 120
        while "participants=3" not in job.text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "participants=3" in job.text(), "the added group never took part"
        n = len(re.findall(r"^\[rg0/r0\] step=\d+ committed=True", job.text(), re.M))
        job.wait_for(rf"^\[rg0/r0\] step={n + 1} committed=True", 60)
        stopped = job.signal_workers(0, signal.SIGSTOP)
        job.wait_for(r"^\[rg1/r0\] .*took over replica group 0", 120)
        time.sleep(3)
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        text = job.finish(500)
        out = finish(added, 200)
    finally:
        kill_tree(added.pid)
    assert out.returncode == 0, out.stderr[-4000:]
    samples = trained(text) + trained(out.stdout)
    assert re.search(r"HTTP 410: replica rg0 was replaced", text), text[-4000:]
    for epoch in range(3):
        counts = epoch_counts(samples, epoch)
        dup = {i: n for i, n in counts.items() if n > 1}
        assert not dup and set(counts) == set(range(size)), (
            epoch,
            dup,
            sorted(set(range(size)) - set(counts)),
        )
