"""Hot spares with real processes: ``ftlaunch --replicas N --spares K`` running scripts/train_ddp.py,
groups killed (SIGKILL), hung (SIGSTOP), a spare killed while idle, a promoted spare killed in its
first step. Every run must end with the training groups bit-identical and at the exact data
positions of their slot (the sampler position heals with the weights). The unit rules are in
tests/unit/test_spares.py.

Agents are the supervisor's groups 0..N+K-1 (their lines are tagged ``[rgA/r0]``); the slot a
group trains in is the lighthouse's decision, read back from the workers' own lines.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from workers.helpers import FTLAUNCH, REPO, kill_tree

from ftlaunch.worker.data import DistributedSampler

TRAIN = "scripts/train_ddp.py"
TOKEN = "spares-test-token"
DATASET, BATCH = 4096, 32
STEP = re.compile(r"^\[rg(\d+)/r0\] step=(\d+) committed=True .*?data=(\d+):(\d+) first=(\d+)")
CHECKSUM = re.compile(r"^\[rg(\d+)/r0\] final_checksum=(\w+)")
TOOK_OVER = re.compile(
    r"^\[rg(\d+)/r0\] .*\[(g\d+\.\d+)\] took over replica group (\d+) .*\(as (\S+), replacing (\S+)\)"
)


class Job:
    """``ftlaunch`` in the background; its lines (stdout and stderr) collected as they arrive."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [*FTLAUNCH, "--no-status", "--token", TOKEN, *args], cwd=REPO, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern, re.M)
        while time.monotonic() < deadline:
            m = rx.search(self.text())
            if m is not None:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout}s:\n{self.text()[-6000:]}")

    def workers(self, agent: int) -> list[psutil.Process]:
        """Agent ``agent``'s training processes (children of its agent, running the script)."""
        found = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                cmd, parent = " ".join(p.cmdline()), p.parent()
                if TRAIN in cmd and parent is not None and f"/rg{agent}/agent" in " ".join(parent.cmdline()):
                    found.append(p)
            except psutil.Error:
                continue
        return found

    def signal_workers(self, agent: int, sig: int) -> list[int]:
        procs = self.workers(agent)
        assert procs, f"agent {agent} has no workers"
        for p in procs:
            p.send_signal(sig)
        return [p.pid for p in procs]

    def finish(self, timeout: float) -> str:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
            raise AssertionError(
                f"ftlaunch did not finish within {timeout}s:\n{self.text()[-8000:]}"
            ) from None
        finally:
            self._reader.join(timeout=10)
        assert self.proc.returncode == 0, self.text()[-8000:]
        return self.text()

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait()


@pytest.fixture
def jobs():
    started: list[Job] = []

    def start(args: list[str]) -> Job:
        job = Job(args)
        started.append(job)
        return job

    yield start
    for job in started:
        job.close()


def train(steps: int, *extra: str) -> list[str]:
    """train_ddp.py with the fixed shards, whose positions `check_data` follows slot by slot (the
    exactly-once sampler with spares: tests/processes/test_exactly_once_mp.py)."""
    return [
        TRAIN,
        "--steps",
        str(steps),
        "--width",
        "64",
        "--step-sleep",
        "0.05",
        "--sampler",
        "shard",
        *extra,
    ]


def takeovers(text: str) -> list[tuple[int, str, int, str, str]]:
    """(agent, claimant, slot, new lighthouse name, replaced name) per takeover, in order."""
    return [
        (int(m[1]), m[2], int(m[3]), m[4], m[5])
        for m in (TOOK_OVER.match(line) for line in text.splitlines())
        if m
    ]


def checksums(text: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in (CHECKSUM.match(line) for line in text.splitlines()) if m}


