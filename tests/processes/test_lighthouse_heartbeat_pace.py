"""The heartbeat pace a large job's lighthouse advises: none up to ~100 groups, slower
beats past it, so that 1024 groups do not send 10,000 heartbeats a second (docs/lighthouse.md)."""

from __future__ import annotations

import http.client
import json
import math
import time

import pytest

from ftlaunch.addresses import parse_host_port
from ftlaunch.lighthouse import LighthouseClient, LighthouseServer
from ftlaunch.lighthouse.client import _advised_pace
from ftlaunch.lighthouse.protocol import MAX_ADVISED_INTERVAL, advised_heartbeat_interval

pytestmark = pytest.mark.timeout(60)


def test_no_pace_is_advised_to_small_jobs() -> None:
    for groups in (0, 1, 4, 64, 100):
        assert advised_heartbeat_interval(groups, 5.0) is None


def test_the_pace_grows_with_the_job_and_stays_under_the_timeout() -> None:
    assert advised_heartbeat_interval(101, 5.0) == 0.2  # rounded up to a tenth of a second
    assert advised_heartbeat_interval(500, 5.0) == 0.5
    assert advised_heartbeat_interval(1024, 10.0) == 1.1
    # Never past heartbeat_timeout / 5 (rounded down): a missed beat or two is not a death.
    assert advised_heartbeat_interval(4096, 5.0) == 1.0
    assert advised_heartbeat_interval(4096, 3.65) == 0.7
    assert advised_heartbeat_interval(4096, 0.3) is None  # a short timeout keeps the clients' own pace


def test_the_client_bounds_what_it_is_advised() -> None:
    assert _advised_pace(0.5) == 0.5
    assert _advised_pace(3600) == MAX_ADVISED_INTERVAL
    # Not a finite positive number: no advice (the client keeps its own pace), infinity included.
    for bad in (None, True, "1", -1, 0, math.nan, math.inf, -math.inf, [1]):
        assert _advised_pace(bad) == 0.0, bad


def _beat(conn: http.client.HTTPConnection, rid: str) -> dict:
    conn.request(
        "POST", "/v1/heartbeat", json.dumps({"replica_id": rid}), {"Content-Type": "application/json"}
    )
    response = conn.getresponse()
    assert response.status == 200
    return json.loads(response.read())


@pytest.fixture
def server():
    s = LighthouseServer(join_timeout=30.0, heartbeat_timeout=5.0).start()
    yield s
    s.shutdown()


def test_small_jobs_get_the_plain_answer_and_keep_their_pace(server) -> None:
    host, port = parse_host_port(server.address)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    for i in range(4):
        assert _beat(conn, f"g{i}") == {"ok": True, "version": 1}
    conn.close()
    client = LighthouseClient(server.address)
    handle = client.start_heartbeat("solo", 0.01)  # (the ids above belong to another incarnation)
    time.sleep(0.3)
    assert handle.advised == 0.0  # type: ignore[attr-defined]
    client.leave("solo")
    client.close()


def test_a_large_job_is_told_to_beat_slower_and_the_client_does(server) -> None:
    host, port = parse_host_port(server.address)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    for i in range(150):
        answer = _beat(conn, f"g{i:03d}")
    conn.close()
    assert answer == {"ok": True, "interval": 0.2, "version": 1}
    client = LighthouseClient(server.address)
    handle = client.start_heartbeat("g150", 0.01)  # (the ids above belong to another incarnation)
    time.sleep(1.0)
    beats = next(g for g in server.status()["groups"] if g["replica_id"] == "g150")["heartbeats"]
    client.leave("g150")
    client.close()
    assert handle.advised == 0.2  # type: ignore[attr-defined]
    # At its own 10 ms it would have beaten ~100 times in that second; at the advised 0.2 s about 5
    # (+1: the first beat, at its own pace). A loaded host only beats less.
    assert beats <= 1 + 1.0 / 0.2 + 2, beats
