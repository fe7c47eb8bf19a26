"""Network addresses, parsed in one place: ``host:port``, ``[v6]:port``, ``http://host:port`` and
store addresses ``host:port/prefix``.

Every component names peers this way (the lighthouse, the replica groups' stores, the rendezvous
endpoint); one parser means one set of rules and one set of
error messages. The splitting itself is `urllib.parse`'s (IPv6 brackets, port range and digits);
this module adds the rules urllib leaves open: a port is required unless a default is given, IPv6
hosts must be bracketed, and a lighthouse address has no path.

It also decides which of this machine's addresses the job's other hosts can reach
(`reachable_address`): every address a replica group publishes -- its store, its state transport,
its Gloo connections -- is one of those, so a group on another host can use it.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = [
    "Address",
    "format_host_port",
    "http_url",
    "is_local_host",
    "parse_address",
    "parse_host_port",
    "parse_store_addr",
    "primary_address",
    "reachable_address",
    "route_source",
]


@dataclass(frozen=True)
class Address:
    """A parsed ``host:port[/prefix]`` (``host`` without IPv6 brackets)."""

    host: str
    port: int
    prefix: str = ""

    @property
    def host_port(self) -> str:
        return format_host_port(self.host, self.port)

    @property
    def url(self) -> str:
        """``http://host:port``: the form clients of an HTTP service (the lighthouse) use."""
        return f"http://{self.host_port}"

    def __str__(self) -> str:
        return f"{self.host_port}/{self.prefix}" if self.prefix else self.host_port


#: The name process-group code has always used for a parsed store address.
StoreAddress = Address


