"""LighthouseServer over real sockets: the JSON API, quorum rules end to end, admin, bad input."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from ftlaunch.addresses import parse_host_port
from ftlaunch.errors import (
    ConfigurationError,
    EvictedError,
    LighthouseError,
    LighthouseUnavailableError,
    QuorumTimeoutError,
)
from ftlaunch.lighthouse import LighthouseClient, LighthouseServer, QuorumMember
from ftlaunch.lighthouse.protocol import INCARNATION_HEADER, MAX_BODY_BYTES

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-token"


@pytest.fixture
def make_server() -> Iterator[Callable[..., LighthouseServer]]:
    servers: list[LighthouseServer] = []

    def make(**kwargs) -> LighthouseServer:
        kwargs.setdefault("join_timeout", 30.0)
        kwargs.setdefault("heartbeat_timeout", 30.0)
        s = LighthouseServer(**kwargs).start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.shutdown()


@pytest.fixture
def server(make_server) -> LighthouseServer:
    """A loopback lighthouse without a token (any local process may act as a group)."""
    return make_server()


@pytest.fixture
def token_server(make_server) -> LighthouseServer:
    """A lighthouse with the job token: every request but a read must carry it."""
    return make_server(token=TOKEN)


def request(
    server: LighthouseServer, method: str, path: str, body: object = None, headers: dict | None = None
) -> tuple[int, dict, http.client.HTTPResponse]:
    host, port = parse_host_port(server.address)
    conn = http.client.HTTPConnection(host, port, timeout=20)
    try:
        data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        raw = resp.read()
        payload = (
            json.loads(raw)
            if resp.getheader("Content-Type", "").startswith("application/json") and raw
            else {}
        )
        return resp.status, payload, resp
    finally:
        conn.close()


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - start


def group(server: LighthouseServer, rid: str) -> dict | None:
    return next((g for g in server.status()["groups"] if g["replica_id"] == rid), None)


def ask_all(client: LighthouseClient, members: list[QuorumMember], timeout: float = 20.0) -> dict:
    """Quorum requests from several groups at once (one thread each); returns rid -> Quorum or error.

    Every group beats once first, so all are live before anyone asks: otherwise whoever asks first
    may legitimately form a quorum alone (it is the only live group, or a fast quorum).
    """
    results: dict = {}
    for m in members:
        client.heartbeat(m.replica_id)

    def run(m: QuorumMember) -> None:
        try:
            results[m.replica_id] = client.quorum(m, timeout)
        except Exception as e:  # collected and asserted by the caller
            results[m.replica_id] = e

    threads = [threading.Thread(target=run, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 15)
    return results


# ---------------------------------------------------------------------------------- basics


def test_status_dashboard_and_versioned_aliases(server):
    for path in ("/status", "/v1/status", "/v1/status/"):
        code, payload, _ = request(server, "GET", path)
        assert code == 200 and payload["version"] == 1 and payload["groups"] == []
    code, _, resp = request(server, "GET", "/")
    assert code == 200 and resp.getheader("Content-Type").startswith("text/html")
    code, _, _ = request(server, "GET", "/v1/")
    assert code == 200


def test_status_reads_back_typed(server):
    """GET /status parses back (LighthouseClient.snapshot) into what the server holds."""
    client = LighthouseClient(server.address)
    client.quorum(QuorumMember("a", step=2), timeout=10)
    remote, local = client.snapshot(), server.snapshot()
    assert remote.quorum == local.quorum and remote.quorum_id == local.quorum_id is not None
    assert [(g.replica_id, g.health.value, g.step) for g in remote.groups] == [("a", "live", 2)]
    assert remote.history[0].event == "quorum" and remote.history[0].participants == ("a",)
    assert remote.options == local.options and remote.address == server.address
    assert remote.to_json().keys() == server.status().keys()
    client.close()


def test_address_binds_loopback_with_free_port(server):
    host, port = parse_host_port(server.address)
    assert host == "127.0.0.1" and port > 0


def test_bad_constructor_arguments_raise_configuration_error():
    with pytest.raises(ConfigurationError):
        LighthouseServer(min_replicas=0)
    with pytest.raises(ConfigurationError):
        LighthouseServer(quorum_tick=0)
    with pytest.raises(ConfigurationError):
        LighthouseServer(bind="127.0.0.1:notaport")


def test_dashboard_escapes_client_supplied_text(server):
    client = LighthouseClient(server.address)
    evil = "<script>alert(1)</script>"
    q = client.quorum(
        QuorumMember(evil, address="<img src=x onerror=alert(2)>", data={"x": "<b>"}), timeout=10
    )
    assert q.replica_ids == (evil,)
    _, _, _ = request(server, "GET", "/status")
    host, port = parse_host_port(server.address)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("GET", "/")
    html = conn.getresponse().read().decode()
    conn.close()
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<img src=x" not in html
    assert "http-equiv='refresh'" in html
    client.close()


# ---------------------------------------------------------------------------------- quorum rules over HTTP


def test_fast_quorum_is_event_driven_not_tick_driven(make_server):
    # A tick of 120 s never fires during this test: every quorum must come from request arrival.
    s = make_server(quorum_tick=60.0, min_replicas=2)
    client = LighthouseClient(s.address)
    ids = []
    for step in range(5):
        res = ask_all(client, [QuorumMember("a", step=step), QuorumMember("b", step=step)], timeout=20)
        assert all(not isinstance(v, Exception) for v in res.values()), res
        assert res["a"] == res["b"] and res["a"].replica_ids == ("a", "b")
        ids.append(res["a"].quorum_id)
    assert len(set(ids)) == 1, "same members must keep the quorum id"
    status = s.status()
    assert status["quorum"]["participants"][0]["step"] == 4
    assert [h["event"] for h in status["history"]].count("quorum") == 1
    client.close()


def test_membership_change_and_commit_failures_change_the_id(make_server):
    s = make_server(quorum_tick=60.0)
    client = LighthouseClient(s.address)
    q1 = client.quorum(QuorumMember("a"), 10)
    res = ask_all(client, [QuorumMember("a"), QuorumMember("b")])  # b joins: every live group asks
    q2 = res["a"]
    assert q2.replica_ids == ("a", "b") and q2.quorum_id > q1.quorum_id
    res = ask_all(client, [QuorumMember("a"), QuorumMember("b", commit_failures=1)])
    assert res["a"].quorum_id > q2.quorum_id
    res = ask_all(client, [QuorumMember("a"), QuorumMember("b")])
    assert res["b"].quorum_id == res["a"].quorum_id and res["a"].quorum_id > q2.quorum_id
    client.close()


def test_join_timeout_forms_with_those_present(make_server):
    s = make_server(join_timeout=1.0, heartbeat_timeout=30.0)
    client = LighthouseClient(s.address)
    for rid in "abc":
        client.heartbeat(rid)  # c is live but never asks
    res = ask_all(client, [QuorumMember("a"), QuorumMember("b")], timeout=20)
    assert res["a"].replica_ids == ("a", "b")
    assert "join timeout" in s.status()["history"][0]["detail"]
    client.close()


def test_split_brain_guard_needs_more_than_half(make_server):
    s = make_server(join_timeout=0.2, heartbeat_timeout=30.0)
    client = LighthouseClient(s.address)
    for rid in "abcd":
        client.heartbeat(rid)
    res = ask_all(client, [QuorumMember("a"), QuorumMember("b")], timeout=1.5)  # 2 of 4 live: no
    assert isinstance(res["a"], QuorumTimeoutError) and isinstance(res["b"], QuorumTimeoutError)
    assert "split brain" in str(res["a"])
    res = ask_all(
        client, [QuorumMember("a"), QuorumMember("b"), QuorumMember("c")], timeout=20
    )  # 3 of 4: yes
    assert res["a"].replica_ids == ("a", "b", "c")
    client.close()


def test_min_replicas(make_server):
    s = make_server(min_replicas=2, join_timeout=0.0)
    client = LighthouseClient(s.address)
    with pytest.raises(QuorumTimeoutError, match="min_replicas"):
        client.quorum(QuorumMember("a"), timeout=0.5)
    assert s.status()["pending"] == []  # a timed-out request is withdrawn
    res = ask_all(client, [QuorumMember("a"), QuorumMember("b")])
    assert res["a"].replica_ids == ("a", "b")
    client.close()


def test_heartbeat_expiry_unblocks_the_quorum(make_server):
    s = make_server(join_timeout=60.0, heartbeat_timeout=0.5, quorum_tick=0.05)
    client = LighthouseClient(s.address)
    code, _, _ = request(s, "POST", "/heartbeat", {"replica_id": "c"})  # one beat, then silence
    assert code == 200
    beats = [client.start_heartbeat(rid, 0.05) for rid in "ab"]  # a and b keep beating while they wait
    res = ask_all(client, [QuorumMember("a"), QuorumMember("b")], timeout=20)
    assert res["a"].replica_ids == ("a", "b")
    assert group(s, "c")["health"] == "silent"
    events = [(h["event"], h["replica_id"]) for h in s.status()["history"]]
    assert ("silent", "c") in events
    for h in beats:
        h.stop()
    client.close()


def test_shrink_only_keeps_new_groups_out(make_server):
    s = make_server(quorum_tick=60.0)
    client = LighthouseClient(s.address)
    q1 = ask_all(client, [QuorumMember("a"), QuorumMember("b")])["a"]
    res = ask_all(client, [QuorumMember("a", shrink_only=True), QuorumMember("b")], timeout=20)
    assert res["a"].quorum_id == q1.quorum_id
    # c asks while a is shrink-only: the quorum forms without c, which keeps waiting (then times out).
    results = {}
    t = threading.Thread(target=lambda: results.update(ask_all(client, [QuorumMember("c")], timeout=1.5)))
    t.start()
    wait_for(lambda: "c" in s.status()["pending"], what="c pending")
    res = ask_all(client, [QuorumMember("a", shrink_only=True), QuorumMember("b")], timeout=20)
    t.join(30)
    assert res["a"].replica_ids == ("a", "b")
    assert isinstance(results["c"], QuorumTimeoutError)
    client.close()


def test_superseded_request_gets_409(make_server):
    s = make_server(min_replicas=2)
    results: dict = {}
    client = LighthouseClient(s.address)

    def first() -> None:  # the same process (incarnation) asks again, e.g. after a lost answer
        status, payload, _ = request(
            s,
            "POST",
            "/quorum",
            {"member": {"replica_id": "a"}, "timeout": 20},
            {INCARNATION_HEADER: client.incarnation},
        )
        results["first"] = (status, payload)

    t1 = threading.Thread(target=first)
    t1.start()
    wait_for(lambda: "a" in s.status()["pending"], what="first request pending")
    t2 = threading.Thread(target=lambda: results.update(second=client.quorum(QuorumMember("a", step=1), 20)))
    t2.start()
    t1.join(30)  # the first one is answered as soon as the second arrives
    assert results["first"][0] == 409 and "superseded" in results["first"][1]["error"]
    qb = client.quorum(QuorumMember("b"), 20)
    t2.join(30)
    assert qb.replica_ids == ("a", "b") and results["second"] == qb and qb.member("a").step == 1
    client.close()


def test_a_replica_id_is_held_by_one_incarnation(make_server):
    """a second process using a live group's id cannot push its parked request out (409 for
    the newcomer, not the holder), beat for it or make it leave; once the holder is gone, it may."""
    s = make_server(min_replicas=2)
    holder, other = LighthouseClient(s.address), LighthouseClient(s.address)
    results: dict = {}
    t = threading.Thread(target=lambda: results.update(q=holder.quorum(QuorumMember("a", step=1), 20)))
    t.start()
    try:
        wait_for(lambda: "a" in s.status()["pending"], what="holder's request parked")
        for call in (
            lambda: other.quorum(QuorumMember("a", step=1), 5),
            lambda: other.heartbeat("a"),
            lambda: other.leave("a"),
        ):
            with pytest.raises(LighthouseError, match="409.*held by another live process"):
                call()
        assert "a" in s.status()["pending"] and group(s, "a")["health"] == "live"
        qb = holder.quorum(QuorumMember("b"), 20)  # the holder's request was never disturbed
        t.join(30)
        assert results["q"] == qb and qb.replica_ids == ("a", "b")
        s.report_failure("a", "its process died")  # the holder is gone: a new incarnation takes over
        other.heartbeat("a")
        assert group(s, "a")["health"] == "live"
    finally:
        holder.close()
        other.close()
        t.join(30)


def test_quorum_ids_increase_across_restart(make_server):
    first = make_server()
    c1 = LighthouseClient(first.address)
    q1 = c1.quorum(QuorumMember("a"), 10)
    q1b = ask_all(c1, [QuorumMember("a"), QuorumMember("b")])["a"]
    c1.close()
    first.shutdown()
    second = make_server()
    c2 = LighthouseClient(second.address)
    q2 = c2.quorum(QuorumMember("a"), 10)
    assert q1.quorum_id < q1b.quorum_id < q2.quorum_id
    c2.close()


# ---------------------------------------------------------------------------------- failures


def _bound_connection(server: LighthouseServer, rid: str) -> socket.socket:
    """A raw keep-alive connection that sent one heartbeat with the replica header."""
    host, port = parse_host_port(server.address)
    sock = socket.create_connection((host, port), timeout=10)
    body = json.dumps({"replica_id": rid}).encode()
    sock.sendall(
        b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nX-Ftlaunch-Replica: "
        + rid.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    assert b"200" in sock.recv(65536).split(b"\r\n")[0]
    return sock


def test_closing_the_last_bound_connection_marks_disconnected_at_once(server):
    s1 = _bound_connection(server, "a")
    s2 = _bound_connection(server, "a")
    assert group(server, "a")["connections"] == 2
    s1.close()
    wait_for(lambda: group(server, "a")["connections"] == 1, what="first connection gone")
    assert group(server, "a")["health"] == "live"
    s2.close()
    elapsed = wait_for(lambda: group(server, "a")["health"] == "disconnected", what="disconnected")
    logging.getLogger(__name__).info("disconnect noticed %.1f ms after close", elapsed * 1000)
    assert ("disconnected", "a") in [(h["event"], h["replica_id"]) for h in server.status()["history"]]
    # A later request revives it.
    code, _, _ = request(server, "POST", "/heartbeat", {"replica_id": "a"})
    assert code == 200 and group(server, "a")["health"] == "live"


def test_disconnect_of_a_straggler_wakes_waiters(make_server):
    s = make_server(join_timeout=60.0, quorum_tick=60.0)
    sock = _bound_connection(s, "c")
    client = LighthouseClient(s.address)
    client.heartbeat("a")
    client.heartbeat("b")
    results = {}
    t = threading.Thread(
        target=lambda: results.update(ask_all(client, [QuorumMember("a"), QuorumMember("b")], 20))
    )
    t.start()
    wait_for(lambda: set(s.status()["pending"]) == {"a", "b"}, what="a, b pending")
    sock.close()  # c's process "dies": a and b must not wait for the 60 s join timeout
    t.join(30)
    assert results["a"].replica_ids == ("a", "b")
    client.close()


def test_connection_closed_while_parked_in_a_long_poll(make_server):
    s = make_server(min_replicas=2, quorum_tick=0.05)
    host, port = parse_host_port(s.address)
    sock = socket.create_connection((host, port), timeout=10)
    body = json.dumps({"member": {"replica_id": "a"}, "timeout": 30}).encode()
    sock.sendall(
        b"POST /quorum HTTP/1.1\r\nHost: x\r\nX-Ftlaunch-Replica: a\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    wait_for(lambda: s.status()["pending"] == ["a"], what="a parked")
    sock.close()
    wait_for(lambda: group(s, "a")["health"] == "disconnected", what="parked peer noticed")
    assert s.status()["pending"] == []


def test_report_failure_in_process_and_admin(make_server):
    s = make_server(join_timeout=60.0, token=TOKEN)
    client = LighthouseClient(s.address, token=TOKEN)
    for rid in "abc":
        client.heartbeat(rid)
    results = {}
    t = threading.Thread(
        target=lambda: results.update(ask_all(client, [QuorumMember("a"), QuorumMember("b")], 20))
    )
    t.start()
    wait_for(lambda: set(s.status()["pending"]) == {"a", "b"}, what="a, b pending")
    s.report_failure("c", "agent saw exit code -9")  # in-process, as the supervisor does
    t.join(30)
    assert results["a"].replica_ids == ("a", "b")
    assert group(s, "c")["health"] == "failed" and "exit code -9" in group(s, "c")["reason"]
    client.report_failure("b", "admin says so")
    assert group(s, "b")["health"] == "failed"
    s.report_failure("nobody")  # unknown: logged, no exception
    with pytest.raises(LighthouseError, match="404"):
        client.report_failure("nobody")
    client.close()


def test_leave_is_not_a_failure(server):
    client = LighthouseClient(server.address)
    handle = client.start_heartbeat("a", 0.01)
    wait_for(
        lambda: group(server, "a") is not None and group(server, "a")["heartbeats"] > 3, what="a beating"
    )
    client.leave("a")  # also stops the heartbeat, closing its connection after the leave
    assert not handle.running
    handle.stop()  # harmless afterwards
    time.sleep(0.2)
    assert group(server, "a") is None
    events = [h["event"] for h in server.status()["history"] if h["replica_id"] == "a"]
    assert "left" in events and "disconnected" not in events
    client.close()


def test_evict_gives_410_once_then_fresh_join(token_server):
    server = token_server
    client = LighthouseClient(server.address, token=TOKEN)
    client.heartbeat("a")
    client.evict("a", "bad node")
    assert group(server, "a") is None
    with pytest.raises(EvictedError, match="bad node"):
        client.heartbeat("a")
    client.heartbeat("a")  # one-shot: a fresh join now
    assert group(server, "a")["health"] == "live"
    with pytest.raises(LighthouseError, match="404"):
        client.evict("nobody")
    client.close()


def test_evict_wakes_a_parked_request(make_server):
    s = make_server(min_replicas=2, token=TOKEN)
    client = LighthouseClient(s.address, token=TOKEN)
    results = {}
    t = threading.Thread(target=lambda: results.update(ask_all(client, [QuorumMember("a")], 20)))
    t.start()
    wait_for(lambda: s.status()["pending"] == ["a"], what="a parked")
    assert s.evict("a", "drain")
    t.join(30)
    assert isinstance(results["a"], EvictedError)
    q = ask_all(client, [QuorumMember("a"), QuorumMember("b")])["a"]  # told once: now a fresh join
    assert q.replica_ids == ("a", "b")
    client.close()


def test_shutdown_answers_parked_requests(make_server):
    s = make_server(min_replicas=2)
    client = LighthouseClient(s.address, connect_timeout=0.5)
    results = {}
    t = threading.Thread(target=lambda: results.update(ask_all(client, [QuorumMember("a")], 20)))
    t.start()
    wait_for(lambda: s.status()["pending"] == ["a"], what="a parked")
    s.shutdown()
    t.join(30)
    assert isinstance(results["a"], LighthouseUnavailableError)
    client.close()


# ---------------------------------------------------------------------------------- admin auth


def test_admin_endpoints_need_the_token(token_server):
    server = token_server
    request(server, "POST", "/heartbeat", {"replica_id": "a"}, {"Authorization": f"Bearer {TOKEN}"})
    body = {"replica_id": "a", "reason": "x"}
    code, payload, resp = request(server, "POST", "/admin/evict", body)
    assert code == 401 and payload["version"] == 1 and resp.getheader("WWW-Authenticate") == "Bearer"
    code, payload, _ = request(server, "POST", "/admin/evict", body, {"Authorization": "Bearer nope"})
    assert code == 403 and "wrong token" in payload["error"]
    code, _, _ = request(server, "POST", "/admin/evict", body, {"Authorization": f"Basic {TOKEN}"})
    assert code == 403
    assert group(server, "a") is not None
    code, _, _ = request(server, "POST", "/admin/report_failure", body, {"Authorization": f"Bearer {TOKEN}"})
    assert code == 200 and group(server, "a")["health"] == "failed"
    code, _, _ = request(server, "POST", "/admin/evict", body, {"Authorization": f"Bearer {TOKEN}"})
    assert code == 200 and group(server, "a") is None


AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/quorum", {"member": {"replica_id": "intruder", "step": 10**9, "address": "evil:1"}, "timeout": 1}),
        ("/heartbeat", {"replica_id": "intruder"}),
        ("/v1/heartbeat", {"replica_id": "intruder"}),
        ("/leave", {"replica_id": "a"}),
        ("/admin/evict", {"replica_id": "a"}),
    ],
)
@pytest.mark.parametrize(("headers", "code"), [({}, 401), ({"Authorization": "Bearer nope"}, 403)])
def test_every_group_request_needs_the_token(token_server, path, body, headers, code):
    """without the job token a client can neither join, beat, leave nor evict: 401/403, and
    nothing changes (the real group stays, no invented id appears, no quorum forms)."""
    server = token_server
    ok, _, _ = request(server, "POST", "/heartbeat", {"replica_id": "a"}, AUTH)
    assert ok == 200
    before = server.status()
    got, payload, _ = request(server, "POST", path, body, headers)
    assert got == code and "error" in payload
    after = server.status()
    assert [g["replica_id"] for g in after["groups"]] == ["a"] and after["quorum"] == before["quorum"]
    assert after["history"] == before["history"]


def test_reads_stay_open_and_the_client_sends_the_token(token_server):
    """Status and the dashboard are readable without the token; a client built with it does
    everything a group does (quorum, heartbeat, leave)."""
    code, status, _ = request(token_server, "GET", "/status")
    assert code == 200 and status["options"]["admin"] is True
    assert request(token_server, "GET", "/")[0] == 200
    with pytest.raises(LighthouseError, match="401"):
        LighthouseClient(token_server.address).heartbeat("a")
    client = LighthouseClient(token_server.address, token=TOKEN)
    try:
        q = client.quorum(QuorumMember("a", step=3), timeout=10)
        assert q.replica_ids == ("a",)
        client.heartbeat("a")
        client.leave("a")
        assert group(token_server, "a") is None
    finally:
        client.close()


def test_admin_refused_without_server_token(make_server):
    s = make_server()
    request(s, "POST", "/heartbeat", {"replica_id": "a"})
    code, payload, _ = request(
        s, "POST", "/admin/report_failure", {"replica_id": "a"}, {"Authorization": "Bearer x"}
    )
    assert code == 403 and "without a token" in payload["error"]
    assert group(s, "a")["health"] == "live"


# ---------------------------------------------------------------------------------- bad input


BAD_REQUESTS = [
    ("POST", "/quorum", b"{not json", {}, 400, "malformed JSON"),
    ("POST", "/quorum", b"[1, 2]", {}, 400, "JSON object"),
    ("POST", "/quorum", {"member": {"replica_id": "a", "step": "7"}}, {}, 400, "step"),
    ("POST", "/quorum", {"member": {"replica_id": "a", "colour": "red"}}, {}, 400, "unknown"),
    ("POST", "/quorum", {"member": {"replica_id": "a"}, "extra": 1}, {}, 400, "unknown field"),
    ("POST", "/quorum", {"member": {"replica_id": "a"}, "timeout": "soon"}, {}, 400, "timeout"),
    ("POST", "/quorum", {"member": {"replica_id": "a"}, "timeout": -1}, {}, 400, "timeout"),
    ("POST", "/quorum", {}, {}, 400, "missing field 'member'"),
    ("POST", "/heartbeat", {"replica_id": 5}, {}, 400, "replica_id"),
    ("POST", "/heartbeat", {"replica_id": ""}, {}, 400, "replica_id"),
    ("POST", "/heartbeat", {"replica_id": "a\nb"}, {}, 400, "printable"),
    ("POST", "/heartbeat", {"replica_id": "x" * 300}, {}, 400, "replica_id"),
    ("POST", "/heartbeat", {"replica_id": "a"}, {"X-Ftlaunch-Replica": "b"}, 400, "does not match"),
    ("POST", "/heartbeat", b"\xff\xfe", {}, 400, "malformed JSON"),
    ("POST", "/leave", {"replica": "a"}, {}, 400, "unknown field"),
    ("GET", "/nope", None, {}, 404, "no such endpoint"),
    ("POST", "/v2/quorum", {}, {}, 404, "no such endpoint"),
    ("GET", "/quorum", None, {}, 405, "not allowed"),
    ("POST", "/status", {}, {}, 405, "not allowed"),
    ("PUT", "/heartbeat", {"replica_id": "a"}, {}, 405, "not allowed"),
    ("DELETE", "/", None, {}, 405, "not allowed"),
]


@pytest.mark.parametrize("method,path,body,headers,code,fragment", BAD_REQUESTS)
def test_bad_requests_get_clear_json_errors(server, caplog, method, path, body, headers, code, fragment):
    with caplog.at_level(logging.WARNING, logger="ftlaunch.lighthouse.server"):
        status, payload, _ = request(server, method, path, body, headers)
    assert status == code
    assert payload["version"] == 1 and fragment in payload["error"]
    assert len([r for r in caplog.records if str(code) in r.getMessage()]) == 1, "logged exactly once"
    assert request(server, "GET", "/status")[0] == 200  # still serving


def _raw(server: LighthouseServer, data: bytes, *, read_timeout: float = 20.0) -> bytes:
    host, port = parse_host_port(server.address)
    with socket.create_connection((host, port), timeout=read_timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def _json_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def test_oversized_body_rejected_without_reading_it(server):
    # Only the headers are sent: the 413 must come back without the server waiting for 2 MiB.
    raw = _raw(
        server, b"POST /quorum HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (2 * MAX_BODY_BYTES)
    )
    code, payload = _json_body(raw)
    assert code == 413 and "exceeds" in payload["error"] and payload["version"] == 1
    assert b"Connection: close" in raw


def test_length_required_and_chunked_refused(server):
    code, payload = _json_body(
        _raw(server, b"POST /heartbeat HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    )
    assert code == 411 and "Content-Length" in payload["error"]
    raw = _raw(
        server,
        b"POST /heartbeat HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    code, payload = _json_body(raw)
    assert code == 411 and "chunked" in payload["error"]
    code, payload = _json_body(
        _raw(server, b"POST /heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
    )
    assert code == 400 and "Content-Length" in payload["error"]


def test_garbage_request_line_and_too_many_headers(server):
    code, payload = _json_body(_raw(server, b"HELLO\r\n\r\n"))
    assert code == 400 and payload["version"] == 1
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(150))
    code, payload = _json_body(_raw(server, b"GET /status HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"))
    assert code == 431
    code, payload = _json_body(_raw(server, b"BREW /status HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert code == 501 and "Unsupported method" in payload["error"]


def test_head_gets_405_without_body(server):
    host, port = parse_host_port(server.address)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("HEAD", "/status")
    resp = conn.getresponse()
    assert resp.status == 405 and resp.read() == b""
    conn.close()


def test_slow_client_is_cut_off_but_idle_keepalive_is_not(server):
    server.read_timeout = 0.5  # shortened for the test; documented default is 10 s
    host, port = parse_host_port(server.address)
    # A keep-alive connection idle for longer than read_timeout stays usable.
    idle = http.client.HTTPConnection(host, port, timeout=10)
    idle.request("GET", "/status")
    assert idle.getresponse().read()
    # Slowloris: half a request, then nothing.
    slow = socket.create_connection((host, port), timeout=20)
    slow.sendall(b"POST /heartbeat HTTP/1.1\r\nHost: x\r\nContent-Len")
    t0 = time.monotonic()
    data = b""
    while True:
        chunk = slow.recv(65536)
        if not chunk:
            break
        data += chunk
    logging.getLogger(__name__).info("slow client cut off after %.2f s", time.monotonic() - t0)
    slow.close()
    code, payload = _json_body(data)
    assert code == 408 and "not received within" in payload["error"]
    # Slow body too.
    slow = socket.create_connection((host, port), timeout=20)
    slow.sendall(b'POST /heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"repl')
    data = b"".join(iter(lambda: slow.recv(65536), b""))
    slow.close()
    assert _json_body(data)[0] == 408
    # Meanwhile others are served, and the idle connection still works.
    idle.request("GET", "/status")
    assert idle.getresponse().status == 200
    idle.close()


def test_keepalive_connection_survives_error_responses(server):
    host, port = parse_host_port(server.address)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("POST", "/heartbeat", body=b'{"replica_id": 3}')
    resp = conn.getresponse()
    assert resp.status == 400 and resp.read()
    conn.request("POST", "/heartbeat", body=b'{"replica_id": "a"}')
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == {"ok": True, "version": 1}
    conn.close()


def test_http10_and_connection_close_clients_get_their_quorum(server):
    """Not eligible for delivery by the forming thread: their own handler writes the response."""
    body = json.dumps({"member": {"replica_id": "old"}, "timeout": 10}).encode()
    raw = _raw(server, b"POST /quorum HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    code, payload = _json_body(raw)
    assert code == 200 and payload["quorum"]["participants"][0]["replica_id"] == "old"
    raw = _raw(
        server,
        b"POST /quorum HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body,
    )
    assert _json_body(raw)[0] == 200 and b"Connection: close" in raw


def test_a_dead_process_with_a_parked_and_a_heartbeat_connection(make_server):
    """Both bound connections of a process close together, in whatever order the loop sees them:
    the parked request is withdrawn and the group is disconnected once, at once."""
    s = make_server(min_replicas=2, quorum_tick=60.0)
    beat = _bound_connection(s, "a")
    host, port = parse_host_port(s.address)
    parked = socket.create_connection((host, port), timeout=10)
    parked.sendall(
        _post("/quorum", {"member": {"replica_id": "a"}, "timeout": 30}, b"X-Ftlaunch-Replica: a\r\n")
    )
    wait_for(lambda: s.status()["pending"] == ["a"] and group(s, "a")["connections"] == 2, what="a parked")
    parked.close()
    beat.close()
    wait_for(lambda: group(s, "a")["health"] == "disconnected", what="death noticed")
    assert s.status()["pending"] == [] and group(s, "a")["connections"] == 0
    assert [h["event"] for h in s.status()["history"] if h["replica_id"] == "a"] == ["disconnected", "joined"]


# ---------------------------------------------------------------------------------- event loop


def _post(path: str, obj: dict, extra: bytes = b"") -> bytes:
    body = json.dumps(obj).encode()
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
        % (path.encode(), len(body), extra)
    ) + body


def _read_responses(sock: socket.socket, n: int) -> list[tuple[int, dict]]:
    """Read ``n`` complete JSON responses from a keep-alive socket, in order."""
    buf, out = b"", []
    while len(out) < n:
        head_end = buf.find(b"\r\n\r\n")
        if head_end >= 0:
            head = buf[:head_end].decode("latin-1")
            length = int(
                next(
                    line.split(":", 1)[1]
                    for line in head.split("\r\n")
                    if line.lower().startswith("content-length")
                )
            )
            if len(buf) >= head_end + 4 + length:
                status = int(head.split(" ", 2)[1])
                out.append((status, json.loads(buf[head_end + 4 : head_end + 4 + length])))
                buf = buf[head_end + 4 + length :]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {len(out)} of {n} responses"
        buf += chunk
    return out


def test_request_trickling_in_byte_by_byte_is_parsed(server):
    """Partial requests are replayed through http.server's parser as bytes arrive."""
    host, port = parse_host_port(server.address)
    with socket.create_connection((host, port), timeout=10) as sock:
        for byte in _post("/v1/heartbeat", {"replica_id": "slow"}):
            sock.sendall(bytes([byte]))
            time.sleep(0.001)
        assert _read_responses(sock, 1) == [(200, {"ok": True, "version": 1})]
    assert group(server, "slow")["heartbeats"] == 1


