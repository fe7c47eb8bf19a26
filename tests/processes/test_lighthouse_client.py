"""LighthouseClient against a real lighthouse, with client processes that get SIGKILLed/SIGSTOPped."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from ftlaunch.addresses import parse_host_port
from ftlaunch.errors import EvictedError, LighthouseUnavailableError, QuorumTimeoutError
from ftlaunch.lighthouse import LighthouseClient, LighthouseServer, QuorumMember

log = logging.getLogger(__name__)
CTX = mp.get_context("spawn")
TOKEN = "tok"


# ---------------------------------------------------------------------------------- child processes


def _member_main(addr: str, rid: str, mode: str, hb_interval: float, out: mp.Queue) -> None:
    """A replica group's leader: beats, optionally asks for quorums, then idles until killed."""
    logging.basicConfig(level=logging.INFO)
    client = LighthouseClient(addr, connect_timeout=5.0)
    client.start_heartbeat(rid, hb_interval)
    if mode == "rounds":
        for step in range(20):
            q = client.quorum(QuorumMember(rid, step=step), timeout=30.0)
            out.put((rid, step, q.quorum_id, q.replica_ids))
        client.leave(rid)
        client.close()
        return
    out.put((rid, "ready"))
    if mode == "longpoll":
        client.quorum(QuorumMember(rid), timeout=120.0)  # parked until the process is killed
    time.sleep(600)


def _start_member(
    addr: str, rid: str, mode: str = "idle", hb_interval: float = 0.1
) -> tuple[mp.Process, mp.Queue]:
    q: mp.Queue = CTX.Queue()
    p = CTX.Process(target=_member_main, args=(addr, rid, mode, hb_interval, q), daemon=True)
    p.start()
    return p, q


def _reap(*procs: mp.Process) -> None:
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
        p.join(10)


# ---------------------------------------------------------------------------------- helpers


@pytest.fixture
def make_server() -> Iterator[Callable[..., LighthouseServer]]:
    servers: list[LighthouseServer] = []

    def make(**kwargs) -> LighthouseServer:
        kwargs.setdefault("join_timeout", 60.0)
        kwargs.setdefault("heartbeat_timeout", 30.0)
        s = LighthouseServer(**kwargs).start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.shutdown()


def group(server: LighthouseServer, rid: str) -> dict:
    return next((g for g in server.status()["groups"] if g["replica_id"] == rid), {})


def health(server: LighthouseServer, rid: str) -> str | None:
    return group(server, rid).get("health")


def beating(server: LighthouseServer, rid: str) -> bool:
    """Live, with its heartbeat connection bound (so a kill is noticed by the closed socket)."""
    g = group(server, rid)
    return g.get("health") == "live" and g.get("connections", 0) >= 1


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)
    return time.monotonic() - start


# ---------------------------------------------------------------------------------- processes


@pytest.mark.timeout(90)
def test_two_processes_fast_quorum_rounds(make_server):
    s = make_server(min_replicas=2)
    procs = [_start_member(s.address, rid, "rounds") for rid in ("g0", "g1")]
    try:
        rows = [procs[0][1].get(timeout=60) for _ in range(20)] + [
            procs[1][1].get(timeout=60) for _ in range(20)
        ]
        for p, _ in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        _reap(*(p for p, _ in procs))
    assert all(r[3] == ("g0", "g1") for r in rows)
    assert len({r[2] for r in rows}) == 1, "the same two members keep one quorum id"
    events = [h["event"] for h in s.status()["history"]]
    assert "disconnected" not in events and events.count("left") == 2


@pytest.mark.timeout(90)
def test_sigkilled_member_is_gone_within_a_fraction_of_a_second(make_server):
    # heartbeat_timeout 30 s: only the closed connection can explain a fast detection.
    s = make_server(heartbeat_timeout=30.0, join_timeout=60.0)
    p, q = _start_member(s.address, "victim")
    try:
        assert q.get(timeout=60) == ("victim", "ready")
        wait_for(lambda: beating(s, "victim"), what="victim beating")
        client = LighthouseClient(s.address)
        client.heartbeat("survivor")
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        elapsed = wait_for(
            lambda: health(s, "victim") == "disconnected", timeout=3.0, what="victim disconnected"
        )
        log.info("SIGKILLed member noticed after %.1f ms", elapsed * 1000)
        print(f"\nSIGKILL -> disconnected after {elapsed * 1000:.1f} ms")
        # The survivor is not held up by the dead group (join_timeout is 60 s).
        assert client.quorum(QuorumMember("survivor"), timeout=10.0).replica_ids == ("survivor",)
        assert time.monotonic() - t0 < 10.0
        client.close()
    finally:
        _reap(p)