def check_data(text: str, replicas: int) -> None:
    """Every committed step of a training group read the shard of the slot it held then (agents
    0..N-1 start in their own; a "took over" line moves one) at exactly the position of every other
    group at that step. A group's first step after it healed read its batch before the position
    arrived (its gradient is zeroed), so that step's batch is not checked."""
    shards = {
        s: DistributedSampler(
            range(DATASET), replica_group_id=s, num_replica_groups=replicas, rank=0, num_replicas=1
        )
        for s in range(replicas)
    }
    slot_of = {a: a for a in range(replicas)}
    # The slot each agent held last: a killed group's last step lines may reach the output after
    # the spare's "took over" line (the pipes of two agents are read apart; a SIGKILL sent to a
    # forked worker's proxy lands a moment later): they are steps it committed in its old slot.
    held = dict(slot_of)
    position: dict[int, tuple[int, int]] = {}
    last: dict[int, int] = {}
    checked = 0
    for line in text.splitlines():
        took = TOOK_OVER.match(line)
        if took is not None:
            agent, slot = int(took[1]), int(took[3])
            slot_of = {a: s for a, s in slot_of.items() if s != slot}
            slot_of[agent] = held[agent] = slot
            continue
        m = STEP.match(line)
        if m is None:
            continue
        agent, step, epoch, pos, first = map(int, m.groups())
        healed_now = step > last.get(agent, 0) + 1
        last[agent] = step
        assert position.setdefault(step, (epoch, pos)) == (epoch, pos), (line, position[step])
        if not healed_now and step > 1:
            assert agent in held, line
            start = (pos - 1) // BATCH * BATCH  # an epoch's last batch may be short
            assert shards[held[agent]].shard_indices(epoch)[start] == first, (line, slot_of)
            checked += 1
    assert checked >= 10, f"only {checked} steps checked"


def final_slots(text: str, replicas: int) -> dict[int, int]:
    """Agent -> the slot it trained in last (agents 0..N-1 start in their own; takeovers move them)."""
    slots = {a: a for a in range(replicas)}
    for agent, _claimant, slot, _new, _old in takeovers(text):
        for other, s in list(slots.items()):
            if s == slot:
                del slots[other]
        slots[agent] = slot
    return slots


def assert_bit_identical(text: str, slots: dict[int, int]) -> None:
    sums = checksums(text)
    assert set(slots) <= set(sums), (slots, sums)
    assert len({sums[a] for a in slots}) == 1, sums