def test_pipelined_requests_are_answered_in_order(server):
    host, port = parse_host_port(server.address)
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            _post("/heartbeat", {"replica_id": "p"})
            + _post("/heartbeat", {"replica_id": 7})
            + _post("/leave", {"replica_id": "p"})
        )
        got = _read_responses(sock, 3)
    assert [code for code, _ in got] == [200, 400, 200] and got[2][1]["left"] is True


def test_bytes_sent_while_parked_wait_for_the_answer(make_server):
    s = make_server(min_replicas=2)
    host, port = parse_host_port(s.address)
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            _post("/quorum", {"member": {"replica_id": "a"}, "timeout": 20})
            + _post("/heartbeat", {"replica_id": "a"})
        )
        wait_for(lambda: s.status()["pending"] == ["a"], what="a parked")
        time.sleep(0.05)
        assert group(s, "a")["heartbeats"] == 0  # the pipelined heartbeat waits behind the long poll
        client = LighthouseClient(s.address)
        assert client.quorum(QuorumMember("b"), 20).replica_ids == ("a", "b")
        (code, payload), (code2, _) = _read_responses(sock, 2)
        assert code == 200 and payload["quorum"]["participants"][0]["replica_id"] == "a" and code2 == 200
        client.close()
    assert group(s, "a")["heartbeats"] == 1


