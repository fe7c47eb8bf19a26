"""The lighthouse against hostile or broken clients: every resource a client can make it
spend is bounded -- JSON depth, log volume, groups tracked, connections -- and the real groups keep
being served meanwhile. Each test failed before its fix."""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from ftlaunch.addresses import parse_host_port
from ftlaunch.lighthouse import LighthouseClient, LighthouseServer, QuorumMember
from ftlaunch.lighthouse.protocol import MAX_JSON_DEPTH

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def server() -> Iterator[LighthouseServer]:
    s = LighthouseServer("127.0.0.1:0", join_timeout=30.0, heartbeat_timeout=30.0).start()
    yield s
    s.shutdown()


def _raw(server: LighthouseServer, data: bytes, *, expect: int, timeout: float = 30.0) -> bytes:
    """Send ``data`` on a fresh connection and read until ``expect`` responses (or EOF) arrived."""
    host, port = parse_host_port(server.address)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(data)
        got = b""
        deadline = time.monotonic() + timeout
        while got.count(b"HTTP/1.1 ") < expect and time.monotonic() < deadline:
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:  # closed by the server with requests left unread
                break
            if not chunk:
                break
            got += chunk
        return got


def _post(path: str, body: bytes) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def _nested_member(depth: int) -> bytes:
    data = "[" * depth + "]" * depth
    return (
        '{"member": {"replica_id": "deep", "step": 1, "data": {"x": ' + data + '}}, "timeout": 5}'
    ).encode()


# ---------------------------------------------------------------------------------- JSON depth


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 983, 200_000])
def test_deep_json_is_a_400_and_status_keeps_working(server: LighthouseServer, depth: int) -> None:
    """Depth ~983 used to parse, form a quorum that could not be encoded (no answer, /status broken);
    ~200k used to drop the connection."""
    answer = _raw(server, _post("/quorum", _nested_member(depth)), expect=1)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"nested deeper than" in answer
    status = server.status()
    assert status["quorum"] is None and status["groups"] == []
    json.dumps(status)
    client = LighthouseClient(server.address)
    try:  # a real group is served as before
        assert client.quorum(QuorumMember("a", step=1), timeout=10).replica_ids == ("a",)
        assert client.status()["quorum"]["participants"][0]["replica_id"] == "a"
    finally:
        client.close()


def test_moderate_nesting_is_accepted(server: LighthouseServer) -> None:
    client = LighthouseClient(server.address)
    try:
        data: object = {}
        for _ in range(MAX_JSON_DEPTH - 4):
            data = {"k": data}
        q = client.quorum(QuorumMember("a", step=1, data={"x": data}), timeout=10)
        assert q.replica_ids == ("a",)
    finally:
        client.close()


# ---------------------------------------------------------------------------------- log volume


def test_a_fuzzing_client_writes_a_bounded_log(
    server: LighthouseServer, caplog: pytest.LogCaptureFixture
) -> None:
    """One warning per bad request used to write tens of MB of log during a fuzz run."""
    per_connection, connections = 10, 200
    with caplog.at_level(logging.INFO, logger="ftlaunch.lighthouse"):
        for _ in range(connections):
            answers = _raw(server, _post("/heartbeat", b"{not json") * per_connection, expect=per_connection)
            assert answers.count(b"HTTP/1.1 400 ") == per_connection  # every request still answered
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 10, len(warnings)
    assert sum(len(r.getMessage()) for r in caplog.records) < 20_000


# ---------------------------------------------------------------------------------- connections


