"""torchft's current way to set a group up: handles, `ReconfigureOptions`, ``reconfigure_with_store``.

Why a second API for what ``configure(store_addr, rank, world_size)`` already does: torchft moved
to the native reconfiguration API that torch >= 2.14 brings (``ProcessGroup.reconfigure(opts)``
with ``torch._C._distributed_c10d.ReconfigureOptions``), and scripts written for today's torchft
call that. The protocol, as torchft defines it:

1. every member asks its group for a *handle* (``pg.get_reconfigure_handle()``): an opaque string
   naming the group and a rendezvous store it hosts;
2. the members exchange handles out of band (the Manager through the lighthouse,
   `reconfigure_with_store` through a shared store) and agree on a ``uuid`` for the configuration;
3. each calls ``pg.reconfigure(opts)`` with the same ``opts.uuid`` and the same ordered
   ``opts.handles``: a member's rank is the index of its own handle, the world size is the number
   of handles, and all of them meet on the *first* handle's store under a prefix made of the uuid.

So a reconfigure is exactly a `configure` on ``<first handle's store>/ftlaunch/reconfigure/<uuid>``
with that rank and size: same semantics, same errors. This module holds the pieces that are not
the group's own: the options type (torch's when it has one), the handle format, the rendezvous
that handles and options imply, the store a group hosts for it, and the store-based exchange.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftlaunch import env
from ftlaunch.addresses import format_host_port, parse_address
from ftlaunch.errors import CommunicationError
from ftlaunch.process_group._store import create_store_client, first_line
from ftlaunch.process_group.work import NO_TIMEOUT
from ftlaunch.timeouts import as_timedelta

logger = logging.getLogger(__name__)

__all__ = [
    "HandleStore",
    "HandleWaitTimeout",
    "NativeReconfigureOptions",
    "ReconfigureOptions",
    "ReconfigureWork",
    "Rendezvous",
    "decode_handle",
    "encode_handle",
    "reconfigure_with_store",
    "rendezvous_of",
]


@dataclass
class _FallbackReconfigureOptions:
    """What torch >= 2.14 calls ``ReconfigureOptions``, for torch versions without it.

    ``uuid`` names the configuration (the same on every member, new for every reconfigure),
    ``handles`` are the members' ``get_reconfigure_handle()`` strings in rank order, and
    ``timeout`` bounds the reconfigure (None: the group's own timeout only).
    """

    uuid: int = 0
    handles: list[str] = field(default_factory=list)
    timeout: timedelta | None = None


#: torch's native options type when this torch has one (>= 2.14), else None.
NativeReconfigureOptions: Any = getattr(torch._C._distributed_c10d, "ReconfigureOptions", None)

#: The options ``reconfigure`` takes: torch's own type when it exists, an equivalent otherwise.
#: Both have ``uuid``, ``handles`` and ``timeout``; ``reconfigure`` reads any object that has them.
ReconfigureOptions: Any = NativeReconfigureOptions or _FallbackReconfigureOptions


# ------------------------------------------------------------------------------------------ handles
@dataclass(frozen=True)
class Handle:
    """One member's handle: the group's identity, the store it hosts, its global rank (if set)."""

    group_id: str
    store: str  # "host:port" of a TCPStore server the group hosts
    global_rank: int | None = None


def encode_handle(handle: Handle) -> str:
    """The handle as the opaque string peers exchange (JSON: readable in logs, no pickle)."""
    return json.dumps(
        {"id": handle.group_id, "store": handle.store, "global_rank": handle.global_rank}, sort_keys=True
    )


def decode_handle(text: str | bytes) -> Handle:
    """Parse a handle; ValueError naming it when it is not one of ours."""
    raw = text.decode() if isinstance(text, bytes) else text
    try:
        data = json.loads(raw)
        group_id, store, global_rank = data["id"], data["store"], data.get("global_rank")
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"not an ftlaunch reconfigure handle: {raw[:200]!r} ({e})") from None
    if not isinstance(group_id, str) or not isinstance(store, str):
        raise ValueError(f"not an ftlaunch reconfigure handle: {raw[:200]!r}")
    if global_rank is not None and (isinstance(global_rank, bool) or not isinstance(global_rank, int)):
        raise ValueError(f"bad global_rank in reconfigure handle: {raw[:200]!r}")
    # The address is checked where it is used (`rendezvous_of`: the first handle's): only that one
    # store is ever contacted, so a member may name a placeholder (torchft's "unused").
    return Handle(group_id, store, global_rank)


@dataclass(frozen=True)
class Rendezvous:
    """What a set of options means for one member: where to meet, as which rank, among how many."""

    store_addr: str
    rank: int
    world_size: int
    #: Every member's global rank, when all of them set one (`set_rank_info`); else None.
    global_ranks: list[int] | None


def rendezvous_of(opts: Any, group_id: str) -> Rendezvous:
    """The rendezvous ``opts`` implies for the member whose group id is ``group_id``.

    ValueError when ``opts`` lacks a uuid or handles, a handle is malformed, the first handle's
    store address (where all meet) is malformed, or ``group_id`` is not among the handles exactly once (a
    caller that forgot its own handle, or sent it twice).
    """
    uuid = getattr(opts, "uuid", None)
    raw = getattr(opts, "handles", None)
    if isinstance(uuid, bool) or not isinstance(uuid, int):
        raise ValueError(f"ReconfigureOptions.uuid must be an int, got {uuid!r}")
    if not raw:
        raise ValueError("ReconfigureOptions.handles is empty: pass every member's get_reconfigure_handle()")
    handles = [decode_handle(h) for h in raw]
    mine = [i for i, h in enumerate(handles) if h.group_id == group_id]
    if len(mine) != 1:
        raise ValueError(
            f"this group's handle appears {len(mine)} times in ReconfigureOptions.handles (must be "
            "exactly once)"
        )
    parse_address(handles[0].store, min_port=1)  # ValueError for a malformed address
    ranks = [h.global_rank for h in handles]
    global_ranks = None if any(r is None for r in ranks) else [int(r) for r in ranks if r is not None]
    return Rendezvous(
        store_addr=f"{handles[0].store}/ftlaunch/reconfigure/{uuid}",
        rank=mine[0],
        world_size=len(handles),
        global_ranks=global_ranks,
    )


class HandleStore:
    """The rendezvous store a group hosts for its handle: a TCPStore server, started on first use.

    Only the member whose handle comes first serves the rendezvous, but any member may be first,
    so every group that hands out a handle hosts one (one listening socket and one thread). It is
    published under ``FTLAUNCH_LOCAL_ADDR`` (the address the launcher chose for the job's other
    hosts), else ``socket.gethostname()``, as torchft's is.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: dist.TCPStore | None = None
        self._address = ""

    def address(self) -> str:
        """``host:port`` of the server, starting it if needed."""
        with self._lock:
            if self._server is None:
                host = env.local_addr() or socket.gethostname()
                try:
                    self._server = dist.TCPStore(
                        host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
                    )
                except RuntimeError as e:
                    raise CommunicationError(
                        f"cannot host a rendezvous store on {host}: {first_line(e)}"
                    ) from e
                self._address = format_host_port(host, self._server.port)
            return self._address

    def close(self) -> None:
        """Stop serving (handles given out before name a store that is gone)."""
        with self._lock:
            server, self._server = self._server, None
        del server  # the server thread stops when the last reference goes


# ------------------------------------------------------------------------------------------ the Work
class ReconfigureWork(dist.Work):
    """The Work ``reconfigure`` returns: the configure runs on a thread of its own.

    ``wait()`` returns when the group is usable and raises what configure raised
    (`CommunicationError`, or ValueError for misuse). It is bounded by ``timeout`` (the options'
    timeout) or the caller's own: past it the group is aborted (on another thread, so the caller
    never blocks on it) and `CommunicationError` is raised; the group stays errored until the next
    configure. Use the group only after ``wait()`` returned, as torchft's Manager does.
    """

    def __init__(
        self,
        describe: str,
        run: Callable[[], None],
        timeout: timedelta | None,
        on_timeout: Callable[[str], Exception],
    ) -> None:
        super().__init__()
        self._timeout = timeout
        self._on_timeout = on_timeout
        self._describe = describe
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future[None] = torch.futures.Future()

        def _run() -> None:
            # Completed (is_completed, wait) before the future is: whoever the future wakes sees a
            # completed Work.
            try:
                run()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                self._error = e
                self._done.set()
                self._future.set_exception(e)  # type: ignore[arg-type]  # torch's stub: Optional[T]
            else:
                self._done.set()
                self._future.set_result(None)

        threading.Thread(target=_run, name="ftlaunch-reconfigure", daemon=True).start()

    def wait(self, timeout: timedelta = NO_TIMEOUT) -> bool:
        limit = timeout if timeout else self._timeout
        if not self._done.wait(limit.total_seconds() if limit else None):
            raise self._on_timeout(f"{self._describe} did not complete within {limit}")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> torch.futures.Future:
        return self._future


# ------------------------------------------------------------------------------------------ exchange
class HandleWaitTimeout(CommunicationError, dist.DistStoreError):
    """A member did not publish its handle in time: ftlaunch's `CommunicationError` and torch's
    ``DistStoreError`` at once, so ``except`` clauses written for either catch it."""


def reconfigure_with_store(
    pg: Any,
    store_addr: str,
    rank: int,
    world_size: int,
    timeout: timedelta | float = timedelta(seconds=60),
) -> None:
    """Reconfigure ``pg`` with its peers by exchanging handles through the store at ``store_addr``.

    torchft's helper for code without a Manager: member ``rank`` of ``world_size`` publishes its
    handle under ``handle/<rank>``, rank 0 also a fresh ``uuid``; once all are there, each calls
    ``pg.reconfigure(opts)`` and waits for it. ``store_addr`` is ``host:port/prefix`` and, as for
    `configure`, must be new for every reconfiguration. Works on any group with the reconfigure API
    (ftlaunch's, and torch's native ones on torch >= 2.14).

    Raises `CommunicationError` when the store is unreachable or a peer does not publish its
    handle within ``timeout``; the latter is also torch's ``DistStoreError`` (`HandleWaitTimeout`),
    which torch code (and torchft's helper) raises for it. Whatever the reconfigure itself raises
    passes through.
    """
    timeout = as_timedelta(timeout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    # Looked up on the package (imported before any of its modules), as torchft's is: tests
    # written for torchft patch ``process_group.create_store_client`` to watch the exchange.
    connect = getattr(sys.modules.get("ftlaunch.process_group"), "create_store_client", create_store_client)
    store = connect(store_addr, timeout)
    if rank == 0:
        store.set("uuid", str(secrets.randbits(63)))
    store.set(f"handle/{rank}", pg.get_reconfigure_handle())
    keys = ["uuid", *(f"handle/{r}" for r in range(world_size))]
    try:
        store.wait(keys, timeout)
        values = store.multi_get(keys)
    except dist.DistError as e:
        # A store that answers but lacks a key is torch's DistStoreError: a member missing. Keep
        # that type (code written for torch catches it); a lost connection stays ours alone.
        error = HandleWaitTimeout if isinstance(e, dist.DistStoreError) else CommunicationError
        raise error(
            f"reconfigure_with_store: not every one of {world_size} members published its handle at "
            f"{store_addr} within {timeout}: {first_line(e)}"
        ) from e
    opts = ReconfigureOptions()
    opts.uuid = int(values[0])
    opts.handles = [v.decode() for v in values[1:]]
    opts.timeout = timeout
    pg.reconfigure(opts).wait()
