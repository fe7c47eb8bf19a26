"""The child process of a Baby process group: hosts the real backend, runs one op at a time.

Started by `ftlaunch.process_group.baby` as ``python -m ftlaunch.process_group.baby.child``
(a fresh interpreter: the user's ``__main__`` is never re-imported, unlike multiprocessing's
spawn). It talks only to its parent over an inherited socketpair; it exits when the parent
closes the socket, sends "shutdown", or dies (PR_SET_PDEATHSIG where usable, and a watchdog
that polls the parent pid for the cases PDEATHSIG misses).
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import queue
import signal
import socket
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds
from typing import Any

from ftlaunch import env, phases
from ftlaunch.lifetime import die_with_parent

logger = logging.getLogger("ftlaunch.process_group.baby_child")

_WATCHDOG_INTERVAL = 0.25


def _die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    """Make sure this process never outlives the parent that owns it."""
    if use_pdeathsig:
        die_with_parent(signal.SIGKILL, expected_parent=parent_pid)
    if os.getppid() != parent_pid:  # the parent died before we got here
        os._exit(1)

    def _watch() -> None:
        while True:
            time.sleep(_WATCHDOG_INTERVAL)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=_watch, name="ftlaunch-baby-watchdog", daemon=True).start()


class _Server:
    """Executes the parent's requests in order."""

    def __init__(self, conn: Connection, sock: socket.socket, backend: str) -> None:
        import torch

        from ftlaunch.process_group.baby.shm import ChildStorages

        self._torch = torch
        self._conn = conn
        self._sock = sock
        self._backend = backend
        self._storages = ChildStorages()
        self._pg: Any = None
        self._timeout = 60.0
        self._device: int | None = None
        # NCCL: keep recent works/events alive until the parent has surely consumed them.
        self._recent: deque[Any] = deque(maxlen=256)
        # Replies come from the main loop and from the completion thread.
        self._send_lock = threading.Lock()
        # Point-to-point works are waited for, in issue order, by one completion thread.
        self._inflight: queue.SimpleQueue[tuple[int, Any, Any] | None] = queue.SimpleQueue()
        self._completer = threading.Thread(
            target=self._complete_loop, name="ftlaunch-baby-completer", daemon=True
        )
        self._completer.start()

    def serve(self) -> None:
        phases.mark("baby_child_ready")
        with self._send_lock:
            self._conn.send(("ready", os.getpid()))
        try:
            while True:
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    return
                kind = msg[0]
                if kind == "op":
                    self._op(msg[1], msg[2], msg[3], msg[4] if len(msg) > 4 else None)
                elif kind == "reg":
                    _, key, nbytes = msg
                    fds = recvfds(self._sock, 1)
                    self._storages.add(key, nbytes, fds[0])
                elif kind == "unreg":
                    self._storages.drop(msg[1])
                elif kind == "configure":
                    self._configure(*msg[1:])
                elif kind == "set_timeout":
                    self._timeout = float(msg[1])
                    if self._pg is not None:
                        self._pg.set_timeout(self._timeout)
                elif kind == "shutdown":
                    return
                else:
                    logger.error("ftlaunch baby child: unknown message %r", kind)
                    return
        finally:
            self._inflight.put(None)
            self._completer.join(timeout=self._timeout)
            if self._pg is not None:
                self._pg.shutdown()
                self._pg = None

    def _reply(self, req: int, error: tuple[str, str] | None, extra: Any = None) -> None:
        with self._send_lock:
            try:
                # Plain pickle (a reply holds no tensor): cheaper than the Connection's ForkingPickler.
                self._conn.send_bytes(pickle.dumps(("done", req, error, extra), pickle.HIGHEST_PROTOCOL))
            except OSError:  # the parent is gone; the main loop sees EOF and exits
                pass

    def _configure(
        self,
        req: int,
        store_addr: str,
        rank: int,
        world_size: int,
        timeout: float,
        device: int | None,
        environ: dict[str, str] | None = None,
    ) -> None:
        from ftlaunch.process_group.wrappers import ProcessGroupGloo, ProcessGroupNCCL

        self._timeout = timeout
        if environ is not None:
            # The worker's environment when it configured: what a backend reads when it builds
            # its first communicator (NCCL_*, GLOO_*) is then the worker's, even for a child
            # started before the script set it. A CUDA context, once made, stays as it was.
            env.mirror(environ)
        try:
            if self._pg is None:
                if self._backend == "gloo":
                    self._pg = ProcessGroupGloo(timeout=timeout)
                elif self._backend == "nccl":
                    self._pg = ProcessGroupNCCL(timeout=timeout)
                else:
                    raise ValueError(f"unknown backend {self._backend!r}")
            else:
                self._pg.set_timeout(timeout)
            if device is not None and self._backend == "nccl":
                self._device = device
                self._torch.cuda.set_device(device)
            self._pg.configure(store_addr, rank, world_size)
        except Exception as e:
            self._reply(req, _classify(e))
        else:
            self._reply(req, None)

    def _decode(self, obj: Any) -> Any:
        from ftlaunch.process_group.baby.shm import TensorDesc

        if isinstance(obj, TensorDesc):
            return self._storages.tensor(obj)
        if isinstance(obj, list):
            return [self._decode(o) for o in obj]
        return obj

    def _op(self, req: int, op: str, args: tuple[Any, ...], event: Any) -> None:
        torch = self._torch
        dist = torch.distributed
        try:
            if self._pg is None:
                raise ValueError(f"{op}: the process group is not configured")
            a = [self._decode(x) for x in args]
            if event is not None:  # CUDA: order after the parent's producer stream
                torch.cuda.current_stream().wait_event(event)
            pg = self._pg
            if op == "allreduce":
                work = pg.allreduce(a[0], dist.ReduceOp(dist.ReduceOp.RedOpType(a[1])))
            elif op == "allreduce_coalesced":
                work = pg.allreduce_coalesced(a[0], dist.ReduceOp(dist.ReduceOp.RedOpType(a[1])))
            elif op == "allgather":
                work = pg.allgather(a[0], a[1])
            elif op == "all_gather_single":
                work = pg.all_gather_single(a[0], a[1])
            elif op == "broadcast":
                work = pg.broadcast(a[0], a[1])
            elif op == "reduce_scatter":
                work = pg.reduce_scatter(a[0], a[1], dist.ReduceOp(dist.ReduceOp.RedOpType(a[2])))
            elif op == "reduce_scatter_single":
                work = pg.reduce_scatter_single(a[0], a[1], dist.ReduceOp(dist.ReduceOp.RedOpType(a[2])))
            elif op == "all_to_all_single":
                work = pg.all_to_all_single(a[0], a[1], a[2], a[3])
            elif op == "alltoall":
                work = pg.alltoall(a[0], a[1])
            elif op == "send":
                work = pg.send(a[0], a[1], a[2])
            elif op == "recv":
                work = pg.recv(a[0], a[1], a[2])
            elif op == "barrier":
                work = pg.barrier()
            elif op == "reduce":
                work = pg.reduce(a[0], a[1], dist.ReduceOp(dist.ReduceOp.RedOpType(a[2])))
            elif op == "gather":
                work = pg.gather(a[0], a[1], a[2])
            elif op == "scatter":
                work = pg.scatter(a[0], a[1], a[2])
            else:
                raise NotImplementedError(f"unknown op {op!r}")
            if event is None and op in ("send", "recv"):
                # Point-to-point: a completion thread waits, so this loop keeps issuing (a send
                # and the matching recv issued after it must both be in flight).
                self._inflight.put((req, work, a))
                return
            if event is None:
                # Collectives are matched by issue order on every rank, so waiting for each one
                # here cannot deadlock - and saves a thread hand-off per op.
                work.wait()
                self._reply(req, None)
                return
            work.wait()  # NCCL: only orders the current stream after the collective
            done = torch.cuda.Event(interprocess=True)
            done.record(torch.cuda.current_stream())
            self._recent.append((work, done, a))
            extra = (torch.cuda.current_device(), done.ipc_handle())
        except Exception as e:
            self._reply(req, _classify(e))
        else:
            self._reply(req, None, extra)

    def _complete_loop(self) -> None:
        while True:
            item = self._inflight.get()
            if item is None:
                return
            req, work, _tensors = item  # the tensors stay referenced until the op is done
            try:
                work.wait()
            except Exception as e:
                self._reply(req, _classify(e))
            else:
                self._reply(req, None)
            del item, work, _tensors


def _classify(e: BaseException) -> tuple[str, str]:
    from ftlaunch.errors import CommunicationError
    from ftlaunch.process_group._store import first_line

    if isinstance(e, CommunicationError):
        # The parent adds op, rank and store itself: send the backend's own words.
        return ("comm", first_line(e.__cause__) if e.__cause__ is not None else str(e))
    if isinstance(e, (ValueError, TypeError)):
        return ("value", str(e))
    if isinstance(e, NotImplementedError):
        return ("notimpl", str(e))
    return ("internal", f"{type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="ftlaunch Baby process group child (internal)")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--pdeathsig", type=int, default=1)
    args = parser.parse_args(argv)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _die_with_parent(args.parent_pid, bool(args.pdeathsig))
    logging.basicConfig(level=logging.WARNING, format="[ftlaunch baby child %(process)d] %(message)s")

    conn = Connection(args.fd)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(args.fd))
    try:
        _Server(conn, sock, args.backend).serve()
    finally:
        sock.close()
        conn.close()


if __name__ == "__main__":
    main()
