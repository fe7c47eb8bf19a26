"""Baby process groups: the real backend runs in a child process.

Why: a collective stuck on a hung peer cannot be interrupted inside the process that runs it
(gloo/NCCL give no reliable way to cancel a blocked op). With the backend in a child, `abort` is
"kill the child": it returns at once, always. The price is a hop per operation, kept small:

* tensors never travel: CPU tensors are shared with the child through shared memory (see
  `shm`), CUDA tensors through CUDA IPC; only a tiny command tuple crosses the socket;
* no thread per op: a thread blocked in `Work.wait()` reads its own reply from the socket, and
  one reader thread per child serves futures and enforces op deadlines, so a wedged child can
  never hang the caller;
* a healthy child is reused by the next `configure` (a new gloo context in the same child
  costs milliseconds, a new child a second or two); only a dead, killed or timed-out child is
  replaced. A peer failure reported by the child leaves the child healthy.

The child is a fresh interpreter (``python -m ftlaunch.process_group.baby.child``) started with
`subprocess`, not multiprocessing: it never re-imports the user's ``__main__`` and needs no
resource-tracker helper process. `handle.Child` is the parent's handle on it (process,
socket, reader thread, requests in flight); this module decides what to send and when to replace
a child.
"""

from __future__ import annotations

import logging
import threading
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing.reductions
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
from ftlaunch.bootstrap import prestart
from ftlaunch.errors import CommunicationError
from ftlaunch.process_group.baby.handle import Child
from ftlaunch.process_group.baby.shm import Staged
from ftlaunch.process_group.baby.work import BabyWork, BabyWorkNCCL
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.timeouts import as_timedelta

logger = logging.getLogger(__name__)

__all__ = ["ProcessGroupBaby", "ProcessGroupBabyGloo", "ProcessGroupBabyNCCL"]

_SPAWN_TIMEOUT_MIN = 60.0  # importing torch in a fresh interpreter on a loaded machine


