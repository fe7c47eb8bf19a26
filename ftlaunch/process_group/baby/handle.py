"""The parent's handle on a Baby child process: the process, its socket, and the requests in flight.

Why apart from `group`: this is the transport between the parent and its child - starting the
interpreter, the wire of small pickled tuples over a private socketpair, matching replies to
requests, deadlines, and what happens when the child dies - while `group.ProcessGroupBaby` decides
what to send and when to replace a child. The commands the child understands are in
`child`; tensors travel as shared-memory descriptors (`shm`).

Reading the socket costs a thread wake-up per op, so who reads is chosen per call: a thread
blocked in ``Work.wait()`` reads its own reply (`Child.wait_for`); one reader thread per child
serves what nobody waits for - futures, requests left un-waited for more than a moment, deadlines
(`Child._read_loop`). One reader at a time holds the reading role.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import socket
import subprocess
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import sendfds
from typing import Any

from ftlaunch.bootstrap import prestart
from ftlaunch.errors import CommunicationError
from ftlaunch.process_group.baby.shm import SharedTensors, Staged, StorageKey

logger = logging.getLogger(__name__)

__all__ = ["Child", "Pending"]

_READER_TICK = 1.0
# A request nobody waits for yet is left to a Work.wait() that usually follows at once; after this
# long the reader thread collects it (futures are served at once).
_WAITER_GRACE = 0.002


class Pending:
    """One request in flight to the child."""

    __slots__ = (
        "req",
        "op",
        "submitted",
        "deadline",
        "staged",
        "event",
        "error",
        "extra",
        "callbacks",
        "lock",
        "needs_reader",
    )

    def __init__(self, req: int, op: str, deadline: float, staged: list[Staged]) -> None:
        self.req = req
        self.op = op
        self.submitted = time.monotonic()
        self.deadline = deadline
        self.needs_reader = False  # someone waits on a future: the reader thread must serve it
        self.staged = staged
        self.event = threading.Event()
        self.error: tuple[str, str] | None = None
        self.extra: Any = None
        self.callbacks: list[Any] = []
        self.lock = threading.Lock()

    def complete(self, error: tuple[str, str] | None, extra: Any = None) -> None:
        with self.lock:
            if self.event.is_set():
                return
            self.error = error
            self.extra = extra
            self.event.set()
            callbacks, self.callbacks = self.callbacks, []
        for cb in callbacks:
            cb()

    def on_done(self, cb: Any) -> None:
        with self.lock:
            if not self.event.is_set():
                self.callbacks.append(cb)
                return
        cb()


class Child:
    """A child process, its socket, its reader thread and its table of requests in flight."""

    def __init__(self, backend: str, on_lost: Any = None) -> None:
        self.backend = backend
        self._on_lost = on_lost  # called (on the thread that notices) when the child dies on its own
        self.healthy = True
        self.ready = False
        self.death: str | None = None  # why this child is unusable
        self._pending: dict[int, Pending] = {}
        self._pending_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._reqs = itertools.count()
        self._reader: threading.Thread | None = None
        self._closed = False
        # Who reads the socket: a thread blocked in Work.wait() reads its reply itself (one
        # thread wake-up less per op than handing it over from the reader thread); the reader
        # thread serves futures, un-waited requests and deadlines. One reader at a time.
        self._io = threading.Condition()
        self._reading = False
        self._waiters = 0

        # A child started before the script imported torch (`ftlaunch.bootstrap.prestart`), else a new one.
        self.proc, parent_sock = prestart.take(backend) or prestart.spawn(backend)
        self.pid = self.proc.pid
        self._sock = parent_sock
        self._conn = Connection(os.dup(parent_sock.fileno()))
        self.shared = SharedTensors(self._send_reg, self._send_unreg)
        logger.debug("ftlaunch.process_group: started baby child pid %d (%s)", self.pid, backend)

    # ---- startup ----------------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> None:
        if self.ready:
            return
        if not self.healthy:
            raise CommunicationError(f"baby child {self.pid} is unusable: {self.death}")
        try:
            if not self._conn.poll(timeout):
                self.kill(f"did not start within {timeout:.0f}s")
                raise CommunicationError(f"baby child {self.pid} did not start within {timeout:.0f}s")
            msg = self._conn.recv()
        except (EOFError, OSError) as e:
            self.kill(f"exited during startup ({e!r})")
            raise CommunicationError(
                f"baby child {self.pid} exited during startup (exit code {self.proc.poll()})"
            ) from None
        if msg[0] != "ready":
            self.kill(f"bad startup message {msg[0]!r}")
            raise CommunicationError(f"baby child {self.pid} sent {msg[0]!r} instead of 'ready'")
        self.ready = True
        self._reader = threading.Thread(
            target=self._read_loop, name=f"ftlaunch-baby-reader-{self.pid}", daemon=True
        )
        self._reader.start()

    # ---- sending ----------------------------------------------------------------------------
    def _send_reg(self, key: StorageKey, nbytes: int, fd: int) -> None:
        self._conn.send(("reg", key, nbytes))
        sendfds(self._sock, [fd])

    def _send_unreg(self, keys: list[StorageKey]) -> None:
        self._conn.send(("unreg", keys))

    def send(self, msg: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def submit(self, op: str, build: Any, timeout: float) -> Pending:
        """Register a request and send it; `build(staged)` encodes the message under the send lock."""
        if not self.healthy:
            raise CommunicationError(f"baby child {self.pid} is unusable: {self.death}")
        req = next(self._reqs)
        staged: list[Staged] = []
        pending = Pending(req, op, time.monotonic() + timeout, staged)
        with self._send_lock:
            try:
                self.shared.flush_dead()
                msg = build(req, staged)
                with self._pending_lock:
                    self._pending[req] = pending
                if self.backend == "gloo":
                    # Plain pickle: a Gloo op is small tuples and shared-memory descriptors, and
                    # multiprocessing's ForkingPickler (needed for CUDA tensors' IPC reducers)
                    # costs several times more per message. The child reads either the same way.
                    self._conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
                else:
                    self._conn.send(msg)
            except (OSError, EOFError) as e:
                with self._pending_lock:
                    self._pending.pop(req, None)
                self.shared.release(staged, copy_back=False)
                self.kill(f"connection lost ({e!r})")
                raise CommunicationError(f"{op}: lost the connection to baby child {self.pid}: {e}") from e
            except BaseException:
                self.shared.release(staged, copy_back=False)
                raise
        return pending

    def in_flight(self) -> int:
        """How many requests are still unanswered (replies already in the socket collected first)."""
        if self.ready and self.healthy:
            self._try_read_available()
        with self._pending_lock:
            return len(self._pending)

    def busy(self) -> bool:
        """Requests still unanswered (replies already in the socket are collected first)."""
        if self.ready and self.healthy:
            self._try_read_available()
        with self._pending_lock:
            return bool(self._pending)

    # ---- receiving --------------------------------------------------------------------------
    def _read_once(self, timeout: float) -> None:
        """Read and dispatch at most one message (the caller holds the reading role)."""
        if self._conn.poll(timeout):
            msg = self._conn.recv()
            if msg[0] == "done":
                self._finish(msg[1], msg[2], msg[3])

    def _acquire_reading(self, timeout: float) -> bool:
        with self._io:
            if self._reading:
                self._io.wait(timeout)
                return False
            self._reading = True
            return True

    def _release_reading(self) -> None:
        with self._io:
            self._reading = False
            self._io.notify_all()

    def _read_and_release(self, timeout: float, drain: bool = False) -> None:
        """Read one message, waiting up to ``timeout`` (with ``drain``, then every message already
        waiting), and give up the reading role the caller holds. A broken connection fails
        everything in flight."""
        try:
            self._read_once(timeout)
            while drain and self._conn.poll(0):
                self._read_once(0)
        except (EOFError, OSError, ValueError):
            self._lost_connection()
        finally:
            self._release_reading()

    def _try_read_available(self) -> None:
        """Dispatch replies already waiting in the socket, without blocking."""
        if self._acquire_reading(0.0):
            self._read_and_release(0.0, drain=True)

    def wait_for(self, pending: Pending, limit: float) -> bool:
        """Block until `pending` completes or `limit` seconds pass, reading replies ourselves."""
        end = time.monotonic() + limit
        with self._io:
            self._waiters += 1
        try:
            while not pending.event.is_set():
                remaining = end - time.monotonic()
                if remaining <= 0:
                    break
                if not self._acquire_reading(min(remaining, _READER_TICK)):
                    continue  # another thread reads; it dispatches our reply too
                self._read_and_release(min(remaining, _READER_TICK))
                self.check_deadlines()
        finally:
            with self._io:
                self._waiters -= 1
                self._io.notify_all()
        return pending.event.is_set()

    def wake_reader(self) -> None:
        with self._io:
            self._io.notify_all()

    def _reader_should_serve(self, now: float) -> float | None:
        """None if the reader should read now, else how long it may sleep."""
        if self._reading or self._waiters:
            return _READER_TICK
        with self._pending_lock:
            pendings = list(self._pending.values())
        if not pendings:
            return _READER_TICK
        sleep = _READER_TICK
        for p in pendings:
            due = p.submitted + _WAITER_GRACE
            if p.needs_reader or due <= now or p.deadline <= now:
                return None
            sleep = min(sleep, due - now)
        return sleep

    def _read_loop(self) -> None:
        """Serve what no waiting thread reads: futures, requests nobody waits for, deadlines."""
        while not self._closed and self.healthy:
            with self._io:
                sleep = self._reader_should_serve(time.monotonic())
                if sleep is not None:
                    self._io.wait(sleep)
                    serve = False
                else:
                    self._reading = True
                    serve = True
            if serve:
                with self._pending_lock:
                    deadline = min((p.deadline for p in self._pending.values()), default=None)
                wait = _READER_TICK if deadline is None else max(0.0, deadline - time.monotonic())
                self._read_and_release(min(_READER_TICK, wait))
            self.check_deadlines()

    def _lost_connection(self) -> None:
        """EOF from the child: it died (or we closed it). Fail everything; report a death."""
        unexpected = self.healthy and not self._closed
        reason = f"exited (exit code {self.proc.poll()})" if unexpected else "connection closed"
        self._fail_all(reason)
        if unexpected:
            logger.warning("ftlaunch.process_group: baby child %d %s", self.pid, reason)
            if self._on_lost is not None:
                self._on_lost()

    def _finish(self, req: int, error: tuple[str, str] | None, extra: Any) -> None:
        with self._pending_lock:
            pending = self._pending.pop(req, None)
        if pending is None:
            return
        try:
            self.shared.release(pending.staged, copy_back=error is None)
        except Exception as e:  # copying back can only fail on caller misuse (e.g. resized tensor)
            error = error or ("value", f"copying results back failed: {e}")
        if error is not None and error[0] == "internal":
            self.kill(f"internal error in {pending.op}: {error[1]}")
        pending.complete(error, extra)

    def check_deadlines(self) -> None:
        now = time.monotonic()
        with self._pending_lock:
            expired = [p for p in self._pending.values() if p.deadline <= now]
        if expired and self.healthy:
            ops = ", ".join(sorted({p.op for p in expired}))
            self.kill(f"{ops} timed out; child killed")
            if self._on_lost is not None:
                self._on_lost()

    def _fail_all(self, reason: str) -> None:
        self.healthy = False
        self.death = self.death or reason
        with self._pending_lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            self.shared.release(p.staged, copy_back=False)
            p.complete(("comm", f"baby child {self.pid} {self.death}"))
        self.wake_reader()

    # ---- ending -----------------------------------------------------------------------------
    def kill(self, reason: str, quiet: bool = False) -> None:
        """SIGKILL the child and fail everything in flight. Returns at once; idempotent."""
        self.healthy = False
        if self.death is None:
            self.death = reason
            log = logger.info if quiet else logger.warning
            log("ftlaunch.process_group: killing baby child %d: %s", self.pid, reason)
        try:
            self.proc.kill()
        except OSError:
            pass
        self._fail_all(reason)

    def close(self, graceful: bool) -> None:
        """Stop the child and release the socket, the reader thread and the process entry."""
        if self._closed:
            return
        self._closed = True
        if graceful and self.healthy and self.proc.poll() is None:
            try:
                self.send(("shutdown",))
                self.proc.wait(timeout=5.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.healthy = False
        self.death = self.death or "shut down"
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except OSError:
                pass
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a reader out of poll()
        except OSError:
            pass
        self.wake_reader()
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=10.0)
        self._fail_all(self.death)
        self.shared.close()
        self._conn.close()
        self._sock.close()
        try:
            self.proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            logger.error("ftlaunch.process_group: baby child %d did not exit after SIGKILL", self.pid)
