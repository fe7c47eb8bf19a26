"""Split-brain guard end to end: replica groups in real processes, stepping like Managers do.

Each member process beats every 0.1 s on its own connection and asks for one quorum per step from
another thread, like `ftlaunch.worker.manager.Manager`'s group leader. The invariant under test: while
two groups are alive and beating, neither gets a quorum without the other (two quorums that exist
at the same time always share a member), even when the processes are frozen for a few ms at a time
and the CPU is oversubscribed. A group frozen for longer than ``heartbeat_timeout`` or killed is
gone, and only then may the other form a quorum alone.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from ftlaunch.lighthouse import LighthouseClient, LighthouseServer, QuorumMember

CTX = mp.get_context("spawn")
HB_INTERVAL = 0.1
STEP_SLEEP = 0.1


# ---------------------------------------------------------------------------------- child processes


def _stepper_main(addr: str, rid: str, stop: mp.Event, out: mp.Queue) -> None:
    """A group leader: heartbeat thread + one quorum per step (from a worker thread) until ``stop``."""
    client = LighthouseClient(addr, connect_timeout=10.0)
    client.start_heartbeat(rid, HB_INTERVAL)
    out.put((rid, "ready", os.getpid()))
    step = 0
    result: list = []

    def ask() -> None:
        try:
            result.append(client.quorum(QuorumMember(rid, step=step), timeout=30.0))
        except Exception as e:  # reported to the test, which fails on it
            result.append(e)

    while not stop.is_set():
        result.clear()
        asked = time.monotonic()
        t = threading.Thread(target=ask, name=f"quorum-{rid}")
        t.start()
        t.join()
        q = result[0]
        if isinstance(q, Exception):
            out.put((rid, "error", repr(q)))
            return
        out.put((rid, step, q.quorum_id, q.replica_ids, asked, time.monotonic()))
        step += 1
        time.sleep(STEP_SLEEP)
    client.leave(rid)
    client.close()
    out.put((rid, "done", step))


def _burn(stop: mp.Event) -> None:
    """Oversubscribe the CPU (the incident happened at load ~10 on 2 cores)."""
    x = 0
    while not stop.is_set():
        for _ in range(20_000):
            x += 1


def _reap(procs: list[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
        p.join(10)


@pytest.fixture
def procs() -> Iterator[list[mp.Process]]:
    started: list[mp.Process] = []
    yield started
    _reap(started)


@pytest.fixture
def make_server() -> Iterator[Callable[..., LighthouseServer]]:
    servers: list[LighthouseServer] = []

    def make(**kwargs) -> LighthouseServer:
        s = LighthouseServer("127.0.0.1:0", **kwargs).start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.shutdown()


# ---------------------------------------------------------------------------------- helpers


class _Results:
    """Everything the members reported, in arrival order."""

    def __init__(self) -> None:
        self.queues: list[mp.Queue] = []
        self.quorums: dict[str, list[tuple]] = {}
        self.ready: dict[str, int] = {}

    def pump(self, until: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; got {self.quorums}")
            got = False
            for q in self.queues:
                try:
                    msg = q.get_nowait()
                except queue.Empty:
                    continue
                got = True
                rid, kind = msg[0], msg[1]
                if kind == "error":
                    raise AssertionError(f"{rid}: quorum failed: {msg[2]}")
                if kind == "ready":
                    self.ready[rid] = msg[2]
                elif kind != "done":
                    self.quorums.setdefault(rid, []).append(msg)
            if not got:
                time.sleep(0.01)

    def count(self, rid: str) -> int:
        return len(self.quorums.get(rid, []))


class _Member:
    """One member process with its own report queue: a queue's write lock is shared by its
    writers, and a writer SIGSTOPped while holding it would silence the others."""

    def __init__(self, addr: str, rid: str, res: _Results) -> None:
        self.rid = rid
        self.stop = CTX.Event()
        out: mp.Queue = CTX.Queue()
        res.queues.append(out)
        self.proc = CTX.Process(target=_stepper_main, args=(addr, rid, self.stop, out), daemon=True)
        self.proc.start()


def _health(server: LighthouseServer, rid: str) -> str | None:
    g = next((g for g in server.status()["groups"] if g["replica_id"] == rid), None)
    return None if g is None else g["health"]


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


# ---------------------------------------------------------------------------------- tests


@pytest.mark.timeout(120)
def test_joiner_never_gets_a_quorum_without_a_live_stepping_group(make_server, procs):
    """The incident's setup (A steps alone, B joins) under CPU load and millisecond freezes of A.

    Every quorum B gets must contain A, and every quorum A gets once B has one must contain B:
    both are alive and beating throughout (freezes stay far below heartbeat_timeout).
    """
    server = make_server(min_replicas=1, join_timeout=5.0, heartbeat_timeout=5.0, quorum_tick=0.05)
    res = _Results()
    burn_stop = CTX.Event()
    burners = [CTX.Process(target=_burn, args=(burn_stop,), daemon=True) for _ in range(4)]
    procs.extend(burners)
    for b in burners:
        b.start()
    a = _Member(server.address, "rgA", res)
    procs.append(a.proc)
    res.pump(lambda: res.count("rgA") >= 3, 60, "A's first quorums")

    freezing = threading.Event()
    freezing.set()
    rng = random.Random(1234)

    def freeze_a() -> None:
        # SIGSTOP A for 5..60 ms at random moments: its heartbeats and requests arrive late and
        # bunched, its parked request sits unread, like a process starved by the scheduler.
        while freezing.is_set():
            try:
                os.kill(a.proc.pid, signal.SIGSTOP)
                time.sleep(rng.uniform(0.005, 0.06))
            finally:
                os.kill(a.proc.pid, signal.SIGCONT)
            time.sleep(rng.uniform(0.0, 0.05))

    freezer = threading.Thread(target=freeze_a, daemon=True)
    freezer.start()
    try:
        b = _Member(server.address, "rgB", res)
        procs.append(b.proc)
        res.pump(lambda: res.count("rgB") >= 15, 90, "B's quorums")
    finally:
        freezing.clear()
        freezer.join(5)
        burn_stop.set()
    a.stop.set()
    b.stop.set()
    a.proc.join(30)
    b.proc.join(30)
    assert a.proc.exitcode == 0 and b.proc.exitcode == 0

    assert res.quorums["rgB"], "B never got a quorum"
    for _, step, qid, members, *_ in res.quorums["rgB"]:
        assert "rgA" in members, f"B got quorum {qid} without the live group A at its step {step}: {members}"
    first_b = res.quorums["rgB"][0][2]
    for _, _step, qid, members, *_ in res.quorums["rgA"]:
        if qid >= first_b:
            assert "rgB" in members, (
                f"A got quorum {qid} without B after B's first quorum {first_b}: {members}"
            )
    # One id, one membership: both groups saw the same participants under every shared id.
    seen: dict[int, tuple] = {}
    for rid in ("rgA", "rgB"):
        for _, _, qid, members, *_ in res.quorums[rid]:
            assert seen.setdefault(qid, members) == members, f"quorum {qid}: {seen[qid]} vs {members}"


@pytest.mark.timeout(120)
def test_frozen_group_blocks_others_until_it_goes_silent(make_server, procs):
    """A SIGSTOPped mid-run (alive but frozen): B must wait until A is declared silent.

    After SIGCONT, A (revived, maybe with a request still parked) joins B's quorums, never forms
    one of its own.
    """
    server = make_server(min_replicas=1, join_timeout=1.0, heartbeat_timeout=2.0, quorum_tick=0.05)
    res = _Results()
    a = _Member(server.address, "rgA", res)
    procs.append(a.proc)
    res.pump(lambda: res.count("rgA") >= 3, 60, "A's first quorums")
    os.kill(a.proc.pid, signal.SIGSTOP)  # parked, sleeping or mid-request: all must hold
    try:
        b = _Member(server.address, "rgB", res)
        procs.append(b.proc)
        res.pump(lambda: res.count("rgB") >= 1, 60, "B's first quorum")
        assert _health(server, "rgA") == "silent"
        history = server.status()["history"][::-1]  # oldest first
        silent_at = next(
            i for i, h in enumerate(history) if h["event"] == "silent" and h["replica_id"] == "rgA"
        )
        b_alone = next(
            i for i, h in enumerate(history) if h["event"] == "quorum" and h["participants"] == ["rgB"]
        )
        assert silent_at < b_alone, history
        assert res.quorums["rgB"][0][3] == ("rgB",)
        a_before = res.count("rgA")
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    # A wakes up with its old request still parked: it must be answered with a quorum shared with B.
    res.pump(lambda: res.count("rgA") > a_before + 2, 60, "A's quorums after SIGCONT")
    for _, step, qid, members, *_ in res.quorums["rgA"][a_before:]:
        assert members == ("rgA", "rgB"), f"A's quorum {qid} at step {step} after SIGCONT: {members}"
    a.stop.set()
    b.stop.set()
    a.proc.join(30)
    b.proc.join(30)
    assert a.proc.exitcode == 0 and b.proc.exitcode == 0


@pytest.mark.timeout(120)
def test_killed_group_is_replaced_by_a_new_incarnation(make_server, procs):
    """The incident as it really was: A is SIGKILLed mid-run, B joins, A is restarted.

    B may form a quorum alone at once (A is dead, not merely slow); the restarted A (a new process
    under the same replica id) joins B's quorum under a new id.
    """
    server = make_server(min_replicas=1, join_timeout=5.0, heartbeat_timeout=5.0, quorum_tick=0.05)
    res = _Results()
    a = _Member(server.address, "rgA", res)
    procs.append(a.proc)
    res.pump(lambda: res.count("rgA") >= 3, 60, "A's first quorums")
    os.kill(a.proc.pid, signal.SIGKILL)
    a.proc.join(10)
    _wait(lambda: _health(server, "rgA") == "disconnected", 10, "A disconnected")
    b = _Member(server.address, "rgB", res)
    procs.append(b.proc)
    res.pump(lambda: res.count("rgB") >= 2, 60, "B's quorums")
    assert res.quorums["rgB"][0][3] == ("rgB",)
    last_a = res.quorums["rgA"][-1][2]
    a2 = _Member(server.address, "rgA", res)
    procs.append(a2.proc)
    before = res.count("rgA")
    res.pump(lambda: res.count("rgA") > before, 60, "the restarted A's first quorum")
    _, _, qid, members, *_ = res.quorums["rgA"][before]
    assert members == ("rgA", "rgB") and qid > last_a
    a2.stop.set()
    b.stop.set()
    a2.proc.join(30)
    b.proc.join(30)
    assert a2.proc.exitcode == 0 and b.proc.exitcode == 0
