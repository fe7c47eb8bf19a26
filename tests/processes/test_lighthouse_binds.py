"""Where a lighthouse listens and how torchft spells it: v4, v6 and dual-stack binds, each reachable at
the address it advertises, and torchft's ``LighthouseServer`` form."""

from __future__ import annotations

import socket

import pytest

from ftlaunch.addresses import parse_host_port
from ftlaunch.errors import ConfigurationError
from ftlaunch.lighthouse import LighthouseClient, LighthouseServer, QuorumMember

pytestmark = pytest.mark.timeout(60)

TOKEN = "bind-test-token"


def _has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_v6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
needs_dualstack = pytest.mark.skipif(
    not (_has_ipv6_loopback() and socket.has_dualstack_ipv6()), reason="no dual-stack IPv6 sockets here"
)


def _works(address: str) -> None:
    """A group joins a quorum at ``address`` (a request that needs the token and a round trip)."""
    client = LighthouseClient(address, token=TOKEN, connect_timeout=5)
    try:
        assert client.quorum(QuorumMember("a", step=1), timeout=10).replica_ids == ("a",)
        client.leave("a")  # a graceful exit frees the id for the next client (incarnation)
    finally:
        client.close()


def _port(server_address: str) -> int:
    return parse_host_port(server_address)[1]


def test_ipv4_bind_is_reachable_at_its_address() -> None:
    with LighthouseServer("127.0.0.1:0", token=TOKEN).start() as s:
        assert s.address.startswith("http://127.0.0.1:")
        _works(s.address)


@needs_v6
def test_ipv6_bind_is_reachable_at_its_address() -> None:
    with LighthouseServer("[::1]:0", token=TOKEN).start() as s:
        assert s.address.startswith("http://[::1]:")
        _works(s.address)


@needs_dualstack
def test_ipv6_wildcard_is_dual_stack_and_its_advertised_address_connects() -> None:
    """torchft's usual bind ``[::]:PORT``: v4 and v6 clients reach it, and so does its advertised
    address (this host's name, which often resolves to an IPv4 address only)."""
    with LighthouseServer("[::]:0", token=TOKEN).start() as s:
        port = _port(s.address)
        assert parse_host_port(s.address)[0] == socket.gethostname()
        _works(s.address)
        _works(f"127.0.0.1:{port}")
        _works(f"[::1]:{port}")


def test_ipv4_wildcard_advertises_a_connectable_name() -> None:
    with LighthouseServer("0.0.0.0:0", token=TOKEN).start() as s:
        _works(s.address)
        _works(f"127.0.0.1:{_port(s.address)}")


@pytest.mark.parametrize("bind", ["0.0.0.0:0", "[::]:0"])
def test_reachable_bind_without_token_is_refused(bind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match="without a job token"):
        LighthouseServer(bind)


# ------------------------------------------------------------------------- torchft's form


def test_torchft_form_serves_on_construction_in_milliseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchft: ``LighthouseServer(bind, min_replicas, join_timeout_ms=, quorum_tick_ms=,
    heartbeat_timeout_ms=)`` is serving once constructed; ``address()`` is a method; ``shutdown()``."""
    from ftlaunch.coordination import LighthouseServer as TorchftLighthouseServer

    monkeypatch.setenv("FTLAUNCH_TOKEN", TOKEN)  # workers read the same variable
    lh = TorchftLighthouseServer(
        bind="[::]:0" if socket.has_dualstack_ipv6() else "0.0.0.0:0",
        min_replicas=1,
        join_timeout_ms=1500,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=2500,
    )
    try:
        address = lh.address()
        assert isinstance(address, str) and address.startswith("http://")
        options = lh.server.status()["options"]
        assert options == {
            "min_replicas": 1,
            "join_timeout": 1.5,
            "heartbeat_timeout": 2.5,
            "quorum_tick": 0.05,
            "admin": True,
        }
        _works(address)
    finally:
        lh.shutdown()
    with pytest.raises(Exception):  # noqa: B017 - stopped: nothing answers any more
        LighthouseClient(address, token=TOKEN, connect_timeout=0.5).heartbeat("a")


def test_torchft_form_defaults_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from ftlaunch.coordination import LighthouseServer as TorchftLighthouseServer

    monkeypatch.delenv("FTLAUNCH_TOKEN", raising=False)
    with TorchftLighthouseServer("127.0.0.1:0", 2) as lh:  # torchft's defaults: 60 s, 100 ms, 5 s
        assert lh.server.status()["options"] == {
            "min_replicas": 2,
            "join_timeout": 60.0,
            "heartbeat_timeout": 5.0,
            "quorum_tick": 0.1,
            "admin": False,
        }
    with pytest.raises(ConfigurationError, match="join_timeout_ms"):
        TorchftLighthouseServer("127.0.0.1:0", 1, join_timeout_ms=-5)
    with pytest.raises(ConfigurationError, match="without a job token"):
        TorchftLighthouseServer("0.0.0.0:0", 1)