@pytest.mark.timeout(90)
def test_sigkill_while_parked_in_a_long_poll(make_server):
    s = make_server(min_replicas=2, heartbeat_timeout=30.0)
    p, q = _start_member(s.address, "victim", mode="longpoll")
    try:
        assert q.get(timeout=60) == ("victim", "ready")
        wait_for(lambda: s.status()["pending"] == ["victim"] and beating(s, "victim"), what="victim parked")
        os.kill(p.pid, signal.SIGKILL)
        elapsed = wait_for(
            lambda: health(s, "victim") == "disconnected", timeout=3.0, what="victim disconnected"
        )
        log.info("SIGKILLed parked member noticed after %.1f ms", elapsed * 1000)
        wait_for(lambda: s.status()["pending"] == [], what="parked request withdrawn")
    finally:
        _reap(p)


@pytest.mark.timeout(90)
def test_sigstopped_member_is_gone_after_heartbeat_timeout(make_server):
    s = make_server(heartbeat_timeout=1.0, join_timeout=60.0, quorum_tick=0.05)
    p, q = _start_member(s.address, "sleepy", hb_interval=0.1)
    try:
        assert q.get(timeout=60) == ("sleepy", "ready")
        wait_for(lambda: beating(s, "sleepy"), what="sleepy beating")
        client = LighthouseClient(s.address)
        client.start_heartbeat("awake", 0.1)  # a requester must keep beating while it waits
        wait_for(lambda: health(s, "awake") == "live", what="awake live")
        os.kill(p.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        # While stopped, the survivor's quorum waits for the straggler, then forms once it is silent.
        quorum = client.quorum(QuorumMember("awake"), timeout=20.0)
        waited = time.monotonic() - t0
        log.info("quorum without the stopped member after %.2f s (heartbeat_timeout 1 s)", waited)
        assert quorum.replica_ids == ("awake",)
        assert health(s, "sleepy") == "silent"  # connected but silent: not "disconnected"
        events = [(h["event"], h["replica_id"]) for h in s.status()["history"]]
        assert ("silent", "sleepy") in events and ("disconnected", "sleepy") not in events
        os.kill(p.pid, signal.SIGCONT)
        wait_for(lambda: health(s, "sleepy") == "live", what="sleepy revived after SIGCONT")
        client.close()
    finally:
        _reap(p)


@pytest.mark.timeout(60)
def test_stopping_the_heartbeat_then_leaving_is_not_a_failure(make_server):
    s = make_server()
    client = LighthouseClient(s.address)
    handle = client.start_heartbeat("a", 0.01)
    wait_for(lambda: health(s, "a") == "live", what="a live")
    handle.stop()  # the connection stays open: stopping is not dying
    assert not handle.running
    time.sleep(0.2)
    assert health(s, "a") == "live"
    client.leave("a")
    client.close()
    time.sleep(0.2)
    events = [(h["event"], h["replica_id"]) for h in s.status()["history"]]
    assert ("left", "a") in events and ("disconnected", "a") not in events


@pytest.mark.timeout(60)
def test_close_without_leave_counts_as_gone(make_server):
    s = make_server()
    client = LighthouseClient(s.address)
    client.start_heartbeat("a", 0.01)
    wait_for(lambda: health(s, "a") == "live", what="a live")
    client.close()
    wait_for(lambda: health(s, "a") == "disconnected", timeout=3.0, what="a disconnected")


# ---------------------------------------------------------------------------------- eviction


@pytest.mark.timeout(60)
def test_evicted_heartbeat_stops_and_next_quorum_raises(make_server):
    s = make_server(token=TOKEN)
    client = LighthouseClient(s.address, token=TOKEN)
    handle = client.start_heartbeat("a", 0.02)
    wait_for(lambda: health(s, "a") == "live", what="a live")
    client.evict("a", "maintenance")
    wait_for(lambda: not handle.running, what="heartbeat thread stopped by the 410")
    with pytest.raises(EvictedError, match="evicted"):
        client.quorum(QuorumMember("a"), timeout=5.0)
    # Told once: a later request is a fresh join.
    assert client.quorum(QuorumMember("a"), timeout=5.0).replica_ids == ("a",)
    client.close()


# ---------------------------------------------------------------------------------- lost lighthouse


@pytest.mark.timeout(60)
def test_lost_lighthouse_raises_unavailable_quickly(make_server):
    s = make_server()
    client = LighthouseClient(s.address, connect_timeout=0.5)
    client.heartbeat("a")  # a live keep-alive connection first
    s.shutdown()
    t0 = time.monotonic()
    with pytest.raises(LighthouseUnavailableError, match="unreachable"):
        client.status()
    with pytest.raises(LighthouseUnavailableError):
        client.quorum(QuorumMember("a"), timeout=5.0)
    elapsed = time.monotonic() - t0
    log.info("two calls against a dead lighthouse failed after %.2f s", elapsed)
    assert elapsed < 10.0
    with pytest.raises(LighthouseUnavailableError):
        LighthouseClient("127.0.0.1:1", connect_timeout=0.3).heartbeat("x")
    client.close()


def _start_cli(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftlaunch.lighthouse", "--bind", "127.0.0.1:0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"lighthouse did not start: {line!r}")
    return proc, line.split("listening on", 1)[1].strip()


@pytest.mark.timeout(60)
def test_lighthouse_process_killed_during_long_poll(make_server):
    proc, addr = _start_cli("--min-replicas", "2")
    try:
        client = LighthouseClient(addr, connect_timeout=0.5)
        result: dict = {}

        def ask() -> None:
            try:
                client.quorum(QuorumMember("a"), timeout=30.0)
            except Exception as e:  # asserted below
                result["error"] = e
                result["at"] = time.monotonic()

        t = threading.Thread(target=ask)
        t.start()
        wait_for(lambda: client.status()["pending"] == ["a"], what="a parked")
        t0 = time.monotonic()
        proc.kill()
        t.join(20)
        assert isinstance(result.get("error"), LighthouseUnavailableError)
        log.info("long poll against a killed lighthouse failed after %.2f s", result["at"] - t0)
        assert result["at"] - t0 < 10.0
        client.close()
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.timeout(60)
def test_hung_lighthouse_times_out_instead_of_hanging():
    proc, addr = _start_cli()
    try:
        client = LighthouseClient(addr, connect_timeout=1.0)
        client.heartbeat("a")
        proc.send_signal(signal.SIGSTOP)
        wait_for(
            lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, what="lighthouse stopped"
        )
        t0 = time.monotonic()
        with pytest.raises(LighthouseUnavailableError, match="did not answer"):
            client.heartbeat("a")
        assert time.monotonic() - t0 < 10.0
        client.close()
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)


