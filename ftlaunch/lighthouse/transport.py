"""The lighthouse's transport: HTTP/1.1 connections on one asyncio event-loop thread.

`HttpServer` accepts connections on a listening socket and drives each with a `connection.Connection`
protocol: bytes are buffered until a request head is whole, the head is parsed by the standard
library (`http.HeadParser`; a keep-alive client that sends the same head again, as http.client
does request after request, reuses that parse), the body is read by ``Content-Length``, and the
`http.Handler` answers with a `http.Response`, or with a `http.LongPoll` that parks the connection
without blocking anything until the poll says (from any thread) that its answer is ready.

It knows no quorums, only *identities*: a handler may `http.Request.bind` a connection to one (a
replica id), and when the peer closes or resets the last connection bound to an identity, the
handler hears `http.Handler.identity_lost` at once. That is how a dead process is noticed within
milliseconds, also while its request is parked. A connection the server closes itself (idle
timeout, an error answer, shutdown) tells nobody.

Limits (docs/lighthouse.md, docs/security.md): `MAX_HEAD_BYTES` (414/431), ``max_body`` (413),
``read_timeout`` (408; also the time a new connection has to send its first request),
``idle_timeout``, `MAX_PIPELINED_BYTES` while parked, ``max_connections`` (below the process's
file-descriptor limit; past it the longest-idle connection is closed); a client that does not read
its answers is not read from until it does.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from ftlaunch.lighthouse.connection import (
    MAX_ERRORS_PER_CONNECTION,
    MAX_HEAD_BYTES,
    MAX_PIPELINED_BYTES,
    REQUESTS_PER_TURN,
    Connection,
)
from ftlaunch.lighthouse.http import Handler, HeadParser, LongPoll
from ftlaunch.lighthouse.limits import CAP_WARNING_INTERVAL, default_max_connections

# The per-connection limits live with the connection (connection.py); they are read here too.
__all__ = [
    "ACCEPTS_IN_FLIGHT",
    "ACCEPT_BATCH",
    "LISTEN_BACKLOG",
    "MAX_ERRORS_PER_CONNECTION",
    "MAX_HEAD_BYTES",
    "MAX_PIPELINED_BYTES",
    "RECV_SIZE",
    "REQUESTS_PER_TURN",
    "SHUTDOWN_FLUSH_TIMEOUT",
    "Connection",
    "HttpServer",
]

log = logging.getLogger(__name__)

#: Bytes asked of the kernel per read.
RECV_SIZE = 65536
#: Pending connections the kernel queues before the loop accepts them.
LISTEN_BACKLOG = 256
#: Connections asyncio accepts in one go (its ``backlog`` argument); a few batches can be accepted
#: before any of them is counted against the cap, so the cap leaves room for `ACCEPTS_IN_FLIGHT`.
ACCEPT_BATCH = 32
ACCEPTS_IN_FLIGHT = 4 * ACCEPT_BATCH
#: How long `HttpServer.close` lets answers already due (the 503s of parked requests) drain.
SHUTDOWN_FLUSH_TIMEOUT = 1.0


class HttpServer:
    """Serves a `Handler` on a listening socket from one event-loop thread (``start``..``close``).

    ``idle_timeout`` and ``read_timeout`` are read whenever a deadline is computed, so changing them
    applies to the next deadline of every connection.
    """

    def __init__(
        self,
        sock: socket.socket,
        handler: Handler,
        *,
        idle_timeout: float,
        read_timeout: float,
        max_body: int,
        max_connections: int | None = None,
    ) -> None:
        self.handler = handler
        #: Open connections allowed; past it the oldest idle one is closed (see `shed`).
        self.max_connections = (
            max_connections if max_connections is not None else default_max_connections(ACCEPTS_IN_FLIGHT)
        )
        self._cap_warned_at = -math.inf
        self.idle_timeout = idle_timeout
        self.read_timeout = read_timeout
        self.max_body = max_body
        self.parser = HeadParser()
        #: Where every connection's bytes are received (event-loop thread only).
        self.recv_buffer = memoryview(bytearray(RECV_SIZE))
        #: The event loop, from `start` on.
        self.loop: asyncio.AbstractEventLoop | None = None
        self.connections: set[Connection] = set()
        #: identity -> its bound connections (event-loop thread only; `bound_count` reads it).
        self.bound: dict[str, set[Connection]] = {}
        self.closing = False
        self._sock = sock
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._loop_ident: int | None = None
        self._answers: deque[tuple[Connection, LongPoll]] = deque()
        self._flush_scheduled = False
        self._periodic: list[asyncio.TimerHandle] = []

    # -- lifecycle (any thread)

    def start(self, name: str = "lighthouse-io") -> None:
        if self._thread is not None:
            raise RuntimeError("already started")
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name=name, daemon=True)
        self._thread.start()
        started.wait()
        if self._server is None:
            raise RuntimeError("the event loop did not start serving (see the log)")

    @property
    def running(self) -> bool:
        """Whether the event-loop thread is serving (False before `start`, after `close` or a crash)."""
        return self._thread is not None and self._thread.is_alive() and not self.closing

    def _run(self, started: threading.Event) -> None:
        loop = self._running_loop()
        asyncio.set_event_loop(loop)
        self._loop_ident = threading.get_ident()
        try:
            self._server = loop.run_until_complete(
                loop.create_server(lambda: Connection(self, loop), sock=self._sock, backlog=ACCEPT_BATCH)
            )
            self._sock.listen(
                LISTEN_BACKLOG
            )  # asyncio re-listened with the batch size: the kernel queues more
        except Exception:
            log.exception("lighthouse: cannot serve")
            loop.close()
            return
        finally:
            started.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            raise RuntimeError("the transport was not started")
        return self.loop

    def call_every(self, period: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the event loop every ``period`` seconds until `close` (after `start`)."""
        loop = self._running_loop()

        def tick() -> None:
            if self.closing:
                return
            try:
                fn()
            except Exception:  # keep ticking: a bug here must not stop what the tick serves
                log.exception("lighthouse: periodic %s failed", getattr(fn, "__name__", fn))
            self._periodic[:] = [loop.call_later(period, tick)]

        loop.call_soon_threadsafe(lambda: self._periodic.append(loop.call_later(period, tick)))

    def close(self) -> None:
        """Stop accepting, let answers already due go out (at most `SHUTDOWN_FLUSH_TIMEOUT`), close
        every connection and stop the loop. Idempotent; callable before `start`."""
        self.closing = True
        loop = self.loop
        if self._thread is None or self._server is None or loop is None:
            self._sock.close()
            return
        if loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close(), loop).result(SHUTDOWN_FLUSH_TIMEOUT + 5.0)
        except Exception:  # the loop is gone or stuck: nothing more to flush
            log.debug("lighthouse: transport close", exc_info=True)
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:  # already closed
            pass
        self._thread.join(5.0)

    async def _close(self) -> None:
        for handle in self._periodic:
            handle.cancel()
        self.flush()  # the answers due now (e.g. the 503s of a shutdown)
        if self._server is not None:
            self._server.close()  # stops accepting; closes the listening socket
        for conn in list(self.connections):
            conn.close()
        deadline = time.monotonic() + SHUTDOWN_FLUSH_TIMEOUT
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        for conn in list(self.connections):
            conn.abort()
        await asyncio.sleep(0)  # let connection_lost run

    def shed(self, newcomer: Connection) -> None:
        """Over `max_connections`: close the idle connection unused longest -- one bound to no group
        first (a group's heartbeat connection only if nothing else is idle; the group reconnects at
        its next beat, and a close by the server is not a death) -- else refuse ``newcomer``. Parked
        and half-received requests are never closed: a flood of sockets cannot push a group out."""
        idle = [c for c in self.connections if c is not newcomer and c.idle]
        victim = min(idle, key=lambda c: (c.bound, c.last_active), default=None)
        now = time.monotonic()
        if now - self._cap_warned_at >= CAP_WARNING_INTERVAL:
            self._cap_warned_at = now
            log.warning(
                "lighthouse: %d connections open (cap %d): closing the longest-idle ones as new ones arrive",
                len(self.connections),
                self.max_connections,
            )
        (victim or newcomer).abort()

    # -- long-poll answers (any thread)

    def answer_soon(self, conn: Connection, poll: LongPoll) -> None:
        """Have the loop write ``poll``'s answer on ``conn``: at the end of the request being served, or
        (resolved elsewhere: a timer, another thread) in the loop's next round."""
        self._answers.append((conn, poll))
        if self._flush_scheduled:
            return
        self._flush_scheduled = True
        loop = self._running_loop()
        try:
            if threading.get_ident() == self._loop_ident:
                loop.call_soon(self.flush)
            else:
                loop.call_soon_threadsafe(self.flush)
        except RuntimeError:  # the loop is closed: nobody is left to answer
            pass

    def flush(self) -> None:
        """Write the answers that are ready (event-loop thread)."""
        self._flush_scheduled = False  # before draining: a poll ready meanwhile schedules another flush
        answers = self._answers
        while answers:
            conn, poll = answers.popleft()
            conn.answer(poll)

    # -- identities (event-loop thread, except bound_count)

    def unbind(self, conn: Connection, identity: str, *, died: bool) -> None:
        peers = self.bound.get(identity)
        if peers is None:
            return
        peers.discard(conn)
        if peers:
            return
        del self.bound[identity]
        if died:
            try:
                self.handler.identity_lost(identity)
            except Exception:
                log.exception("lighthouse: handling the loss of %s failed", identity)

    def bound_count(self, identity: str) -> int:
        """Open connections bound to ``identity`` (any thread: one atomic dict read)."""
        return len(self.bound.get(identity, ()))
