"""One client connection of the lighthouse's transport (`transport.HttpServer`): an asyncio protocol.

`Connection` buffers bytes until a request head is whole, has the head parsed by the standard
library (`http.HeadParser`; a keep-alive client that sends the same head again reuses that parse),
reads the body by ``Content-Length``, and hands the request to the `http.Handler`: a `http.Response`
is written at once, a `http.LongPoll` parks the connection until its answer is ready. It keeps
one timer for whichever deadline applies (a long poll's timeout, a partial request's read deadline,
the idle timeout) and tells its server when an identity bound to it is lost.

Why apart from the server: the server (`transport.HttpServer`) is the event loop, the listening
socket, the connection cap and the identities; this is what happens on one socket. It sees its
server only through `ConnectionHost`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Protocol

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
    with_new_length,
)

log = logging.getLogger("ftlaunch.lighthouse.transport")

#: Longest request head (request line + headers) accepted.
MAX_HEAD_BYTES = 65536
#: A parked connection whose peer sends more than this before its answer is dropped.
MAX_PIPELINED_BYTES = 2 << 20
#: Requests answered from one connection before the others get their turn (the rest in a later round).
REQUESTS_PER_TURN = 32
#: Error answers one connection gets before the server closes it (a real client makes none but the
#: protocol's own 408/409/410; a fuzzer pipelining thousands must not keep the loop busy).
MAX_ERRORS_PER_CONNECTION = 16


class ConnectionHost(Protocol):
    """What a `Connection` needs of its server (`transport.HttpServer`)."""

    handler: Handler
    parser: HeadParser
    recv_buffer: memoryview
    connections: set[Connection]
    bound: dict[str, set[Connection]]
    max_connections: int
    max_body: int
    read_timeout: float
    idle_timeout: float
    closing: bool

    def shed(self, newcomer: Connection) -> None: ...

    def flush(self) -> None: ...

    def answer_soon(self, conn: Connection, poll: LongPoll) -> None: ...

    def unbind(self, conn: Connection, identity: str, *, died: bool) -> None: ...


class Connection(asyncio.BufferedProtocol):
    """One client connection: requests parsed and answered in order, one at a time.

    Its single timer serves whichever deadline applies now (a long poll's timeout, the read
    deadline of a partial request, or the idle timeout); it is re-armed only when a deadline moves
    earlier, and otherwise re-checked when it fires.
    """

    def __init__(self, server: ConnectionHost, loop: asyncio.AbstractEventLoop) -> None:
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
        self._last_len = 0  # its body length (max_body is fixed per server)
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
        if not self._buf and self._poll is None and self._head is None and self._last_raw:
            # The usual read of a keep-alive client: exactly one request, with the head it sent last
            # time (http.client, LighthouseClient). Taken as it is: no buffering, no head search.
            raw = self._last_raw
            if nbytes == len(raw) + self._last_len and not self._write_paused:
                data = bytes(self._server.recv_buffer[:nbytes])
                if data.startswith(raw) and self._last_head is not None:
                    transport = self._transport
                    if transport is not None and transport.is_closing():  # the peer is gone
                        return
                    self._served, self._reading_since = True, None
                    try:
                        self._dispatch(Request(self._last_head, data[len(raw) :], self.peer, self.bind))
                    except Exception:
                        log.exception("lighthouse: unexpected error serving %s", self.peer)
                        self.close()
                    self._server.flush()
                    return
        self._buf += self._server.recv_buffer[:nbytes]
        if self._poll is not None:
            if len(self._buf) > MAX_PIPELINED_BYTES:
                log.warning(
                    "lighthouse: %s sent %d bytes while parked; dropping it", self.peer, len(self._buf)
                )
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
            last = self._last_head
            if raw == self._last_raw and last is not None:
                head, self._body_len = last, self._last_len
            else:
                reused = with_new_length(self._last_raw, last, raw) if last is not None else None
                head = reused if reused is not None else self._server.parser.parse(raw)
                self._body_len = body_length(head, self._server.max_body)
                self._last_raw, self._last_head, self._last_len = raw, head, self._body_len
            self._head = head
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
                e = HttpError(
                    e.status,
                    f"{e.message} (and closing: {self._errors} bad requests on this connection)",
                    close=True,
                    headers=e.headers,
                )
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
        if self._buf:  # what the peer sent meanwhile (nothing, for 1023 of 1024 answers of a round)
            self._serve()

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
                self._refuse(
                    HttpError(408, f"request not received within {self._server.read_timeout:g}s", close=True)
                )
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
