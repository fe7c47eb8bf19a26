"""Store addresses ("host:port/prefix") and store clients for process-group rendezvous.

Every `configure` gets a fresh, unique prefix on a shared TCPStore, so the keys a backend uses to
rendezvous can never collide with those of an earlier (possibly half-failed) configuration.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ftlaunch.errors import CommunicationError

logger = logging.getLogger(__name__)

__all__ = ["StoreAddress", "parse_store_addr", "create_store_client"]


@dataclass(frozen=True)
class StoreAddress:
    """A parsed "host:port/prefix" address (host without IPv6 brackets)."""

    host: str
    port: int
    prefix: str

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}/{self.prefix}" if self.prefix else f"{host}:{self.port}"


def parse_store_addr(store_addr: str) -> StoreAddress:
    """Parse "host:port[/prefix]"; IPv6 hosts must be bracketed ("[::1]:1234/p").

    Raises ValueError with the offending address for anything else, so a typo in a rendezvous
    address fails at once instead of as a connect timeout a minute later.
    """
    if not isinstance(store_addr, str):
        raise TypeError(f"store address must be a str, got {type(store_addr).__name__}")
    addr = store_addr.strip()
    hostport, sep, prefix = addr.partition("/")
    if addr.startswith("["):
        end = addr.find("]")
        if end < 0:
            raise ValueError(f"bad store address {store_addr!r}: unterminated '[' in IPv6 host")
        host = addr[1:end]
        rest = addr[end + 1 :]
        if not rest.startswith(":"):
            raise ValueError(f"bad store address {store_addr!r}: expected ':port' after ']'")
        port_str, sep, prefix = rest[1:].partition("/")
    else:
        if hostport.count(":") != 1:
            raise ValueError(
                f"bad store address {store_addr!r}: expected 'host:port/prefix' "
                "(IPv6 hosts must be written in brackets, e.g. '[::1]:1234/prefix')"
            )
        host, _, port_str = hostport.partition(":")
    if not host:
        raise ValueError(f"bad store address {store_addr!r}: empty host")
    if not port_str.isdigit():
        raise ValueError(f"bad store address {store_addr!r}: port {port_str!r} is not a number")
    port = int(port_str)
    if not 0 < port < 65536:
        raise ValueError(f"bad store address {store_addr!r}: port {port} out of range 1..65535")
    if sep and not prefix:
        raise ValueError(f"bad store address {store_addr!r}: empty prefix after '/'")
    return StoreAddress(host=host, port=port, prefix=prefix)


def connect_store(addr: StoreAddress, timeout: timedelta) -> dist.TCPStore:
    """A client connection to the TCPStore server at `addr` (prefix ignored)."""
    try:
        return dist.TCPStore(addr.host, addr.port, is_master=False, timeout=timeout, wait_for_workers=False)
    except RuntimeError as e:
        raise CommunicationError(
            f"cannot connect to store {addr.host}:{addr.port} (prefix {addr.prefix!r}): {first_line(e)}"
        ) from e


def create_store_client(store_addr: str, timeout: timedelta | float = timedelta(seconds=60)) -> dist.Store:
    """A client of the TCPStore at `store_addr`, wrapped in a PrefixStore when a prefix is given.

    Connection failures raise `CommunicationError`; malformed addresses raise ValueError.
    """
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    addr = parse_store_addr(store_addr)
    store: dist.Store = connect_store(addr, timeout)
    if addr.prefix:
        store = dist.PrefixStore(addr.prefix, store)
    return store


def first_line(exc: BaseException) -> str:
    """The useful part of a c10d error message (they carry a C++ backtrace after the first lines)."""
    text = str(exc)
    cut = text.find("Exception raised from")
    if cut >= 0:
        text = text[:cut]
    text = text.strip()
    return text.splitlines()[0] if text else type(exc).__name__
