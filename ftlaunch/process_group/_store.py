"""Store clients for process-group rendezvous (addresses "host:port/prefix" are parsed by
`ftlaunch.addresses`).

Every `configure` gets a fresh, unique prefix on a shared TCPStore, so the keys a backend uses to
rendezvous can never collide with those of an earlier (possibly half-failed) configuration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ftlaunch.addresses import StoreAddress, parse_store_addr
from ftlaunch.errors import CommunicationError
from ftlaunch.timeouts import as_timedelta

logger = logging.getLogger(__name__)

__all__ = ["connect_store", "create_store_client", "first_line"]


def connect_store(
    addr: StoreAddress, timeout: timedelta, tcp_store: Callable[..., dist.Store] = dist.TCPStore
) -> dist.Store:
    """A client connection to the TCPStore server at `addr` (prefix ignored)."""
    try:
        return tcp_store(
            host_name=addr.host, port=addr.port, is_master=False, timeout=timeout, wait_for_workers=False
        )
    except RuntimeError as e:
        raise CommunicationError(
            f"cannot connect to store {addr.host}:{addr.port} (prefix {addr.prefix!r}): {first_line(e)}"
        ) from e


def create_store_client(
    store_addr: str,
    timeout: timedelta | float = timedelta(seconds=60),
    tcp_store: Callable[..., dist.Store] = dist.TCPStore,
    prefix_store: Callable[[str, dist.Store], dist.Store] = dist.PrefixStore,
) -> dist.Store:
    """A client of the TCPStore at `store_addr`, wrapped in a PrefixStore when a prefix is given.

    Connection failures raise `CommunicationError`; malformed addresses raise ValueError. The store
    classes are parameters so that the package's public form can pass the ones it names (see
    ``ftlaunch.process_group.create_store_client``).
    """
    addr = parse_store_addr(store_addr)
    store = connect_store(addr, as_timedelta(timeout), tcp_store)
    if addr.prefix:
        store = prefix_store(addr.prefix, store)
    return store


def first_line(exc: BaseException) -> str:
    """The useful part of a c10d error message (they carry a C++ backtrace after the first lines)."""
    text = str(exc)
    cut = text.find("Exception raised from")
    if cut >= 0:
        text = text[:cut]
    text = text.strip()
    return text.splitlines()[0] if text else type(exc).__name__
