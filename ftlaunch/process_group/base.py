"""The reconfigurable `ProcessGroup` base class: torch's interface, the lifecycle, the error model.

Why a subclass of ``torch.distributed.ProcessGroup``: torch's Python collectives
(``dist.all_reduce(t, group=pg)``) call the group's Python methods directly, and C++ callers
(DDP's reducer, functional collectives, FSDP2) reach them through torch's pybind trampoline
(``PyProcessGroup``), which forwards ``allreduce``, ``allgather``, ``broadcast``,
``reduce_scatter``, ``all_to_all_single``/``alltoall_base``, ``*_coalesced``, ``send``, ``recv``
and ``barrier`` to Python overrides. So one class serves every caller, and membership can change
underneath them because the object itself never changes.

Layering: the public, torch-named methods only normalise torch's overloads (``allreduce(t, op)``
vs ``allreduce([t], opts)``) and call one ``_do_<op>`` hook per operation. Subclasses implement the
hooks their backend has natively; the base class provides composites for the rest (reduce_scatter
from allreduce, all_gather_single from allgather, coalesced ops as several ops, barrier as a tiny
allreduce), so no caller sees a NotImplementedError where a correct fallback exists.

The torch-named collectives and their hooks are in `_collectives` (`Collectives`, a base of this
class); the `Work` objects the ops return are in `work`; torch's registries are handled by
`_registry`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ftlaunch.addresses import parse_store_addr
from ftlaunch.errors import CommunicationError
from ftlaunch.process_group import _registry
from ftlaunch.process_group._collectives import Collectives
from ftlaunch.process_group._composites import collective_device
from ftlaunch.process_group._overloads import configure_args
from ftlaunch.process_group._store import first_line
from ftlaunch.process_group.failures import FailureRecord
from ftlaunch.process_group.reconfigure import (
    Handle,
    HandleStore,
    ReconfigureWork,
    encode_handle,
    rendezvous_of,
)

logger = logging.getLogger(__name__)

__all__ = ["GroupClosedError", "ProcessGroup", "collective_device", "release_process_group"]

_NAME_COUNTER = itertools.count()


class GroupClosedError(ValueError, OSError):
    """An operation on a group after its `shutdown`: misuse (a ``ValueError``), and an ``OSError``
    as any use of a closed handle is (torchft's Baby groups raise that then)."""


class ProcessGroup(Collectives):
    """A process group whose membership changes in place via `configure`.

    ``rank()``/``size()`` are those of the *current* configuration; they can change at every
    `configure`, so callers must not cache them across steps.
    """

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        # torch binds a (rank, size) constructor for Python subclasses; its stub lists only
        # (store, rank, size).
        super().__init__(rank, world_size)  # type: ignore[call-arg]
        self._rank = rank
        self._world_size = world_size
        self._store_addr = ""
        #: The first communication error of each configuration; the Works of its ops report to it.
        self._failures = FailureRecord(self._describe, self._on_first_error)
        self._group_name: c10d.GroupName | None = None
        self._auto_named = False
        self._closed = False  # shut down (until the next configure)
        # torchft's reconfigure API (`reconfigure`): who we are in handles, the store we host for
        # them, and the labels `set_rank_info` gives us.
        self._reconfigure_id = uuid.uuid4().hex
        self._handle_store = HandleStore()
        self._global_rank: int | None = None
        self._replica_id: str | None = None
        #: Every member's global rank after the last `reconfigure`, when all of them set one.
        self.global_ranks: list[int] | None = None

    # ---- identity ---------------------------------------------------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world_size

    # C++ callers (DDP's reducer, ...) reach these through torch's trampoline.
    def getRank(self) -> int:  # noqa: N802 - torch's C++ name
        return self.rank()

    def getSize(self) -> int:  # noqa: N802
        return self.size()

    def getBackendName(self) -> str:  # noqa: N802
        return "ftlaunch"

    def _get_backend_name(self) -> str:
        return self.getBackendName()

    def _backend_name(self) -> str:
        return self.getBackendName()

    def name(self) -> str:
        return self.getBackendName()

    @property
    def group_name(self) -> c10d.GroupName:
        """A process-unique name; the one given to `register` once registered."""
        if self._group_name is None:
            self._group_name = c10d.GroupName(f"ftlaunch:{self.getBackendName()}:{next(_NAME_COUNTER)}")
        return self._group_name

    def getGroupName(self) -> str:  # noqa: N802
        return self.group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = c10d.GroupName(name)

    def _set_group_name(self, name: str) -> None:
        self._group_name = c10d.GroupName(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank()}, size={self.size()}, store={self._store_addr!r})"

    # ---- lifecycle --------------------------------------------------------------------------
    def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
        """Rebuild this group on a new store prefix with a new rank and world size.

        ``configure(store_addr, rank, world_size)`` is torchft's documented form;
        ``configure(store_addr, replica_id, rank, world_size)`` (``replica_id`` also by keyword)
        the form torchft used in 2025 - the replica id only labels the group in logs.
        `store_addr` is "host:port/prefix" and must be unique per call (e.g. contain the quorum
        id). Blocks until the group is usable; raises `CommunicationError` on failure (the group
        is then errored until the next successful `configure`).
        """
        rank, world_size, replica_id = configure_args(args, kwargs)
        if replica_id is not None:
            self._replica_id = replica_id
        self._configure(store_addr, rank, world_size)

    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """What `configure` does; every group implements it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement configure")

    # ---- torchft's current reconfigure API (see `reconfigure`) --------------------------------
    @property
    def supports_reconfigure(self) -> bool:
        """True: this group implements ``get_reconfigure_handle`` and ``reconfigure`` (as torch >= 2.14's)."""
        return True

    def set_rank_info(
        self, replica_id: str, group_rank: int, group_world_size: int, global_rank: int | None = None
    ) -> None:
        """Labels for logs and handles (torchft's API): the replica group this process belongs
        to, its rank inside it, and its global rank, which `get_reconfigure_handle` carries so
        that every member learns all of them (``global_ranks`` after a `reconfigure`)."""
        self._replica_id = replica_id
        self._global_rank = global_rank

    def get_reconfigure_handle(self) -> str:
        """This member's handle for `reconfigure`: the group's identity and a rendezvous store it
        hosts (started on the first call). The identity stays the same for the group's life."""
        handle = Handle(self._reconfigure_id, self._handle_store.address(), self._global_rank)
        return encode_handle(handle)

    def reconfigure(self, opts: Any) -> dist.Work:
        """Rebuild this group for the members whose handles ``opts.handles`` lists (torchft's API).

        Same semantics as `configure`: this member's rank is the index of its own handle, the
        world size the number of handles, and all of them meet on the first handle's store under
        ``ftlaunch/reconfigure/<opts.uuid>`` (so ``uuid`` must be new for every reconfigure, as a
        `configure` prefix must). Misuse (no handles, our handle missing) raises ValueError here;
        the returned Work's ``wait()`` raises what the configure raised, and gives up after
        ``opts.timeout`` (see `reconfigure.ReconfigureWork`).
        """
        rdv = rendezvous_of(opts, self._reconfigure_id)
        timeout = getattr(opts, "timeout", None)
        # The configure runs on a thread of its own: give it the caller's CUDA device (NCCL groups
        # bind to the current device).
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def run() -> None:
            if device is not None:
                torch.cuda.set_device(device)
            self.configure(rdv.store_addr, rdv.rank, rdv.world_size)
            self.global_ranks = rdv.global_ranks

        def timed_out(message: str) -> Exception:
            # Not on this thread: the configure may hold the group's lock until its own timeout.
            error = self._failures.record("reconfigure", message, on_backend_thread=True)
            threading.Thread(target=self.abort, name="ftlaunch-reconfigure-abort", daemon=True).start()
            return error

        return ReconfigureWork(
            f"reconfigure to rank {rdv.rank}/{rdv.world_size}", run, timeout if timeout else None, timed_out
        )

    def errored(self) -> Exception | None:
        """The first communication error since the last `configure`, or None."""
        return self._failures.error

    def wait_ready(self, timeout: timedelta | float | None = None) -> None:
        """Block until a `configure` could start at once: whatever this group needs before it can
        meet its peers is up (a Baby group's child has imported torch and serves requests).

        Why: a group that asks to be counted in a quorum before it is ready makes every peer's
        reconfigure wait for it (the rendezvous needs all members), so the Manager calls this
        before its first quorum request. In-process backends are ready when constructed: no-op.
        Raises `CommunicationError` when the group cannot become ready within ``timeout``.
        """

    def abort(self) -> None:
        """Stop using the current configuration at once; pending operations fail."""

    def prepare_abort(self) -> None:
        """An operation has been waiting long: an `abort` may follow. A group whose abort is costly
        to recover from (a Baby group must replace its child) may get ready now; the default does
        nothing. Never blocks, never fails the group."""

    def shutdown(self) -> None:
        """Release every resource (threads, sockets, child processes). Idempotent."""
        self._handle_store.close()

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Timeout of future operations (and of the next `configure`)."""
        raise NotImplementedError(f"{type(self).__name__} does not support set_timeout")

    def _begin_configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Validate arguments and start a new generation (errors of the old one are forgotten).

        Malformed arguments are misuse: ValueError/TypeError before anything changes. A configure
        after `shutdown` rebuilds the group (as in torchft).
        """
        parse_store_addr(store_addr)
        if not isinstance(rank, int) or not isinstance(world_size, int):
            raise TypeError("rank and world_size must be ints")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self._failures.new_generation()
        self._closed = False
        self._store_addr = store_addr
        self._rank = rank
        self._world_size = world_size
        self._auto_register()

    # ---- errors -----------------------------------------------------------------------------
    def _describe(self) -> str:
        return (
            f"{self.getBackendName()} rank {self._rank}/{self._world_size} "
            f"(store {self._store_addr or '<not configured>'})"
        )

    def _on_first_error(self, generation: int, on_backend_thread: bool) -> None:
        """Hook: react to the first communication error of configuration `generation`."""

    def _call_error(self, op: str, exc: Exception, peer: int | None = None) -> Exception:
        """An error raised while *issuing* an op: misuse stays ValueError/TypeError, the rest is
        a communication failure."""
        if isinstance(exc, (ValueError, TypeError, NotImplementedError, CommunicationError)):
            return exc
        if isinstance(exc, dist.DistError):
            return self._failures.record(op, exc, peer)
        if isinstance(exc, RuntimeError):
            return ValueError(f"{op} rejected its arguments on {self._describe()}: {first_line(exc)}")
        return exc

    def _unusable_error(self, op: str) -> Exception:
        """Why ``op`` cannot run with no backend up: shut down, failed (that error), or never configured."""
        if self._closed:
            return GroupClosedError(
                f"{op}: {type(self).__name__} was shut down (its handle is closed); configure() it "
                "again to reuse it"
            )
        if self._failures.error is not None:
            return self._failures.error
        return ValueError(f"{op}: {type(self).__name__} is not configured; call configure() first")

    # ---- registry (see `_registry`: torch's tables, from the first configure on) --------------
    def _is_registered(self) -> bool:
        return _registry.is_registered(self)

    def _auto_register(self) -> None:
        if not self._is_registered():
            self._group_name = _registry.add(self, self.group_name, self.getBackendName())
            self._auto_named = True

    def register(self, name: str) -> ProcessGroup:
        """Register under `name` (torchft's API): then usable by that name, e.g. by functional
        collectives. Replaces the automatic name; a group has one user-given name. Returns self."""
        if not name or not isinstance(name, str):
            raise ValueError("register() needs a non-empty name")
        if self._is_registered():
            if not self._auto_named:
                raise ValueError(f"{self!r} is already registered as {self._group_name!r}")
            self.unregister()
        self._group_name = _registry.add(self, name, self.getBackendName())
        self._auto_named = False
        return self

    def unregister(self) -> None:
        """Remove this group from torch's registries (destroy_process_group(pg) also does)."""
        if not self._is_registered():
            raise ValueError(f"{self!r} is not registered")
        _registry.remove(self)


def release_process_group(pg: ProcessGroup) -> None:
    """Shut ``pg`` down, best effort: teardown must not mask the reason for it."""
    try:
        pg.shutdown()
    except Exception as e:  # noqa: BLE001 - torch raises several types here
        logger.debug("process group shutdown: %s", e)