@pytest.mark.timeout(60)
def test_heartbeat_thread_survives_a_lighthouse_restart(make_server):
    first = make_server()
    host, port = parse_host_port(first.address)
    client = LighthouseClient(first.address, connect_timeout=1.0)
    handle = client.start_heartbeat("a", 0.05)
    wait_for(lambda: health(first, "a") == "live", what="a live on the first lighthouse")
    first.shutdown()
    time.sleep(0.3)  # a few failed beats
    assert handle.running
    second = make_server(bind=f"{host}:{port}")
    wait_for(lambda: health(second, "a") == "live", what="a live on the restarted lighthouse")
    client.close()
    assert not handle.running


@pytest.mark.timeout(60)
def test_quorum_timeout_error(make_server):
    s = make_server(min_replicas=3)
    client = LighthouseClient(s.address)
    with pytest.raises(QuorumTimeoutError, match="min_replicas"):
        client.quorum(QuorumMember("a"), timeout=0.3)
    client.close()


def test_client_rejects_bad_arguments():
    with pytest.raises(ValueError):
        LighthouseClient("ftp://host:1")
    with pytest.raises(ValueError):
        LighthouseClient("host")  # no port
    with pytest.raises(ValueError):
        LighthouseClient("host:1", connect_timeout=0)
    c = LighthouseClient("[::1]:5")
    assert c.address == "http://[::1]:5"
    with pytest.raises(ValueError):
        c.quorum(QuorumMember("a"), timeout=0)
    with pytest.raises(ValueError):
        c.start_heartbeat("a", 0)


# ---------------------------------------------------------------------------------- lost participants


@pytest.mark.timeout(60)
def test_heartbeat_answers_tell_a_participant_which_members_of_its_quorum_were_lost(make_server):
    """Over HTTP: b stops beating (hung); a's heartbeat answers then carry the quorum id and b, and
    a's client calls its `on_quorum_lost` callback (the Manager aborts the step with it). When b
    beats again after the next quorum went on without it, b is told it was superseded (no ids)."""
    s = make_server(heartbeat_timeout=0.5, quorum_tick=0.02)
    a, b = LighthouseClient(s.address), LighthouseClient(s.address)
    told: list[tuple[str, int, tuple[str, ...]]] = []
    a.on_quorum_lost(lambda rid, qid, lost: told.append((rid, qid, lost)))
    b.on_quorum_lost(lambda rid, qid, lost: told.append((rid, qid, lost)))
    a.start_heartbeat("a", 0.02)
    hb = b.start_heartbeat("b", 0.02)
    wait_for(lambda: beating(s, "a") and beating(s, "b"), what="both beating")
    with ThreadPoolExecutor(max_workers=2) as pool:
        qa, qb = (pool.submit(c.quorum, QuorumMember(r), 10.0) for c, r in ((a, "a"), (b, "b")))
        q1 = qa.result()
        assert qb.result().quorum_id == q1.quorum_id and q1.replica_ids == ("a", "b")
    time.sleep(0.2)
    assert told == []  # both live: nothing to tell
    hb.stop()  # b hangs: its connection stays open, it goes silent
    wait_for(lambda: ("a", q1.quorum_id, ("b",)) in told, timeout=10.0, what="a told that b was lost")
    q2 = a.quorum(QuorumMember("a", step=1), timeout=10.0)
    assert q2.replica_ids == ("a",) and q2.quorum_id > q1.quorum_id
    b.start_heartbeat("b", 0.02)  # b resumes
    wait_for(lambda: ("b", q2.quorum_id, ()) in told, timeout=10.0, what="b told that it was superseded")
    a.close()
    b.close()
