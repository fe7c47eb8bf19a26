"""In-process reconfigurable groups: `ProcessGroupWrapper` and the Gloo and NCCL groups built on it.

`ProcessGroupWrapper` forwards every operation to the backend object of the current
configuration (a torch ``Backend`` such as gloo's, or another ftlaunch group). Forwarding is one
Python call plus one thin `FtWork` per op — no copies, no threads — so the throughput is the
backend's own. `configure` drops the old backend (its destructor joins gloo's worker threads and
closes its sockets; a dead peer makes those finish at once, a hung one within the timeout) and
builds a new one on the new store prefix.

The wrappers that change what an op does live beside it: `error_swallowing` (errors become
reports), and `dummy` (no communication at all) is a plain `ProcessGroup`.
"""

from __future__ import annotations

import logging
import threading
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from ftlaunch import env
from ftlaunch.addresses import parse_store_addr, reachable_address
from ftlaunch.errors import CommunicationError
from ftlaunch.process_group._store import connect_store, first_line
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.process_group.work import FtWork
from ftlaunch.timeouts import as_timedelta

logger = logging.getLogger(__name__)

__all__ = ["ProcessGroupGloo", "ProcessGroupNCCL", "ProcessGroupWrapper"]


class ProcessGroupWrapper(ProcessGroup):
    """Wraps a process group and forwards every operation to it.

    With ``pg`` an ftlaunch group, `configure` reconfigures it. Subclasses that own their backend
    (Gloo, NCCL) implement `_create_pg` and get a fresh backend on every `configure`.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup | timedelta | float | None = None,
        timeout: timedelta | float = timedelta(seconds=60),
    ) -> None:
        """``ProcessGroupWrapper(pg)`` (documented torchft) and ``ProcessGroupWrapper(timeout, pg=pg)``
        (torchft today, timeout first) both work: a duration in first place is the timeout."""
        if isinstance(pg, (timedelta, int, float)) and not isinstance(pg, bool):
            timeout, pg = pg, None
        super().__init__(0, 1)
        self._pg: Any = pg
        self._timeout = as_timedelta(timeout)
        self._store_clients: dict[tuple[str, int], dist.Store] = {}
        self._lock = threading.RLock()
        self._wrap_works = not isinstance(pg, ProcessGroup)
        self._live_works: weakref.WeakSet[FtWork] = weakref.WeakSet()
        self._works_lock = threading.Lock()  # WeakSet is not safe against concurrent add/iterate
        self._abort_pending: int | None = None  # generation to abort, set on a backend thread
        # A Gloo/NCCL group given an ftlaunch group to wrap forwards to it instead of building
        # backends of its own (torchft's ``ProcessGroupNCCL(pg=...)``).
        self._forwarding = isinstance(pg, ProcessGroup)

    @property
    def parent(self) -> Any:
        """The current underlying group/backend (None before the first configure)."""
        return self._pg

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> Any:
        """Build this configuration's backend; only subclasses that own a backend implement it."""
        raise NotImplementedError

    def _owns_backend(self) -> bool:
        return type(self)._create_pg is not ProcessGroupWrapper._create_pg and not self._forwarding

    # ---- identity ---------------------------------------------------------------------------
    def rank(self) -> int:
        pg = self._pg
        return pg.rank() if isinstance(pg, ProcessGroup) else self._rank

    def size(self) -> int:
        pg = self._pg
        return pg.size() if isinstance(pg, ProcessGroup) else self._world_size

    def getBackendName(self) -> str:  # noqa: N802
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            return pg.getBackendName()
        return "ftlaunch-wrapper"

    def errored(self) -> Exception | None:
        self._run_pending_abort()
        pg = self._pg
        if self._failures.error is None and isinstance(pg, ProcessGroup):
            return pg.errored()
        return self._failures.error

    def __repr__(self) -> str:
        # A wrapper around a group names that group (torchft's form); one that owns its backend
        # (Gloo, NCCL) shows its own configuration.
        if self._pg is not None and not self._owns_backend():
            return f"{type(self).__name__}(pg={self._pg!r})"
        return super().__repr__()

    def _describe(self) -> str:
        pg = self._pg
        if isinstance(pg, ProcessGroup) and not self._owns_backend():
            return pg._describe()
        return super()._describe()

    # ---- lifecycle --------------------------------------------------------------------------
    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        with self._lock:
            self._begin_configure(store_addr, rank, world_size)
            self._abort_pending = None  # that generation's backend is released below
            if not self._owns_backend():
                if not isinstance(self._pg, ProcessGroup):
                    raise ValueError(
                        f"{type(self).__name__} wraps {type(self._pg).__name__}, which cannot be reconfigured"
                    )
                self._pg.configure(store_addr, rank, world_size)
                return
            self._release_backend(abort=True)
            try:
                self._pg = self._create_pg(self._prefixed_store(store_addr), rank, world_size)
            except (CommunicationError, RuntimeError, TimeoutError) as e:
                self._release_backend(abort=True)
                self._store_clients = {}  # the connection itself may be what failed
                raise self._failures.record("configure", e) from e
            self._wrap_works = True
            logger.info("ftlaunch.process_group: configured %s", self._describe())

    def _prefixed_store(self, store_addr: str) -> dist.Store:
        """The store of this configuration: our cached client of its server, plus the prefix.

        One client connection per group and server, reused by every configure: connecting is
        the slow part of a reconfigure (and now and then takes seconds).
        """
        addr = parse_store_addr(store_addr)
        key = (addr.host, addr.port)
        client = self._store_clients.get(key)
        if client is None:
            client = connect_store(addr, self._timeout)
            self._store_clients = {key: client}  # only the current server's client is kept
        else:
            client.set_timeout(self._timeout)
        return dist.PrefixStore(addr.prefix, client) if addr.prefix else client

    def _release_backend(self, abort: bool) -> None:
        """Drop the owned backend and store client (their destructors free threads and sockets).

        Outstanding Works of this backend are released too (they would keep its sockets open);
        waiting on them afterwards raises CommunicationError.
        """
        old, self._pg = self._pg, None
        with self._works_lock:
            works, self._live_works = list(self._live_works), weakref.WeakSet()
        for work in works:
            work.release()
        if old is None:
            return
        try:
            if abort:
                old.abort()
            else:
                old.shutdown()
        except Exception as e:  # a broken backend may refuse; dropping it is what matters
            logger.debug("ftlaunch.process_group: releasing backend: %s", first_line(e))
        del old

    def _on_first_error(self, generation: int, on_backend_thread: bool) -> None:
        """Close the backend at once after a failure, so that peers blocked on us fail fast.

        A failed gloo context is unusable anyway, and while it lives its sockets stay open: a
        peer waiting for data from us would sit out the whole timeout. Closing them turns one
        peer's death into an immediate error everywhere. A backend thread (future callback) must
        not destroy its own backend, so there the close is left to the next call from a user
        thread (the next op, `errored`, `configure`).
        """
        if not self._owns_backend():
            return
        if on_backend_thread:
            self._abort_pending = generation
            return
        self._close_after_error(generation)

    def _close_after_error(self, generation: int) -> None:
        with self._lock:
            self._abort_pending = None
            if generation != self._failures.generation:
                return  # already reconfigured
            self._release_backend(abort=True)
            logger.info("ftlaunch.process_group: closed %s after a communication error", self._describe())

    def _run_pending_abort(self) -> None:
        generation = self._abort_pending
        if generation is not None:
            self._close_after_error(generation)

    def wait_ready(self, timeout: timedelta | float | None = None) -> None:
        pg = self._pg  # a backend built at configure is ready then; a wrapped group may need a wait
        if isinstance(pg, ProcessGroup) and not self._owns_backend():
            pg.wait_ready(timeout)

    def abort(self) -> None:
        with self._lock:
            if self._owns_backend():
                if self._pg is not None:
                    self._failures.record("abort", "process group aborted", quiet=True)
                self._release_backend(abort=True)
            elif isinstance(self._pg, ProcessGroup):
                self._pg.abort()

    def prepare_abort(self) -> None:
        pg = self._pg  # a backend of its own needs nothing; a wrapped ftlaunch group may (Baby)
        if isinstance(pg, ProcessGroup) and not self._owns_backend():
            pg.prepare_abort()

    def shutdown(self) -> None:
        super().shutdown()
        with self._lock:
            self._closed = True
            if self._owns_backend():
                self._release_backend(abort=False)
                self._store_clients = {}
            elif isinstance(self._pg, ProcessGroup):
                self._pg.shutdown()

    def set_timeout(self, timeout: timedelta | float) -> None:
        self._timeout = as_timedelta(timeout)
        pg = self._pg
        if pg is not None and hasattr(pg, "set_timeout"):
            pg.set_timeout(self._timeout)

    # ---- forwarding -------------------------------------------------------------------------
    def _current(self, op: str) -> Any:
        if self._abort_pending is not None:
            self._run_pending_abort()
        if self._failures.error is not None and self._owns_backend():
            raise self._failures.error  # errored: fail fast until the next configure
        pg = self._pg
        if pg is None:
            raise self._unusable_error(op)
        return pg

    def _forward(self, op: str, method: str, *args: Any, peer: int | None = None) -> dist.Work:
        pg = self._current(op)
        try:
            work = getattr(pg, method)(*args)
        except Exception as e:
            raise self._call_error(op, e, peer) from e
        if self._wrap_works:
            ft = FtWork(self._failures, work, op, peer, self._result_devices())
            with self._works_lock:
                self._live_works.add(ft)
            return ft
        return work

    def _result_devices(self) -> tuple[torch.device, ...]:
        """The CUDA devices an op's results live on, for a CUDA-aware future (NCCL); none here."""
        return ()

    def _do_allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> dist.Work:
        return self._forward("allreduce", "allreduce", tensors, opts)

    def _do_allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions
    ) -> dist.Work:
        return self._forward("allreduce_coalesced", "allreduce_coalesced", tensors, opts)

    def _do_allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: AllgatherOptions
    ) -> dist.Work:
        return self._forward("allgather", "allgather", outputs, inputs, opts)

    def _do_all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions
    ) -> dist.Work:
        return self._forward("all_gather_single", "_allgather_base", output, input, opts)

    def _do_all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllgatherOptions
    ) -> dist.Work:
        if isinstance(self._pg, ProcessGroup):
            return self._forward(
                "all_gather_single_coalesced", "all_gather_single_coalesced", outputs, inputs, opts
            )
        return super()._do_all_gather_single_coalesced(outputs, inputs, opts)

    def _do_broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> dist.Work:
        return self._forward("broadcast", "broadcast", tensors, opts)

    def _do_reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ReduceScatterOptions
    ) -> dist.Work:
        return self._forward("reduce_scatter", "reduce_scatter", outputs, inputs, opts)

    def _do_reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions
    ) -> dist.Work:
        return self._forward("reduce_scatter_single", "_reduce_scatter_base", output, input, opts)

    def _do_reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: ReduceScatterOptions
    ) -> dist.Work:
        if isinstance(self._pg, ProcessGroup):
            return self._forward(
                "reduce_scatter_single_coalesced", "reduce_scatter_single_coalesced", outputs, inputs, opts
            )
        return super()._do_reduce_scatter_single_coalesced(outputs, inputs, opts)

    def _do_all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: AllToAllOptions,
    ) -> dist.Work:
        return self._forward(
            "all_to_all_single", "alltoall_base", output, input, output_splits, input_splits, opts
        )

    def _do_alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllToAllOptions
    ) -> dist.Work:
        return self._forward("alltoall", "alltoall", outputs, inputs, opts)

    def _do_send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return self._forward("send", "send", tensors, dst, tag, peer=dst)

    def _do_recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self._forward("recv", "recv", tensors, src, tag, peer=src)

    def _do_barrier(self, opts: BarrierOptions) -> dist.Work:
        return self._forward("barrier", "barrier", opts)

    def _do_reduce(self, tensors: list[torch.Tensor], opts: ReduceOptions) -> dist.Work:
        self._check_root("reduce", opts.rootRank)
        return self._forward("reduce", "reduce", tensors, opts)

    def _do_gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: GatherOptions
    ) -> dist.Work:
        self._check_root("gather", opts.rootRank)
        return self._forward("gather", "gather", outputs, inputs, opts)

    def _do_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ScatterOptions
    ) -> dist.Work:
        self._check_root("scatter", opts.rootRank)
        return self._forward("scatter", "scatter", outputs, inputs, opts)