@pytest.mark.timeout(240)
def test_a_spare_replaces_a_killed_group_bit_identical(jobs) -> None:
    job = jobs(["--replicas", "2", "--spares", "1", "--chaos", "steps=8,group=1", *train(40)])
    text = job.finish(220)
    assert "2 replica group(s) + 1 hot spare(s)" in text
    assert takeovers(text)[0] == (2, "g2.0", 1, "rg1.1", "rg1"), takeovers(text)
    # The killed group, restarted by its agent, came back as a spare and went home at the end.
    assert re.search(r"^\[rg1/r0\] .*the job finished while g1\.\d waited as a spare", text, re.M), text[
        -4000:
    ]
    slots = final_slots(text, 2)
    assert slots == {0: 0, 2: 1}
    assert_bit_identical(text, slots)
    check_data(text, 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_spare_replaces_a_hung_group_which_is_fenced_when_it_wakes(jobs) -> None:
    job = jobs(["--replicas", "2", "--spares", "1", "--heartbeat-timeout", "1",
                "--chaos", "steps=8,group=1,signal=STOP,stop_for=6", *train(60, "--timeout",
                                                                            "3")])  # fmt: skip
    text = job.finish(280)
    assert takeovers(text)[0] == (2, "g2.0", 1, "rg1.1", "rg1"), takeovers(text)
    assert re.search(r"^\[rg1/r0\] .*HTTP 410: replica rg1 was replaced", text, re.M), text[-4000:]
    slots = final_slots(text, 2)
    assert_bit_identical(text, slots)
    check_data(text, 2)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_failures_one_spare_the_second_group_restarts_and_rejoins(jobs) -> None:
    job = jobs(["--replicas", "3", "--spares", "1", *train(400)])  # long enough for the restarts
    job.wait_for(r"^\[rg0/r0\] step=10 committed=True", 200)
    for agent in (1, 2):
        job.signal_workers(agent, signal.SIGKILL)
    text = job.finish(380)
    moves = takeovers(text)
    # The spare takes the slot whose death the lighthouse noticed first; the other one waits for a
    # restarted group (no spare left): restart-and-rejoin, under the slot's next name.
    first = moves[0]
    assert (
        first[:2] == (3, "g3.0") and first[2] in (1, 2) and first[3:] == (f"rg{first[2]}.1", f"rg{first[2]}")
    ), moves
    other = 3 - first[2]
    back = [m for m in moves if m[2] == other]
    assert back and back[0][0] in (1, 2) and back[0][3:] == (f"rg{other}.1", f"rg{other}"), moves
    slots = final_slots(text, 3)
    assert sorted(slots.values()) == [0, 1, 2]
    assert_bit_identical(text, slots)
    check_data(text, 3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_spare_killed_while_idle_is_replaced_and_nothing_else_moves(jobs) -> None:
    from ftlaunch.lighthouse.client import LighthouseClient

    job = jobs(["--replicas", "2", "--spares", "1", *train(400)])
    address = job.wait_for(r"lighthouse (http://\S+),", 60)[1]
    job.wait_for(r"^\[rg0/r0\] step=5 committed=True", 200)
    with LighthouseClient(address, token=TOKEN) as client:
        before = client.snapshot()
        assert before.spares is not None and [w.claimant for w in before.spares.waiting] == ["g2.0"]
        killed_at = len(job.lines)
        job.signal_workers(2, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            now = client.snapshot()
            assert now.spares is not None
            if [w.claimant for w in now.spares.waiting] == ["g2.1"]:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the spare was not replaced: {now.spares}")
        assert now.quorum_id == before.quorum_id and now.spares.promotions == 0
    text = job.finish(250)
    after = "\n".join(job.lines[killed_at:])
    assert not re.search(r"^\[rg[01]/r0\] step=\d+ committed=False", after, re.M)  # nobody missed a step
    assert not re.search(r"^\[rg[01]/r0\] .*reconfiguring", after, re.M)
    assert takeovers(text) == []
    assert_bit_identical(text, {0: 0, 1: 1})


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_promoted_spare_that_dies_in_its_first_step_hands_the_slot_on(jobs) -> None:
    job = jobs(["--replicas", "2", "--spares", "1", "--chaos", "steps=8,group=1", *train(400)])
    job.wait_for(r"^\[rg2/r0\] .*took over replica group 1", 200)
    job.signal_workers(2, signal.SIGKILL)  # before (or during) its first step
    text = job.finish(380)
    moves = takeovers(text)
    assert moves[0][:4] == (2, "g2.0", 1, "rg1.1"), moves
    assert any(m[2] == 1 and m[3] == "rg1.2" and m[4] == "rg1.1" for m in moves[1:]), moves
    slots = final_slots(text, 2)
    assert slots[0] == 0 and 1 in slots.values()
    assert_bit_identical(text, slots)
    check_data(text, 2)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_spare_replaces_a_group_hung_mid_step_before_the_collective_timeout(jobs) -> None:
    """The group is SIGSTOPped inside a step (no sleep between steps: the signal lands while its peer
    waits for it in a collective) and the collective timeout is 600 s, above this test's own: the
    survivor learns from its heartbeat answers that the group is lost and aborts its step, so the
    spare takes the slot and commits while the group is still stopped. Without that abort the
    survivor and so the spare would wait for the SIGCONT (stop_for=60): the hung group would wake,
    get its 410 and only then would the spare step."""
    job = jobs(["--replicas", "2", "--spares", "1", "--heartbeat-timeout", "2",
                "--chaos", "steps=8,group=1,signal=STOP,stop_for=60",
                *train(80, "--timeout", "600", "--step-sleep", "0")])  # fmt: skip
    text = job.finish(280)
    lines = text.splitlines()
    stop = next(i for i, line in enumerate(lines) if "[ftlaunch] chaos: SIGSTOP" in line)
    spare = [
        i
        for i, line in enumerate(lines)
        if i > stop and re.match(r"^\[rg2/r0\] step=\d+ committed=True", line)
    ]
    woke = [
        i
        for i, line in enumerate(lines)
        if re.match(r"^\[rg1/r0\] .*HTTP 410: replica rg1 was replaced", line)
    ]
    assert spare and woke, text[-4000:]
    assert spare[0] < woke[0], "the spare stepped only after the hung group woke up"
    assert takeovers(text)[0] == (2, "g2.0", 1, "rg1.1", "rg1"), takeovers(text)
    slots = final_slots(text, 2)
    assert_bit_identical(text, slots)
    # Stopped after its commit vote went out, the hung group may print that step (committed with the
    # survivor before the takeover) only when it wakes, after the takeover line: not a step in a slot
    # it no longer holds.
    late = {i for i, line in enumerate(lines) if stop < i < woke[0] and line.startswith("[rg1/r0] step=")}
    check_data("\n".join(line for i, line in enumerate(lines) if i not in late), 2)