class ProcessGroupBaby(ProcessGroup):
    """A process group whose backend runs in a child process (see the module docstring)."""

    _backend = ""
    _work_cls: type[BabyWork] = BabyWork
    #: torchft's name for the Work class this group's ops return.
    WORK_CLASS: type[dist.Work] = BabyWork
    #: Start the child when the group is created (it imports torch while the caller works on);
    #: False: at the first configure (NCCL: constructible where CUDA is missing until used).
    _spawn_early = True

    def __init__(self, timeout: float | timedelta = 60.0) -> None:
        super().__init__(0, 1)
        if not self._backend:
            raise TypeError("use ProcessGroupBabyGloo or ProcessGroupBabyNCCL")
        self._timeout = as_timedelta(timeout).total_seconds()
        self._lock = threading.RLock()
        self._spare_lock = threading.Lock()
        self._configured = False
        # Every child we started and have not reaped yet: the finalizer kills them if this group
        # is garbage-collected without shutdown().
        self._children: list[Child] = []
        self._finalizer = weakref.finalize(self, _kill_all, self._children)
        # Start the interpreter now (non-blocking): it imports torch while the caller does other
        # work, so the first configure rarely waits for it.
        self._child: Child | None = self._spawn() if self._spawn_early else None
        self._spare: Child | None = None  # a replacement started early, after a child was lost
        # An abort while a configure waits for its child to start: the child is kept (a spawn costs
        # seconds on a loaded machine, 20 s seen) and that configure fails before its rendezvous.
        self._abort_lock = threading.Lock()
        self._configuring: Child | None = None
        self._abort_configure = False

    def getBackendName(self) -> str:  # noqa: N802
        return f"ftlaunch-baby-{self._backend}"

    @property
    def child_pid(self) -> int | None:
        """Pid of the current child process (None when there is none)."""
        child = self._child
        return child.pid if child is not None else None

    def num_active_work(self) -> int:
        """Operations submitted to the child and not finished yet (torchft's name): 0 once every
        Work returned so far has completed, so a caller can check that nothing is left in flight."""
        child = self._child
        return child.in_flight() if child is not None else 0

    def _describe(self) -> str:
        child = self._child
        pid = f", child pid {child.pid}" if child is not None else ""
        return super()._describe() + pid

    # ---- lifecycle --------------------------------------------------------------------------
    def _check_usable(self) -> None:
        """Raise when this machine cannot run the backend (checked at configure, not construction)."""

    def _spawn(self) -> Child:
        me = weakref.ref(self)

        def _lost() -> None:  # reader thread: the child died on its own
            pg = me()
            if pg is not None:
                pg._start_spare()

        child = Child(self._backend, on_lost=_lost)
        self._children.append(child)
        return child

    def _start_spare(self) -> None:
        """Start a replacement child now, so the next configure need not wait for a whole spawn."""
        with self._spare_lock:
            if self._spare is None and not self._closed:
                self._spare = self._spawn()

    def _take_spare(self) -> Child | None:
        """The spare, to become the current child; the next spare starts now, so that a later
        abort finds one ready too (as the one before did: a spare forked at the worker's start,
        `prestart.FORKED_SPARES`, or a spawn). None when no spare was started."""
        with self._spare_lock:
            child, self._spare = self._spare, None
        if child is not None:
            self._start_spare()
        return child

    def _close_child(self, child: Child, graceful: bool) -> None:
        child.close(graceful=graceful)
        if child in self._children:
            self._children.remove(child)

    def wait_ready(self, timeout: timedelta | float | None = None) -> None:
        """Block until the child has imported torch and serves requests (starting it now if it is
        not running: NCCL's starts lazily, a lost one is replaced), so the next `configure` costs
        only the rendezvous. Raises `CommunicationError` if the child does not start in time
        (default: the op timeout, at least a minute) and NotImplementedError where the backend
        cannot run (NCCL without CUDA)."""
        self._check_usable()
        if self._closed:
            return  # shut down: nothing to wait for (a later configure starts a child)
        limit = (
            max(self._timeout, _SPAWN_TIMEOUT_MIN)
            if timeout is None
            else as_timedelta(timeout).total_seconds()
        )
        with self._lock:
            child = self._child
            # An idle child's death is noticed at its next op; look now, and replace it early.
            if child is None or not child.healthy or _exited(child.proc):
                if child is not None:
                    self._close_child(child, graceful=False)
                child = self._take_spare()
                if child is None or not child.healthy:
                    child = self._spawn()
                self._child = child
            child.wait_ready(limit)

    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        self._check_usable()
        with self._lock:
            self._begin_configure(store_addr, rank, world_size)
            self._configured = False
            child = self._child
            if child is not None and (not child.healthy or child.busy()):
                # Requests still in flight would run on the old configuration: start clean.
                reason = "unusable" if not child.healthy else "busy at reconfigure"
                logger.info("ftlaunch.process_group: replacing baby child %d (%s)", child.pid, reason)
                self._close_child(child, graceful=False)
                child = self._child = None
            if child is None:
                child = self._take_spare()
                if child is None or not child.healthy:
                    child = self._spawn()
                self._child = child
            device = torch.cuda.current_device() if self._backend == "nccl" else None
            with self._abort_lock:
                self._configuring, self._abort_configure = child, False
            try:
                child.wait_ready(max(self._timeout, _SPAWN_TIMEOUT_MIN))
                with self._abort_lock:  # an abort meanwhile kept the starting child: stop here
                    self._configuring = None
                    if self._abort_configure:
                        raise CommunicationError("process group aborted while its child started")
                    pending = child.submit(
                        "configure",
                        lambda req, staged: (
                            "configure",
                            req,
                            store_addr,
                            rank,
                            world_size,
                            self._child_timeout(),
                            device,
                            # The worker's environment now: a child started before the script
                            # (prestart) lacks what the script set since (NCCL_*, GLOO_*).
                            env.inherited(),
                        ),
                        self._timeout,
                    )
                work = BabyWork(self._failures, child, pending, None, None)
                work.wait()
            except CommunicationError as e:
                raise self._failures.record("configure", e) from e
            finally:
                with self._abort_lock:
                    self._configuring = None
            self._configured = True
            logger.info("ftlaunch.process_group: configured %s", self._describe())

    def _child_timeout(self) -> float:
        # The child's backend gives up slightly before our deadline, so a plain peer timeout is
        # reported by a still healthy child instead of costing a kill and a respawn.
        return max(self._timeout * 0.9, self._timeout - 1.0)

    def abort(self) -> None:
        """Kill the child now (returns at once); ops in flight fail with CommunicationError.

        A replacement child starts right away; the next configure uses it. Except while a
        configure waits for a child that is still starting (nothing runs in it yet): that child is
        kept for the next configure, and the configure in progress fails before its rendezvous.
        """
        with self._abort_lock:
            starting = self._configuring
            if starting is not None and starting is self._child and starting.healthy and not starting.ready:
                self._abort_configure = True
                self._configured = False
                logger.info("ftlaunch.process_group: abort while baby child %d starts: kept", starting.pid)
                return
        child = self._child
        if child is not None and child.healthy:
            child.kill("aborted", quiet=True)
            if self._configured:
                self._failures.record("abort", "process group aborted", quiet=True)
            self._start_spare()
        self._configured = False

    def prepare_abort(self) -> None:
        """Start the replacement child now (at most one waits): an abort kills the child, and the
        next configure waits for its replacement to import torch -- seconds that then add to the
        time a hung peer costs (worker/hang_abort.py calls this when a step's wait grows long)."""
        self._start_spare()

    def shutdown(self) -> None:
        """Stop the child (gracefully, then SIGKILL) and release its socket and reader thread."""
        super().shutdown()
        with self._lock:
            with self._spare_lock:
                self._closed = True
                spare, self._spare = self._spare, None
            self._configured = False
            child, self._child = self._child, None
            for c in (child, spare):
                if c is not None:
                    self._close_child(c, graceful=True)
        # A spare child forked at the worker's start (prestart.FORKED_SPARES) that no abort needed:
        # a closed group leaves no process behind (a later group of this backend spawns its own).
        prestart.release(self._backend)

    def set_timeout(self, timeout: timedelta | float) -> None:
        self._timeout = as_timedelta(timeout).total_seconds()
        child = self._child
        if child is not None and child.ready and child.healthy:
            try:
                child.send(("set_timeout", self._child_timeout()))
            except OSError:
                pass

    # ---- ops --------------------------------------------------------------------------------
    def _submit(
        self, op: str, args: tuple[Any, ...], mutable: tuple[bool, ...], result: Any, peer: int | None = None
    ) -> dist.Work:
        child = self._child
        if not self._configured or child is None:
            raise self._unusable_error(op)
        if self._failures.error is not None:
            raise self._failures.error  # errored: fail fast until the next configure
        if not child.healthy:
            raise self._failures.record(op, f"baby child {child.pid} {child.death}", peer)
        event = None
        if self._backend == "nccl":
            event = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream())

        def build(req: int, staged: list[Staged]) -> tuple[Any, ...]:
            encoded = tuple(self._encode(a, child, staged, m) for a, m in zip(args, mutable, strict=True))
            return ("op", req, op, encoded, event)

        try:
            pending = child.submit(op, build, self._timeout)
        except CommunicationError as e:
            raise self._failures.record(op, e, peer) from e
        return self._work_cls(self._failures, child, pending, result, peer)

    def _encode(self, obj: Any, child: Child, staged: list[Staged], mutable: bool) -> Any:
        """Tensors -> shared-memory descriptors (CPU) or CUDA IPC (torch's reducers); lists recurse."""
        if isinstance(obj, torch.Tensor):
            if self._backend == "nccl":
                if not obj.is_cuda:
                    raise ValueError(
                        "ProcessGroupBabyNCCL takes CUDA tensors; use ProcessGroupBabyGloo for CPU"
                    )
                return obj
            if obj.device.type != "cpu":
                raise ValueError(f"ProcessGroupBabyGloo takes CPU tensors, got one on {obj.device}")
            return child.shared.encode(obj, staged, mutable)
        if isinstance(obj, (list, tuple)):
            return [self._encode(o, child, staged, mutable) for o in obj]
        return obj

    def _do_allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> dist.Work:
        return self._submit("allreduce", (tensors, _op_code(opts.reduceOp)), (True, False), tensors)

    def _do_allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions
    ) -> dist.Work:
        # One request (the backend's own coalesced op), not one per tensor: the commit vote rides
        # on DDP's last bucket this way (`worker.allreduce.reduce_across_groups`).
        return self._submit("allreduce_coalesced", (tensors, _op_code(opts.reduceOp)), (True, False), tensors)

    def _do_allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: AllgatherOptions
    ) -> dist.Work:
        return self._submit("allgather", (outputs, inputs), (True, False), outputs)

    def _do_all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions
    ) -> dist.Work:
        return self._submit("all_gather_single", (output, input), (True, False), [output])

    def _do_broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> dist.Work:
        return self._submit("broadcast", (tensors, opts.rootRank), (True, False), tensors)

    def _do_reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ReduceScatterOptions
    ) -> dist.Work:
        return self._submit(
            "reduce_scatter", (outputs, inputs, _op_code(opts.reduceOp)), (True, False, False), outputs
        )

    def _do_reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions
    ) -> dist.Work:
        return self._submit(
            "reduce_scatter_single", (output, input, _op_code(opts.reduceOp)), (True, False, False), [output]
        )

    def _do_all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: AllToAllOptions,
    ) -> dist.Work:
        return self._submit(
            "all_to_all_single",
            (output, input, output_splits, input_splits),
            (True, False, False, False),
            [output],
        )

    def _do_alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllToAllOptions
    ) -> dist.Work:
        return self._submit("alltoall", (outputs, inputs), (True, False), outputs)

    def _do_send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return self._submit("send", (tensors, dst, tag), (False, False, False), tensors, peer=dst)

    def _do_recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self._submit("recv", (tensors, src, tag), (True, False, False), tensors, peer=src)

    def _do_barrier(self, opts: BarrierOptions) -> dist.Work:
        return self._submit("barrier", (), (), [])

    def _do_reduce(self, tensors: list[torch.Tensor], opts: ReduceOptions) -> dist.Work:
        self._check_root("reduce", opts.rootRank)
        return self._submit(
            "reduce", (tensors, opts.rootRank, _op_code(opts.reduceOp)), (True, False, False), tensors
        )

    def _do_gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: GatherOptions
    ) -> dist.Work:
        self._check_root("gather", opts.rootRank)
        return self._submit("gather", (outputs, inputs, opts.rootRank), (True, False, False), outputs)

    def _do_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ScatterOptions
    ) -> dist.Work:
        self._check_root("scatter", opts.rootRank)
        return self._submit("scatter", (outputs, inputs, opts.rootRank), (True, False, False), outputs)