class ProcessGroupGloo(ProcessGroupWrapper):
    """Reconfigurable Gloo: a new ``torch.distributed.ProcessGroupGloo`` per configure.

    ``pg``: an ftlaunch group to forward to instead (torchft's wrapper form); then `configure`
    reconfigures that group.
    """

    def __init__(
        self, timeout: timedelta | float = timedelta(seconds=60), pg: ProcessGroup | None = None
    ) -> None:
        super().__init__(pg, timeout=timeout)

    def getBackendName(self) -> str:  # noqa: N802
        return "ftlaunch-gloo"

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> Any:
        host = _gloo_host(store)
        if host is None:  # GLOO_SOCKET_IFNAME, or a store of another kind: torch's own choice
            return dist.ProcessGroupGloo(store, rank, world_size, self._timeout)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch has no stub for it
        opts._timeout = self._timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)


def _gloo_host(store: dist.Store) -> str | None:
    """The address Gloo listens on and hands its peers: ``FTLAUNCH_LOCAL_ADDR``, else the local
    address of the route to the rendezvous store's host -- the other groups' hosts reach the store,
    so they reach that address too. torch's default is the address the host name resolves to,
    which on many machines (Debian's ``127.0.1.1 hostname``) is loopback: peers on other hosts
    would be told to connect to themselves. None leaves the choice to torch (``GLOO_SOCKET_IFNAME``
    set, or no TCP store to route to)."""
    if env.gloo_interface_chosen():
        return None
    chosen = env.local_addr()
    if chosen:
        return chosen
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    return reachable_address(store.host)


class ProcessGroupNCCL(ProcessGroupWrapper):
    """Reconfigurable NCCL: a new ``ProcessGroupNCCL`` per configure; the old one is aborted.

    NCCL's own error handling can still block inside CUDA; prefer `ProcessGroupBabyNCCL`
    when a hung peer must never stall this process. ``ProcessGroupNCCL(pg=group)`` (torchft's
    documented form) forwards to an ftlaunch ``group`` instead, and `configure` reconfigures it.
    """

    def __init__(
        self, timeout: timedelta | float = timedelta(seconds=60), pg: ProcessGroup | None = None
    ) -> None:
        super().__init__(pg, timeout=timeout)

    def getBackendName(self) -> str:  # noqa: N802
        return "ftlaunch-nccl"

    def _result_devices(self) -> tuple[torch.device, ...]:
        return (torch.device("cuda", torch.cuda.current_device()),) if torch.cuda.is_available() else ()

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> Any:
        if not dist.is_nccl_available():
            raise NotImplementedError("ProcessGroupNCCL: this torch build has no NCCL support")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self._timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        if torch.cuda.is_available():
            # Connect eagerly so configure() fails here, not inside the first collective.
            pg.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
        return pg
