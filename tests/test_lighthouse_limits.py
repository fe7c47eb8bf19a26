"""The lighthouse against hostile or broken clients (issue 17): every resource a client can make it
spend is bounded -- JSON depth, log volume, groups tracked, connections -- and the real groups keep
being served meanwhile. Each test failed before its fix."""

from __future__ import annotations

import json
import logging
import socket
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
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            got += chunk
        return got


def _post(path: str, body: bytes) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def _nested_member(depth: int) -> bytes:
    data = "[" * depth + "]" * depth
    return ('{"member": {"replica_id": "deep", "step": 1, "data": {"x": ' + data + '}}, "timeout": 5}').encode()


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


def test_a_fuzzing_client_writes_a_bounded_log(server: LighthouseServer, caplog: pytest.LogCaptureFixture) -> None:
    """One warning per bad request used to write tens of MB of log during a fuzz run."""
    n = 2000
    with caplog.at_level(logging.INFO, logger="ftlaunch.lighthouse"):
        answers = _raw(server, _post("/heartbeat", b"{not json") * n, expect=n)
    assert answers.count(b"HTTP/1.1 400 ") == n  # every request still answered
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 10, len(warnings)
    assert sum(len(r.getMessage()) for r in caplog.records) < 20_000