def test_expect_100_continue(server):
    host, port = parse_host_port(server.address)
    body = json.dumps({"replica_id": "e"}).encode()
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            b"POST /heartbeat HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
            % len(body)
        )
        interim = sock.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100"), interim
        sock.sendall(body)
        assert _read_responses(sock, 1) == [(200, {"ok": True, "version": 1})]


def test_many_groups_asking_at_once_share_one_quorum(make_server):
    """64 raw keep-alive connections ask in the same instant, twice: one answer each, same bytes."""
    n = 64
    s = make_server(min_replicas=n)
    host, port = parse_host_port(s.address)
    socks = [socket.create_connection((host, port), timeout=20) for _ in range(n)]
    try:
        for step in range(2):
            for i, sock in enumerate(socks):
                sock.sendall(
                    _post("/quorum", {"member": {"replica_id": f"g{i:02d}", "step": step}, "timeout": 20})
                )
            answers = [_read_responses(sock, 1)[0] for sock in socks]
            assert {code for code, _ in answers} == {200}
            assert len({json.dumps(payload, sort_keys=True) for _, payload in answers}) == 1
            assert len(answers[0][1]["quorum"]["participants"]) == n
    finally:
        for sock in socks:
            sock.close()


def test_idle_keepalive_is_closed_quietly(server):
    server.idle_timeout = 0.3  # shortened for the test
    sock = _bound_connection(server, "idle")
    t0 = time.monotonic()
    assert sock.recv(100) == b""  # the server closed it ...
    assert time.monotonic() - t0 < 5.0
    sock.close()
    wait_for(lambda: group(server, "idle")["connections"] == 0, what="connection gone")
    assert group(server, "idle")["health"] == "live"  # ... and that is not a death


