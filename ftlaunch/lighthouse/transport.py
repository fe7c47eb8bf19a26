"""The lighthouse's transport: HTTP/1.1 connections on one asyncio event-loop thread.

`HttpServer` accepts connections on a listening socket and drives each with a `_Connection`
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

from ftlaunch.lighthouse.http import (
    Handler,
    Head,
    HeadParser,
    HttpError,
    LongPoll,
    Request,
    Response,
    body_length,
    head_end,
    phrase,
)
from ftlaunch.lighthouse.limits import CAP_WARNING_INTERVAL, default_max_connections

log = logging.getLogger(__name__)

#: Longest request head (request line + headers) accepted.
MAX_HEAD_BYTES = 65536
#: A parked connection whose peer sends more than this before its answer is dropped.
MAX_PIPELINED_BYTES = 2 << 20
#: Bytes asked of the kernel per read.
RECV_SIZE = 65536
#: Pending connections the kernel queues before the loop accepts them.
LISTEN_BACKLOG = 256
#: Connections asyncio accepts in one go (its ``backlog`` argument); a few batches can be accepted
#: before any of them is counted against the cap, so the cap leaves room for `ACCEPTS_IN_FLIGHT`.
ACCEPT_BATCH = 32
ACCEPTS_IN_FLIGHT = 4 * ACCEPT_BATCH
#: Requests answered from one connection before the others get their turn (the rest in a later round).
REQUESTS_PER_TURN = 32
#: Error answers one connection gets before the server closes it (a real client makes none but the
#: protocol's own 408/409/410; a fuzzer pipelining thousands must not keep the loop busy).
MAX_ERRORS_PER_CONNECTION = 16
#: How long `HttpServer.close` lets answers already due (the 503s of parked requests) drain.
SHUTDOWN_FLUSH_TIMEOUT = 1.0
class _Connection(asyncio.BufferedProtocol):
    """One client connection: requests parsed and answered in order, one at a time.

    Its single timer serves whichever deadline applies now (a long poll's timeout, the read
    deadline of a partial request, or the idle timeout); it is re-armed only when a deadline moves
    earlier, and otherwise re-checked when it fires.
    """

    def __init__(self, server: HttpServer, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self.peer = "?"
        self._buf = bytearray()
        self._scan = 0  # the end of the head is searched for from here
        self._head: Head | None = None  # parsed, waiting for its body
        self._body_len = 0
        self._continue_sent = False
        self._last_raw = b""  # the last head parsed on this connection, and its parse
        self._last_head: Head | None = None
        self._poll: LongPoll | None = None
        self._poll_request: Request | None = None
        self._parked_at = 0.0
        self._identity: str | None = None
        self._eof = False  # the peer closed its side (or reset)
        self._closing = False
        self._timed_out = False
        self._write_paused = False
        self._reading_since: float | None = None
        self._last_active = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._served = False  # a whole request arrived on it (until then it has read_timeout to send one)
        self._errors = 0  # error answers so far (see MAX_ERRORS_PER_CONNECTION)
        self._resume: asyncio.Handle | None = None  # the next turn of a connection with requests left

    @property
    def idle(self) -> bool:
        """Nothing parked, nothing half-received: closing it loses nothing (the client reconnects)."""
        return not self._closing and self._poll is None and self._head is None and not self._buf

    @property
    def bound(self) -> bool:
        return self._identity is not None

    @property
    def last_active(self) -> float:
        return self._last_active

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if self._server.closing:
            transport.abort()
            return
        self._server.connections.add(self)
        self._last_active = self._loop.time()
        if len(self._server.connections) > self._server.max_connections:
            self._server.shed(self)
            if self._closing:
                return
        self._arm()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._server.recv_buffer  # one per loop: each read is consumed before the next

    def buffer_updated(self, nbytes: int) -> None:
        if self._closing:
            return
        self._buf += self._server.recv_buffer[:nbytes]
        if self._poll is not None:
            if len(self._buf) > MAX_PIPELINED_BYTES:
                log.warning("lighthouse: %s sent %d bytes while parked; dropping it", self.peer, len(self._buf))
                self.close()
            return
        self._serve()
        self._server.flush()  # a quorum this request completed is answered now, not after the batch

    def eof_received(self) -> bool:
        self._eof = True
        if self._poll is None and not self._closing:
            self._serve(limit=None)  # what arrived before the EOF is still answered
            if self._head is not None and not self._closing:
                self._refuse(HttpError(400, "truncated request body", close=True))
        # Closed after the answers written above; a parked request's peer died: withdrawn by
        # connection_lost, which also tells the handler if this was the identity's last connection.
        self.close()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        poll, self._poll = self._poll, None
        if poll is not None:
            poll.cancel()
        self._server.connections.discard(self)
        if self._identity is not None:
            died = (self._eof or exc is not None) and not self._timed_out and not self._server.closing
            self._server.unbind(self, self._identity, died=died)
        self._buf = bytearray()

    def pause_writing(self) -> None:
        # The peer does not read its answers: read no more requests until it does.
        self._write_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._transport is not None and not self._closing:
            self._transport.resume_reading()
            self._serve()

    # -- requests

    def _serve(self, limit: int | None = REQUESTS_PER_TURN) -> None:
        """Answer the requests buffered, in order, until one is partial or parks -- at most ``limit``
        now; with more left, the rest in a later round of the loop, after the other connections."""
        try:
            served = 0
            while not (self._closing or self._poll is not None or self._write_paused):
                transport = self._transport
                if transport is not None and transport.is_closing():  # the peer is gone: answer nobody
                    return
                if limit is not None and served >= limit:
                    if self._resume is None:
                        self._resume = self._loop.call_soon(self._next_turn)
                    return
                request = self._next_request()
                if request is None:
                    return
                self._dispatch(request)
                served += 1
        except HttpError as e:
            self._refuse(e)
        except Exception:
            log.exception("lighthouse: unexpected error serving %s", self.peer)
            self.close()

    def _next_request(self) -> Request | None:
        """The next whole request in the buffer, or None (then the read deadline runs)."""
        buf = self._buf
        if self._head is None:
            if not buf:
                self._reading_since = None
                return None
            if buf.startswith((b"\r\n", b"\n")):
                raise HttpError(0, "empty request line")
            end = head_end(buf, self._scan, MAX_HEAD_BYTES + 4)
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    if buf.find(b"\n", 0, MAX_HEAD_BYTES) < 0:
                        raise HttpError(414, phrase(414), close=True)
                    raise HttpError(431, f"request head over {MAX_HEAD_BYTES} bytes", close=True)
                self._scan = max(0, len(buf) - 2)
                self._start_reading()
                return None
            if end > MAX_HEAD_BYTES:
                raise HttpError(431, f"request head over {MAX_HEAD_BYTES} bytes", close=True)
            raw = bytes(buf[:end])
            del buf[:end]
            self._scan = 0
            if raw == self._last_raw and self._last_head is not None:
                head = self._last_head
            else:
                head = self._server.parser.parse(raw)
                self._last_raw, self._last_head = raw, head
            self._head = head
            self._body_len = body_length(head, self._server.max_body)
        head = self._head
        n = self._body_len
        if len(buf) < n:
            if head.expect_continue and not self._continue_sent:
                self._continue_sent = True
                self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._start_reading()
            return None
        body = bytes(buf[:n])
        del buf[:n]
        self._head, self._continue_sent, self._reading_since = None, False, None
        self._served = True
        return Request(head, body, self.peer, self.bind)

    def _next_turn(self) -> None:
        self._resume = None
        if not self._closing:
            self._serve()
            self._server.flush()

    def _dispatch(self, request: Request) -> None:
        handler = self._server.handler
        try:
            result = handler.handle(request)
        except HttpError as e:
            if e.status == 0:
                self.close()
                return
            self._errors += 1
            if self._errors >= MAX_ERRORS_PER_CONNECTION and not e.close:
                e = HttpError(e.status, f"{e.message} (and closing: {self._errors} bad requests on this connection)",
                              close=True, headers=e.headers)
            result = handler.error(e, request.head, self.peer)
        if isinstance(result, Response):
            self._respond(result, close=request.head.close, head_only=request.method == "HEAD")
        else:
            self._park(result, request)

    def _refuse(self, error: HttpError) -> None:
        """Answer a request the transport itself refuses (and close if the error says so)."""
        if error.status == 0:
            self.close()
            return
        self._respond(self._server.handler.error(error, self._head, self.peer), close=True)

    def _respond(self, response: Response, *, close: bool, head_only: bool = False) -> None:
        close = close or response.close or self._eof
        self._write(response.encode(close=close, head_only=head_only))
        self._last_active = self._loop.time()
        if close:
            self.close()
        else:
            self._arm()

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    # -- long polls

    def _park(self, poll: LongPoll, request: Request) -> None:
        self._poll, self._poll_request = poll, request
        self._parked_at = self._loop.time()
        self._arm()
        poll.on_ready(lambda: self._server.answer_soon(self, poll))

    def answer(self, poll: LongPoll) -> None:
        """Write the answer of ``poll`` if it is still the one parked here (event-loop thread)."""
        if self._poll is not poll or self._closing:
            return
        request = self._poll_request
        self._poll = self._poll_request = None
        try:
            response = poll.answer()
        except Exception:
            log.exception("lighthouse: unexpected error answering %s", self.peer)
            response = None
        if response is None:
            self.close()
            return
        assert request is not None
        self._respond(response, close=request.head.close)
        self._serve()  # what the peer sent meanwhile

    # -- identity, deadlines, closing

    def bind(self, identity: str) -> None:
        if self._identity == identity or self._closing:
            return
        if self._identity is not None:
            self._server.unbind(self, self._identity, died=False)
        self._identity = identity
        self._server.bound.setdefault(identity, set()).add(self)

    def _start_reading(self) -> None:
        if self._reading_since is None:
            self._reading_since = self._loop.time()
            self._arm()

    def _deadline(self) -> float:
        if self._poll is not None:
            return self._parked_at + self._poll.timeout
        if self._reading_since is not None:
            return self._reading_since + self._server.read_timeout
        if not self._served:  # connected and silent: a client sends its request at once
            return self._last_active + min(self._server.idle_timeout, self._server.read_timeout)
        return self._last_active + self._server.idle_timeout

    def _arm(self) -> None:
        when = self._deadline()
        if when < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = self._loop.call_at(when, self._on_timer), when

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, math.inf
        if self._closing:
            return
        if self._deadline() > self._loop.time():  # moved since it was armed
            self._arm()
            return
        try:
            if self._poll is not None:  # the long poll's own timeout: the poll answers it
                self._poll.expire()
            elif self._reading_since is not None:  # a slow (or stalled) client
                self._timed_out = True
                self._refuse(HttpError(408, f"request not received within {self._server.read_timeout:g}s", close=True))
            else:  # idle keep-alive, or a peer that does not read its answers: not a death
                self.close()
        except Exception:
            log.exception("lighthouse: unexpected error serving %s", self.peer)
            self.close()

    def close(self) -> None:
        """Close after what is already written (`connection_lost` does the bookkeeping)."""
        if not self._closing:
            self._closing = True
            if self._transport is not None:
                self._transport.close()

    def abort(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.abort()


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
        self.max_connections = max_connections if max_connections is not None else default_max_connections(ACCEPTS_IN_FLIGHT)
        self._cap_warned_at = -math.inf
        self.idle_timeout = idle_timeout
        self.read_timeout = read_timeout
        self.max_body = max_body
        self.parser = HeadParser()
        #: Where every connection's bytes are received (event-loop thread only).
        self.recv_buffer = memoryview(bytearray(RECV_SIZE))
        #: The event loop, from `start` on.
        self.loop: asyncio.AbstractEventLoop | None = None
        self.connections: set[_Connection] = set()
        #: identity -> its bound connections (event-loop thread only; `bound_count` reads it).
        self.bound: dict[str, set[_Connection]] = {}
        self.closing = False
        self._sock = sock
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._loop_ident: int | None = None
        self._answers: deque[tuple[_Connection, LongPoll]] = deque()
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

    def _run(self, started: threading.Event) -> None:
        loop = self._running_loop()
        asyncio.set_event_loop(loop)
        self._loop_ident = threading.get_ident()
        try:
            self._server = loop.run_until_complete(
                loop.create_server(lambda: _Connection(self, loop), sock=self._sock, backlog=ACCEPT_BATCH)
            )
            self._sock.listen(LISTEN_BACKLOG)  # asyncio re-listened with the batch size: the kernel queues more
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

    def shed(self, newcomer: _Connection) -> None:
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
                len(self.connections), self.max_connections,
            )
        (victim or newcomer).abort()

    # -- long-poll answers (any thread)

    def answer_soon(self, conn: _Connection, poll: LongPoll) -> None:
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

    def unbind(self, conn: _Connection, identity: str, *, died: bool) -> None:
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