def format_host_port(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def http_url(host: str, port: int) -> str:
    return f"http://{format_host_port(host, port)}"


def parse_address(
    text: str,
    *,
    default_port: int | None = None,
    allow_http: bool = False,
    allow_prefix: bool = False,
    min_port: int = 0,
) -> Address:
    """Parse ``host:port[/prefix]``; ValueError naming ``text`` for anything malformed.

    ``allow_http`` accepts an ``http://`` scheme (and a trailing ``/``); ``allow_prefix`` accepts a
    path, returned without its leading ``/`` as ``prefix``. A bare host takes ``default_port``.
    """
    if not isinstance(text, str):
        raise TypeError(f"an address must be a str, got {type(text).__name__}")
    s = text.strip()
    if "://" in s:
        scheme = s.split("://", 1)[0]
        if not (allow_http and scheme.lower() == "http"):
            raise ValueError(f"unsupported scheme in address {text!r} (only http:// is served)")
        s = s.split("://", 1)[1]
        if not allow_prefix:
            s = s.rstrip("/")
    netloc, slash, path = s.partition("/")
    if slash and not allow_prefix:
        raise ValueError(f"address {text!r} must not contain a path")
    if slash and not path:
        raise ValueError(f"address {text!r} has an empty prefix after '/'")
    if not netloc.startswith("[") and netloc.count(":") > 1:
        raise ValueError(f"IPv6 address {text!r} must be written [addr]:port")
    if any(c in netloc for c in "@?#"):
        raise ValueError(f"bad address {text!r}")
    try:
        port = urlsplit("//" + netloc).port  # validates brackets, digits and range
    except ValueError as e:
        raise ValueError(f"bad address {text!r}: {e}") from None
    if netloc.startswith("["):
        host, after = netloc[1:].split("]", 1)
        if after and not after.startswith(":"):
            raise ValueError(f"bad address {text!r}: expected ':port' after ']'")
    else:
        host = netloc.partition(":")[0]  # urlsplit's .hostname would lower-case it
    if not host:
        raise ValueError(f"address {text!r} has no host")
    if port is None:
        if netloc.endswith(":"):
            raise ValueError(f"address {text!r} has an empty port")
        if default_port is None:
            raise ValueError(f"address {text!r} has no port")
        port = default_port
    if port < min_port:
        raise ValueError(f"port {port} of address {text!r} is out of range {min_port}..65535")
    return Address(host=host, port=port, prefix=path)


def parse_host_port(text: str, *, default_port: int | None = None) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` / ``http://host:port[/]`` -> ``(host, port)``; ValueError otherwise."""
    a = parse_address(text, default_port=default_port, allow_http=True)
    return a.host, a.port


def parse_store_addr(store_addr: str) -> Address:
    """Parse a store address ``host:port[/prefix]``; an IPv6 host bracketed (``[::1]:1234/p``) or bare.

    A store address always has a port, so a bare IPv6 host is unambiguous: the field after the last
    colon is the port and the rest must be an IPv6 address (``fdaa::5:29521/p``; torchft's and
    torch's store addresses are written so, from a host's address and a port joined by ``:``).
    Raises ValueError ("bad store address ...") for anything else, so a typo in a rendezvous address
    fails at once instead of as a connect timeout a minute later.
    """
    try:
        return parse_address(_bracket_bare_ipv6(store_addr), allow_prefix=True, min_port=1)
    except ValueError as e:
        raise ValueError(f"bad store address {store_addr!r}: {e}") from None


def _bracket_bare_ipv6(store_addr: str) -> str:
    """``v6:port[/prefix]`` -> ``[v6]:port[/prefix]`` when the part before the last colon is an
    IPv6 address; anything else unchanged (the parser then says what is wrong with it)."""
    if not isinstance(store_addr, str) or store_addr.startswith("[") or "://" in store_addr:
        return store_addr
    netloc, slash, path = store_addr.partition("/")
    if netloc.count(":") < 2:
        return store_addr
    host, _, port = netloc.rpartition(":")
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return store_addr
    return f"[{host}]:{port}{slash}{path}"


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, our hostname, or one of our addresses)."""
    if host in ("localhost", "", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            # An IPv4/IPv6 sockaddr starts with the address text (typeshed allows int for other families).
            ips = {str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
        except (OSError, UnicodeError):
            return False
    else:
        if ip.is_loopback:
            return True
        ips = {str(ip)}
    if any(_is_loopback(i) for i in ips):
        return True
    try:
        import psutil

        local = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    except Exception:  # noqa: BLE001 - best effort; a false "not local" only means we do not host
        return False
    return bool(ips & local)


def _is_loopback(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def _is_loopback_name(host: str) -> bool:
    """``host`` is loopback by its very spelling (not by what it resolves to here)."""
    return host.strip("[]").lower() in ("localhost", "localhost.localdomain") or _is_loopback(
        host.strip("[]")
    )


def route_source(host: str) -> str | None:
    """The local address this machine's packets to ``host`` leave from (None: no route, or
    ``host`` does not resolve). A UDP ``connect`` only looks the route up: nothing is sent."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0]).split("%")[0]
        except OSError:
            continue
    return None


@functools.cache
def primary_address() -> str:
    """This machine's address for the rest of the network: the one its host name resolves to when
    that is not loopback, else the source of its default route, else its first non-loopback
    interface address, else ``127.0.0.1`` (a machine with no network)."""
    for name in (socket.getfqdn(), socket.gethostname()):
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            continue
        for info in infos:
            ip = str(info[4][0]).split("%")[0]
            if not _is_loopback(ip) and not ip.startswith("fe80"):
                return ip
    for probe in ("192.0.2.1", "2001:db8::1"):  # documentation addresses: only the route matters
        src = route_source(probe)
        if src is not None and not _is_loopback(src):
            return src
    try:
        import psutil

        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                ip = a.address.split("%")[0]
                if a.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(ip):
                    if not ip.startswith("fe80"):
                        return ip
    except Exception:  # noqa: BLE001, S110 - best effort; loopback below
        pass
    return "127.0.0.1"


def reachable_address(peer_host: str) -> str:
    """The address of this machine that the hosts of a job coordinated from ``peer_host`` (the
    lighthouse's host) can reach: the local address of the route to ``peer_host``.

    Loopback only when the job says it is on one host: ``peer_host`` is spelled as loopback
    (``127.0.0.1``, ``localhost``, ``::1``). A lighthouse named by a host name or address that
    happens to be this machine (Debian maps the host name to ``127.0.1.1``) may serve other hosts
    too, so then this machine's `primary_address` is used.
    """
    src = route_source(peer_host)
    if src is not None and not _is_loopback(src):
        return src
    if _is_loopback_name(peer_host):
        return src or "127.0.0.1"
    return primary_address()
