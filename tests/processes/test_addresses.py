"""ftlaunch.addresses: the one parser of host:port, lighthouse URLs and store addresses."""

from __future__ import annotations

import pytest

from ftlaunch.addresses import (
    Address,
    format_host_port,
    http_url,
    is_local_host,
    parse_address,
    parse_host_port,
    parse_store_addr,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("h:80", ("h", 80)),
        ("HostName:80", ("HostName", 80)),  # case kept: it is compared with gethostname()
        ("http://h:1/", ("h", 1)),
        ("HTTP://h:1", ("h", 1)),
        ("[::1]:8", ("::1", 8)),
        ("http://[::1]:8/", ("::1", 8)),
        ("[::]:0", ("::", 0)),
        (" 127.0.0.1:29510 ", ("127.0.0.1", 29510)),
    ],
)
def test_parse_host_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("h", "has no port"),
        ("h:", "empty port"),
        ("h:abc", "bad address"),
        ("h:70000", "bad address"),
        ("ftp://h:1", "unsupported scheme"),
        ("http://h:1/x", "must not contain a path"),
        ("::1:80", r"must be written \[addr\]:port"),
        ("[::1", "bad address"),
        ("[::1]80", "expected ':port' after ']'"),
        (":80", "has no host"),
        ("user@h:80", "bad address"),
    ],
)
def test_parse_host_port_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_host_port(text)


def test_default_port_and_formatting() -> None:
    assert parse_host_port("h", default_port=7) == ("h", 7)
    assert parse_host_port("[::1]", default_port=7) == ("::1", 7)
    assert format_host_port("::1", 5) == "[::1]:5" and format_host_port("h", 5) == "h:5"
    assert http_url("::1", 5) == "http://[::1]:5"
    a = parse_address("[fe80::1%eth0]:5/p/q", allow_prefix=True)
    assert a == Address("fe80::1%eth0", 5, "p/q") and str(a) == "[fe80::1%eth0]:5/p/q"
    assert a.url == "http://[fe80::1%eth0]:5"
    with pytest.raises(TypeError):
        parse_address(5)  # type: ignore[arg-type]


def test_store_address_rules() -> None:
    assert parse_store_addr("h:1/a/b") == Address("h", 1, "a/b")
    for bad in ("h:0/p", "h:1/", "http://h:1/p"):
        with pytest.raises(ValueError, match="bad store address"):
            parse_store_addr(bad)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("::1:29521/job/0", Address("::1", 29521, "job/0")),
        ("fdaa:0:1:2:3:4:5:6:29521/p", Address("fdaa:0:1:2:3:4:5:6", 29521, "p")),
        ("fe80::7:80", Address("fe80::7", 80, "")),
    ],
)
def test_store_address_takes_a_bare_ipv6_host(text: str, expected: Address) -> None:
    # A store address always has a port: the field after the last colon is it.
    assert parse_store_addr(text) == expected
    assert str(parse_store_addr(str(expected))) == str(expected)  # written back bracketed


@pytest.mark.parametrize("text", ["a:b:c/p", "fe80::1/p", "::1:0/p", "::1:/p", "::1:99999/p"])
def test_store_address_bare_ipv6_still_needs_a_valid_port(text: str) -> None:
    with pytest.raises(ValueError, match="bad store address"):
        parse_store_addr(text)


def test_is_local_host() -> None:
    assert is_local_host("localhost") and is_local_host("127.0.0.1") and is_local_host("::1")
    assert not is_local_host("192.0.2.1")  # TEST-NET-1, never assigned
    assert not is_local_host("no-such-host.invalid")


def test_reachable_address_is_loopback_only_when_the_peer_is_spelled_as_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The address a group publishes: the route's source toward the lighthouse; loopback only
    for a lighthouse addressed as loopback. A name that resolves to loopback here (Debian's
    ``127.0.1.1 hostname``) may be how other hosts reach it too: then this machine's primary
    address is published, never loopback."""
    from ftlaunch import addresses

    assert addresses.reachable_address("127.0.0.1") == "127.0.0.1"
    assert addresses.reachable_address("localhost") == "127.0.0.1"
    monkeypatch.setattr(
        addresses, "route_source", lambda host: {"lh": "127.0.1.1", "far": "10.1.2.3"}.get(host)
    )
    monkeypatch.setattr(addresses, "primary_address", lambda: "192.0.2.7")
    assert addresses.reachable_address("far") == "10.1.2.3"  # the route to another host
    assert addresses.reachable_address("lh") == "192.0.2.7"  # this machine, by a name
    assert addresses.reachable_address("unresolvable") == "192.0.2.7"


def test_route_source_and_primary_address_are_this_machines() -> None:
    from ftlaunch.addresses import is_local_host, primary_address, route_source

    assert route_source("127.0.0.1") == "127.0.0.1"
    assert route_source("no-such-host.invalid") is None
    assert is_local_host(primary_address())