def test_repeated_request_heads_on_a_keepalive_connection(server):
    """The same request line + headers reuse their earlier parse; anything else is parsed anew."""
    host, port = parse_host_port(server.address)
    with socket.create_connection((host, port), timeout=10) as sock:
        # Same head, different bodies (same length): each body is read and validated on its own.
        sock.sendall(_post("/heartbeat", {"replica_id": "h1"}) + _post("/heartbeat", {"replica_id": "h2"}))
        sock.sendall(_post("/heartbeat", {"replica_id": 12}))  # same length, invalid body
        assert [code for code, _ in _read_responses(sock, 3)] == [200, 200, 400]
        # A different path or length is a different head.
        sock.sendall(_post("/leave", {"replica_id": "h1"}) + _post("/heartbeat", {"replica_id": "h333"}))
        (c1, p1), (c2, _) = _read_responses(sock, 2)
        assert c1 == 200 and p1["left"] is True and c2 == 200
        # A head that ends the connection still does, also when repeated.
        sock.sendall(_post("/heartbeat", {"replica_id": "h1"}, b"Connection: close\r\n"))
        assert _read_responses(sock, 1)[0][0] == 200
        assert sock.recv(100) == b""
    assert {g["replica_id"] for g in server.status()["groups"]} == {"h2", "h333"} | {"h1"}
    assert group(server, "h1")["heartbeats"] == 1 and group(server, "h2")["heartbeats"] == 1
