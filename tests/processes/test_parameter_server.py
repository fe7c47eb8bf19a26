"""torchft's ParameterServer on ftlaunch's groups: real client processes, concurrent sessions, a
client SIGKILLed mid-session (only its session ends), and a clean shutdown."""

from __future__ import annotations

import threading
import time

import pg_scenarios as sc
import pytest
from pg_helpers import WorkerPool, start_unmarked_resource_tracker

from ftlaunch.errors import CommunicationError
from ftlaunch.parameter_server import ParameterServer

start_unmarked_resource_tracker()


def _wait_for(cond: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(180)
def test_sessions_from_client_processes_and_a_killed_client() -> None:
    server = sc.AddServer()
    assert isinstance(server, ParameterServer)
    try:
        address = server.address()
        assert address.startswith("http://127.0.0.1:") and address.endswith("/new_session")
        with WorkerPool(3) as pool:
            # Three clients at once, five exchanges each: every contribution lands exactly once.
            values = [1.0, 10.0, 100.0]
            seen = pool.run([0, 1, 2], sc.ps_client, [(address, 5, v) for v in values], timeout=120)
            assert server.total == 5 * sum(values)
            for v, totals in zip(values, seen, strict=True):
                assert totals == sorted(totals) and len(totals) == 5
                assert all(t >= v * (k + 1) for k, t in enumerate(totals))
            assert _wait_for(lambda: server.num_sessions() == 0, 30)
            assert len(server.ended) == 3

            # A client dies mid-session: its session ends with a communication error, the server
            # keeps serving new sessions.
            assert pool.run([0], sc.ps_client_then_hang, [(address,)], timeout=60) == [server.total]
            assert server.num_sessions() == 1
            pool.kill(0)
            assert _wait_for(lambda: server.num_sessions() == 0, 30), "the dead client's session did not end"
            assert len(server.ended) == 3  # it ended by the error, not by the protocol
            before = server.total
            assert pool.run([1], sc.ps_client, [(address, 2, 7.0)], timeout=60) == [
                [before + 7.0, before + 14.0]
            ]
    finally:
        server.shutdown()
    assert not [t for t in threading.enumerate() if t.name == "ftlaunch-ps-http" and t.is_alive()]


@pytest.mark.timeout(60)
def test_bad_addresses_are_communication_errors() -> None:
    server = sc.AddServer()
    try:
        bad = server.address().replace("/new_session", "/nope")
        with pytest.raises(CommunicationError, match="cannot start a session"):
            sc.AddServer.new_session(bad, timeout=5)
    finally:
        server.shutdown()
    with pytest.raises(CommunicationError, match="cannot start a session"):
        sc.AddServer.new_session(server.address(), timeout=5)  # shut down: refused
    server.shutdown()  # idempotent


class _QuickServer(sc.AddServer):
    session_timeout = 2.0


@pytest.mark.timeout(90)
def test_shutdown_ends_an_idle_session() -> None:
    """A session whose client went quiet (alive, not sending) is aborted by shutdown: an
    in-process gloo group cannot be interrupted, so it ends within its op timeout."""
    server = _QuickServer()
    client = _QuickServer.new_session(server.address())
    try:
        assert _wait_for(lambda: server.num_sessions() == 1, 30)
        t0 = time.monotonic()
        server.shutdown()
        assert server.num_sessions() == 0 and server.ended == []
        assert time.monotonic() - t0 < 15
    finally:
        client.shutdown()
