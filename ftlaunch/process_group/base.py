"""The reconfigurable `ProcessGroup` base class and the `Work` objects it returns.

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
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)
from torch.distributed import distributed_c10d as c10d

from ftlaunch.errors import CommunicationError
from ftlaunch.process_group._store import first_line
from ftlaunch.timeouts import as_timedelta

logger = logging.getLogger(__name__)

__all__ = ["ProcessGroup", "as_timedelta", "completed_future", "DoneWork"]

T = TypeVar("T")

_NAME_COUNTER = itertools.count()
_ZERO = timedelta(0)


# --------------------------------------------------------------------------------------------
# Work objects
# --------------------------------------------------------------------------------------------


class DoneWork(dist.Work):
    """An already completed Work whose future holds `result` (used by Dummy and error swallowing)."""

    def __init__(self, result: Any = None) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: timedelta = _ZERO) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def get_future(self) -> torch.futures.Future:
        return completed_future(self._result)


def completed_future(value: T) -> torch.futures.Future[T]:
    """A torch future that already holds ``value``."""
    fut: torch.futures.Future[T] = torch.futures.Future()
    fut.set_result(value)
    return fut


class FtWork(dist.Work):
    """Wraps a backend's Work so that failures surface as `CommunicationError` and mark the group.

    Kept deliberately thin (one Python object, no thread): it is created for every operation.
    `release` drops the backend Work when the group aborts after an error: a gloo Work keeps its
    communication context - and so its sockets - alive, and peers blocked on us only fail fast
    once those sockets close.
    """

    def __init__(self, pg: ProcessGroup, inner: dist.Work, op: str, peer: int | None = None) -> None:
        super().__init__()
        self._pg = pg
        self._inner: dist.Work | None = inner
        self._op = op
        self._peer = peer
        self._generation = pg._generation

    def release(self) -> None:
        self._inner = None

    def _released_error(self) -> CommunicationError:
        return self._pg._record_error(
            self._op, "aborted (the group failed, was aborted or was reconfigured)", self._peer, self._generation
        )

    def wait(self, timeout: timedelta = _ZERO) -> bool:
        inner = self._inner
        if inner is None:
            raise self._released_error()
        try:
            if timeout:
                return inner.wait(timeout)
            return inner.wait()
        except Exception as e:
            error = e
        # Drop the failed backend Work before recording the error: the error (and with it this
        # frame, through its traceback) is kept by the group, and the Work would keep the
        # backend's sockets open.
        inner = None
        self._inner = None
        raise self._pg._record_error(self._op, error, self._peer, self._generation) from error

    def is_completed(self) -> bool:
        inner = self._inner
        return True if inner is None else inner.is_completed()

    def get_future(self) -> torch.futures.Future:
        out: torch.futures.Future = torch.futures.Future()
        inner = self._inner
        if inner is None:
            out.set_exception(self._released_error())
            return out
        pg, op, peer, generation = self._pg, self._op, self._peer, self._generation

        def _done(fut: torch.futures.Future) -> None:
            try:
                value = fut.value()
            except Exception as e:
                # Runs on a backend thread: the group must not tear its backend down here.
                out.set_exception(pg._record_error(op, e, peer, generation, on_backend_thread=True))
            else:
                out.set_result(value)

        inner.get_future().add_done_callback(_done)
        return out


class ComposedWork(dist.Work):
    """Several Works seen as one, plus an optional step to run once all finished (copy results)."""

    def __init__(
        self,
        works: Sequence[dist.Work],
        result: Any,
        after: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._works = list(works)
        self._result = result
        self._after = after
        self._after_lock = threading.Lock()
        self._after_done = False

    def _finish(self) -> None:
        with self._after_lock:
            if not self._after_done:
                self._after_done = True
                if self._after is not None:
                    self._after()

    def wait(self, timeout: timedelta = _ZERO) -> bool:
        for work in self._works:
            if timeout:
                work.wait(timeout)
            else:
                work.wait()
        self._finish()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works) and self._after_done

    def get_future(self) -> torch.futures.Future:
        out: torch.futures.Future = torch.futures.Future()
        futures = [w.get_future() for w in self._works]

        def _done(_: torch.futures.Future) -> None:
            try:
                for fut in futures:
                    fut.value()
                self._finish()
            except Exception as e:
                out.set_exception(e)
            else:
                out.set_result(self._result)

        torch.futures.collect_all(futures).add_done_callback(_done)
        return out


# --------------------------------------------------------------------------------------------
# Argument normalisation (torch's overloads -> one canonical form)
# --------------------------------------------------------------------------------------------


def _reduce_op(op: Any) -> dist.ReduceOp:
    if isinstance(op, dist.ReduceOp):
        return op
    if isinstance(op, dist.ReduceOp.RedOpType):
        return dist.ReduceOp(op)
    raise TypeError(f"expected a ReduceOp or options object, got {type(op).__name__}")


def _tensor_list(tensors: Any, what: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if isinstance(tensors, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in tensors):
        return list(tensors)
    raise TypeError(f"{what} must be a Tensor or a list of Tensors, got {type(tensors).__name__}")


def _with_reduce(opts: Any, cls: type) -> Any:
    if opts is None:
        return cls()
    if isinstance(opts, cls):
        return opts
    new = cls()
    new.reduceOp = _reduce_op(opts)
    return new


def _plain(opts: Any, cls: type) -> Any:
    if opts is None:
        return cls()
    if not isinstance(opts, cls):
        raise TypeError(f"expected {cls.__name__}, got {type(opts).__name__}")
    return opts


class _LiveRankMap(Mapping[int, int]):
    """torch's "global rank -> group rank" table for a group whose rank changes at configure.

    Our groups span replica groups, each with its own default group, so the only global rank
    that means anything here is this process's own; it maps to the current group rank.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        self._pg = weakref.ref(pg)

    @staticmethod
    def _own() -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def __getitem__(self, global_rank: int) -> int:
        pg = self._pg()
        if pg is None or global_rank != self._own():
            raise KeyError(global_rank)
        return pg.rank()

    def __iter__(self) -> Iterator[int]:
        return iter([self._own()])

    def __len__(self) -> int:
        return 1