# torch's stub declares the RedOpType members on ReduceOp (the same objects at runtime) and leaves
# the enum itself empty.
_PREMUL_SUM = int(dist.ReduceOp.RedOpType.PREMUL_SUM)  # type: ignore[attr-defined]


def _op_code(op: dist.ReduceOp) -> int:
    # ReduceOp.op (its RedOpType) is bound at runtime but missing from torch's stub.
    code = int(op.op if isinstance(op, dist.ReduceOp) else op)  # type: ignore[attr-defined]
    if code == _PREMUL_SUM:
        raise NotImplementedError("PREMUL_SUM is not supported by Baby process groups")
    return code


def _kill_all(children: list[Child]) -> None:
    """Finalizer of a garbage-collected group: never leave a child behind."""
    for child in list(children):
        try:
            child.proc.kill()
            child.proc.wait(timeout=5.0)
        except Exception:
            pass


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """Gloo in a child process; abort never hangs. Prefer `ProcessGroupGloo` for raw speed."""

    _backend = "gloo"


class ProcessGroupBabyNCCL(ProcessGroupBaby):
    """NCCL in a child process (CUDA tensors via CUDA IPC, ordered with CUDA events).

    `Work.wait()` only orders the caller's current stream after the child's work; call
    ``torch.cuda.synchronize()`` for a CPU-side sync. The child holds its own CUDA context
    (roughly 1 GB of device memory).
    """

    _backend = "nccl"
    _work_cls = BabyWorkNCCL
    WORK_CLASS = BabyWorkNCCL
    # As torchft's: constructible without CUDA (a script may build its groups before it picks a
    # device, or on a CPU-only login node); the child starts, and CUDA is needed, at configure.
    _spawn_early = False

    def __init__(self, timeout: float | timedelta = 60.0) -> None:
        # CUDA tensors and events cross to the child through torch's pickling reducers (CUDA
        # IPC handles), registered by torch.multiprocessing.
        torch.multiprocessing.reductions.init_reductions()
        super().__init__(timeout)

    def _check_usable(self) -> None:
        if not torch.cuda.is_available():
            raise NotImplementedError("ProcessGroupBabyNCCL needs CUDA, which is not available")


def _exited(proc: prestart.ChildProcess) -> bool:
    """Whether ``proc`` has exited, also while another thread (the child's reader, which reaps it on
    a closed connection) holds its waitpid lock and `poll` answers None: a zombie has exited."""
    if proc.poll() is not None:
        return True
    try:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return False