def _limited_lighthouse(nofile: int) -> tuple[subprocess.Popen, str]:
    """``ftlaunch-lighthouse`` in a process whose file-descriptor limit is ``nofile``."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(
        [sys.executable, "-m", "ftlaunch.lighthouse", "--log-level", "warning", "--heartbeat-timeout", "30"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=limit,
        env={k: v for k, v in os.environ.items() if k != "FTLAUNCH_TOKEN"},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if " on http://" not in line:
        proc.kill()
        raise AssertionError(f"lighthouse did not start: {line!r} {proc.communicate(timeout=10)}")
    return proc, line.split(" on ", 1)[1].strip()


def test_idle_socket_flood_past_the_fd_limit_does_not_lock_groups_out() -> None:
    """1,100 idle sockets against the usual 1024-fd limit made a quorum request time out: accept()
    failed for everyone. Scaled down: 700 idle sockets against a 512-fd lighthouse."""
    proc, addr = _limited_lighthouse(512)
    host, port = parse_host_port(addr)
    idle: list[socket.socket] = []
    client = None
    try:
        for _ in range(700):
            s = socket.socket()
            s.settimeout(5)
            try:
                s.connect((host, port))
            except OSError:
                s.close()
                continue
            idle.append(s)
        assert len(idle) > 512
        client = LighthouseClient(addr, connect_timeout=20)
        assert client.quorum(QuorumMember("a", step=1), timeout=20).replica_ids == ("a",)
        client.heartbeat("a")
    finally:
        if client is not None:
            client.close()
        for s in idle:
            s.close()
        proc.terminate()
        try:
            proc.wait(15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    _, err = proc.communicate(timeout=10)
    assert "closing the longest-idle" in err and "Traceback" not in err, err


def test_a_silent_connection_is_closed_after_the_read_timeout(server: LighthouseServer) -> None:
    """A socket that never sends a request is not kept for the 120 s keep-alive idle timeout."""
    server.read_timeout = 0.5
    host, port = parse_host_port(server.address)
    with socket.create_connection((host, port), timeout=30) as s:
        assert s.recv(100) == b""  # closed by the server, long before idle_timeout
    assert server.idle_timeout >= 120


# ---------------------------------------------------------------------------------- the event loop


def test_a_connection_of_bad_requests_is_closed(server: LighthouseServer) -> None:
    """Thousands of pipelined bad requests on one connection: answered up to a bound, then closed,
    instead of keeping the event loop busy for everyone (and head searches stay short)."""
    from ftlaunch.lighthouse.transport import MAX_ERRORS_PER_CONNECTION

    start = time.monotonic()
    answers = _raw(server, _post("/heartbeat", b"{}") * 5000, expect=5000, timeout=60)
    assert time.monotonic() - start < 60  # the server ended it, no wait for the read timeout
    assert 0 < answers.count(b"HTTP/1.1 400 ") <= MAX_ERRORS_PER_CONNECTION
    client = LighthouseClient(server.address)
    try:
        client.heartbeat("a")  # still serving
    finally:
        client.close()


def test_hostile_clients_do_not_stall_a_real_group(server: LighthouseServer) -> None:
    """While a slowloris, a client that never reads its answers, a flood of 1 MiB junk bodies and deep
    JSON hit the lighthouse, a real group keeps getting its quorums (each request bounded by the
    client's read timeout)."""
    import threading

    host, port = parse_host_port(server.address)
    stop = threading.Event()
    socks: list[socket.socket] = []

    def hostile(payload: bytes, read: bool) -> None:
        while not stop.is_set():
            try:
                s = socket.create_connection((host, port), timeout=5)
            except OSError:
                continue
            socks.append(s)
            try:
                s.sendall(payload)
                if read:
                    s.recv(1 << 16)
            except OSError:
                pass
            finally:
                s.close()

    junk = _post("/heartbeat", b"[" + b"0," * (500_000 - 2) + b"0]")  # ~1 MiB, valid JSON, not an object
    loris = b"POST /quorum HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"  # never finished
    threads = [
        threading.Thread(target=hostile, args=(junk * 3, True), daemon=True),
        threading.Thread(target=hostile, args=(_post("/quorum", _nested_member(200_000)), True), daemon=True),
        threading.Thread(target=hostile, args=(_post("/heartbeat", b"{}") * 2000, False), daemon=True),
        threading.Thread(target=hostile, args=(loris, False), daemon=True),
    ]
    for t in threads:
        t.start()
    client = LighthouseClient(server.address, connect_timeout=10)
    try:
        for step in range(20):
            assert client.quorum(QuorumMember("real", step=step), timeout=10).replica_ids == ("real",)
            client.heartbeat("real")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        client.close()
    assert [g["replica_id"] for g in server.status()["groups"]] == ["real"]