# --------------------------------------------------------------------------------------------
# ProcessGroup
# --------------------------------------------------------------------------------------------


class ProcessGroup(dist.ProcessGroup):
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
        self._generation = 0
        self._error: Exception | None = None
        self._group_name: c10d.GroupName | None = None
        self._auto_named = False
        self._error_lock = threading.Lock()

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
    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Rebuild this group on a new store prefix with a new rank and world size.

        `store_addr` is "host:port/prefix" and must be unique per call (e.g. contain the quorum
        id). Blocks until the group is usable; raises `CommunicationError` on failure (the group
        is then errored until the next successful `configure`).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement configure")

    def errored(self) -> Exception | None:
        """The first communication error since the last `configure`, or None."""
        return self._error

    def abort(self) -> None:
        """Stop using the current configuration at once; pending operations fail."""

    def shutdown(self) -> None:
        """Release every resource (threads, sockets, child processes). Idempotent."""

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Timeout of future operations (and of the next `configure`)."""
        raise NotImplementedError(f"{type(self).__name__} does not support set_timeout")

    def _begin_configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Validate arguments and start a new generation (errors of the old one are forgotten)."""
        if not isinstance(rank, int) or not isinstance(world_size, int):
            raise TypeError("rank and world_size must be ints")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        with self._error_lock:
            self._generation += 1
            self._error = None
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

    def _comm_error(self, op: str, exc: BaseException | str, peer: int | None = None) -> CommunicationError:
        if isinstance(exc, CommunicationError):
            return exc
        peer_txt = f" with peer rank {peer}" if peer is not None else ""
        detail = exc if isinstance(exc, str) else first_line(exc)
        return CommunicationError(f"{op} failed on {self._describe()}{peer_txt}: {detail}")

    def _record_error(
        self,
        op: str,
        exc: BaseException | str,
        peer: int | None = None,
        generation: int | None = None,
        on_backend_thread: bool = False,
        quiet: bool = False,
    ) -> CommunicationError:
        """Turn `exc` into a CommunicationError and remember it (first one wins) if still current."""
        err = self._comm_error(op, exc, peer)
        with self._error_lock:
            first = self._error is None and (generation is None or generation == self._generation)
            if first:
                self._error = err
                current = self._generation
        if first:
            (logger.info if quiet else logger.warning)("ftlaunch.process_group: %s", err)
            self._on_first_error(current, on_backend_thread)
        return err

    def _on_first_error(self, generation: int, on_backend_thread: bool) -> None:
        """Hook: react to the first communication error of configuration `generation`."""

    def _call_error(self, op: str, exc: Exception, peer: int | None = None) -> Exception:
        """An error raised while *issuing* an op: misuse stays ValueError/TypeError, the rest is
        a communication failure."""
        if isinstance(exc, (ValueError, TypeError, NotImplementedError, CommunicationError)):
            return exc
        if isinstance(exc, dist.DistError):
            return self._record_error(op, exc, peer)
        if isinstance(exc, RuntimeError):
            return ValueError(f"{op} rejected its arguments on {self._describe()}: {first_line(exc)}")
        return exc

    def _unsupported(self, op: str) -> NotImplementedError:
        return NotImplementedError(f"{op} is not supported by the {self.getBackendName()} backend")

    # ---- registry ---------------------------------------------------------------------------
    # Like torch's own groups, ours live in torch's registries (``_world`` and the C++ name
    # registry) from their first configure on: ``dist.get_backend(pg)``, ``dist.get_rank(pg)``,
    # functional collectives by ``pg.group_name`` and ``destroy_process_group(pg)`` then work,
    # and - important for the error model - an exception raised inside ``dist.all_reduce(...,
    # group=pg)`` reaches the caller instead of being masked by torch's error logger, which
    # looks the group up there. As with torch's groups, `shutdown` frees the resources and
    # ``destroy_process_group(pg)`` (or `unregister`) also drops the registration.

    def _is_registered(self) -> bool:
        return c10d._world.pg_names.get(self) is not None

    def _auto_register(self) -> None:
        if not self._is_registered():
            self._register_as(self.group_name)
            self._auto_named = True

    def _register_as(self, name: str) -> None:
        if name in c10d._world.pg_names.values():
            raise ValueError(f"a process group named {name!r} is already registered")
        group_name = self._group_name = c10d.GroupName(name)
        backend = self.getBackendName()
        world = c10d._world
        # No c10d Store behind our groups (each configure builds its own). torch annotates the slot
        # as a Store but reads it only for the default group, groups it derives from another (by
        # tag, shrink) and symmetric memory - none of which applies to ours.
        world.pg_map[self] = (backend, None)  # type: ignore[assignment]
        world.pg_names[self] = group_name
        # A live read-only Mapping where torch annotates a dict: torch only reads the table
        # ([]/items/keys), never mutates it.
        world.pg_group_ranks[self] = _LiveRankMap(self)  # type: ignore[assignment]
        world.pg_backend_config[self] = backend
        tag = f"ptd:{name}"
        world.pg_to_tag[self] = tag
        world.tags_to_pg.setdefault(tag, []).append(self)
        c10d._register_process_group(group_name, self)
        self._auto_named = False

    def register(self, name: str) -> ProcessGroup:
        """Register under `name` (torchft's API): then usable by that name, e.g. by functional
        collectives. Replaces the automatic name; a group has one user-given name. Returns self."""
        if not name or not isinstance(name, str):
            raise ValueError("register() needs a non-empty name")
        if self._is_registered():
            if not getattr(self, "_auto_named", False):
                raise ValueError(f"{self!r} is already registered as {self._group_name!r}")
            self.unregister()
        self._register_as(name)
        return self

    def unregister(self) -> None:
        """Remove this group from torch's registries (destroy_process_group(pg) also does)."""
        world = c10d._world
        if not self._is_registered():
            raise ValueError(f"{self!r} is not registered")
        name = world.pg_names.pop(self, None)
        world.pg_map.pop(self, None)
        world.pg_group_ranks.pop(self, None)
        world.pg_backend_config.pop(self, None)
        world.pg_coalesce_state.pop(self, None)
        tag = world.pg_to_tag.pop(self, None)
        if tag is not None and self in world.tags_to_pg.get(tag, []):
            world.tags_to_pg[tag].remove(self)
            if not world.tags_to_pg[tag]:
                del world.tags_to_pg[tag]
        if name is not None:
            try:
                c10d._unregister_process_group(name)
            except Exception:  # already gone from the C++ registry
                pass

    # ---- public collectives (torch names and overloads) ------------------------------------
    # Typing: one implementation serves all of a method's overloads in torch's stub, taking them
    # positionally and normalising them (the stub's ``op=``/``timeout=`` keyword forms are not
    # supported), hence ``ignore[override]``. The aliases under torch's other names take the same
    # positional arguments; the stub only names the parameters differently (``ignore[assignment]``).
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._do_allreduce(_tensor_list(tensors, "tensors"), _with_reduce(opts, AllreduceOptions))

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._do_allreduce_coalesced(
            _tensor_list(tensors, "tensors"), _with_reduce(opts, AllreduceCoalescedOptions)
        )

    def allgather(self, output_tensors: Any, input_tensor: Any, opts: Any = None) -> dist.Work:
        if isinstance(input_tensor, torch.Tensor):
            outputs = [_tensor_list(output_tensors, "output_tensors")]
            inputs = [input_tensor]
        else:
            inputs = _tensor_list(input_tensor, "input_tensors")
            outputs = [_tensor_list(o, "output_tensors[i]") for o in output_tensors]
        return self._do_allgather(outputs, inputs, _plain(opts, AllgatherOptions))

    def all_gather_single(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        return self._do_all_gather_single(output_tensor, input_tensor, _plain(opts, AllgatherOptions))

    _allgather_base = all_gather_single  # type: ignore[assignment]

    def all_gather_single_coalesced(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        return self._do_all_gather_single_coalesced(
            _tensor_list(output_tensors, "output_tensors"),
            _tensor_list(input_tensors, "input_tensors"),
            _plain(opts, AllgatherOptions),
        )

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        if isinstance(opts, int):
            root, opts = opts, BroadcastOptions()
            opts.rootRank = root
        return self._do_broadcast(_tensor_list(tensors, "tensors"), _plain(opts, BroadcastOptions))

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist.Work:
        opts = BroadcastOptions()
        opts.rootRank = root
        return self._do_broadcast([tensor], opts)

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        if isinstance(output_tensors, torch.Tensor):
            outputs = [output_tensors]
            inputs = [_tensor_list(input_tensors, "input_tensors")]
        else:
            outputs = _tensor_list(output_tensors, "output_tensors")
            inputs = [_tensor_list(i, "input_tensors[i]") for i in input_tensors]
        return self._do_reduce_scatter(outputs, inputs, _with_reduce(opts, ReduceScatterOptions))

    def reduce_scatter_single(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        return self._do_reduce_scatter_single(
            output_tensor, input_tensor, _with_reduce(opts, ReduceScatterOptions)
        )

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        return self._do_reduce_scatter_single_coalesced(
            _tensor_list(output_tensors, "output_tensors"),
            _tensor_list(input_tensors, "input_tensors"),
            _with_reduce(opts, ReduceScatterOptions),
        )

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def all_to_all_single(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        return self._do_all_to_all_single(
            output_tensor,
            input_tensor,
            list(output_split_sizes),
            list(input_split_sizes),
            _plain(opts, AllToAllOptions),
        )

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> dist.Work:
        return self._do_alltoall(
            _tensor_list(output_tensors, "output_tensors"),
            _tensor_list(input_tensors, "input_tensors"),
            _plain(opts, AllToAllOptions),
        )

    def send(self, tensors: Any, dst_rank: int, tag: int = 0) -> dist.Work:
        return self._do_send(_tensor_list(tensors, "tensors"), dst_rank, tag)

    def recv(self, tensors: Any, src_rank: int, tag: int = 0) -> dist.Work:
        return self._do_recv(_tensor_list(tensors, "tensors"), src_rank, tag)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._do_barrier(_plain(opts, BarrierOptions))

    # ---- hooks: native ops (subclasses) -----------------------------------------------------
    def _do_allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> dist.Work:
        raise self._unsupported("allreduce")

    def _do_allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: AllgatherOptions
    ) -> dist.Work:
        raise self._unsupported("allgather")

    def _do_broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> dist.Work:
        raise self._unsupported("broadcast")

    def _do_all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: AllToAllOptions,
    ) -> dist.Work:
        raise self._unsupported("all_to_all_single")

    def _do_alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllToAllOptions
    ) -> dist.Work:
        raise self._unsupported("alltoall")

    def _do_send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        raise self._unsupported("send")

    def _do_recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        raise self._unsupported("recv")

    # ---- hooks with composite defaults ------------------------------------------------------
    def _do_allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions
    ) -> dist.Work:
        works = []
        for t in tensors:
            single = AllreduceOptions()
            single.reduceOp = opts.reduceOp
            works.append(self._do_allreduce([t], single))
        return ComposedWork(works, tensors)

    def _do_all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions
    ) -> dist.Work:
        world = self.size()
        if output.numel() != input.numel() * world:
            raise ValueError(
                f"all_gather_single: output has {output.numel()} elements, expected "
                f"{input.numel()} x world size {world}"
            )
        chunks = list(output.view(world, *input.shape).unbind(0))
        work = self._do_allgather([chunks], [input], opts)
        return ComposedWork([work], [output])

    def _do_all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllgatherOptions
    ) -> dist.Work:
        if len(outputs) != len(inputs):
            raise ValueError("all_gather_single_coalesced: outputs and inputs differ in length")
        works = [self._do_all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return ComposedWork(works, outputs)

    def _do_reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ReduceScatterOptions
    ) -> dist.Work:
        # Composite: allreduce the concatenated inputs, keep our slice.
        world, rank = self.size(), self.rank()
        if len(outputs) != len(inputs):
            raise ValueError("reduce_scatter: outputs and inputs differ in length")
        works, pairs = [], []
        for out, ins in zip(outputs, inputs, strict=True):
            if len(ins) != world:
                raise ValueError(f"reduce_scatter: expected {world} inputs per output, got {len(ins)}")
            flat = torch.cat([t.reshape(-1) for t in ins])
            single = AllreduceOptions()
            single.reduceOp = opts.reduceOp
            works.append(self._do_allreduce([flat], single))
            pairs.append((out, flat, [t.numel() for t in ins]))

        def _copy_out() -> None:
            for out, flat, sizes in pairs:
                start = sum(sizes[:rank])
                out.copy_(flat[start : start + sizes[rank]].view_as(out))

        return ComposedWork(works, outputs, _copy_out)

    def _do_reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions
    ) -> dist.Work:
        world, rank = self.size(), self.rank()
        if input.numel() != output.numel() * world:
            raise ValueError(
                f"reduce_scatter_single: input has {input.numel()} elements, expected "
                f"{output.numel()} x world size {world}"
            )
        flat = input.reshape(-1).clone()
        single = AllreduceOptions()
        single.reduceOp = opts.reduceOp
        work = self._do_allreduce([flat], single)
        n = output.numel()

        def _copy_out() -> None:
            output.copy_(flat[rank * n : (rank + 1) * n].view_as(output))

        return ComposedWork([work], [output], _copy_out)

    def _do_reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: ReduceScatterOptions
    ) -> dist.Work:
        if len(outputs) != len(inputs):
            raise ValueError("reduce_scatter_single_coalesced: outputs and inputs differ in length")
        works = [self._do_reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return ComposedWork(works, outputs)

    def _do_barrier(self, opts: BarrierOptions) -> dist.Work:
        token = torch.zeros(1)
        return ComposedWork([self._do_allreduce([token], AllreduceOptions())], [token])
