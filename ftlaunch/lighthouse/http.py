"""HTTP/1.1 messages for the lighthouse: a parsed request, a response, and the contracts between the
transport (``transport.py``) and whatever it serves (``routes.py``).

A request head is parsed by the standard library (`http.server.BaseHTTPRequestHandler.parse_request`,
which uses `http.client.parse_headers`), once it has arrived whole. A `Handler` turns each `Request`
into a `Response` now, or into a `LongPoll` answered later. Nothing here knows quorums or sockets.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Protocol

#: Methods the handler answers (an unknown route or method is its 404/405); any other gets 501.
METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})

_PHRASES = {s.value: s.phrase for s in HTTPStatus}


def phrase(status: int) -> str:
    """The reason phrase of ``status`` ("Not Found")."""
    return _PHRASES.get(status, "")


class HttpError(Exception):
    """An error answer: ``status`` (0: close without answering), message, extra headers, and
    whether the connection closes after it."""

    def __init__(
        self, status: int, message: str, *, close: bool = False, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close
        self.headers = headers or {}


@dataclass(frozen=True)
class Head:
    """A parsed request head (http.server's reading of it)."""

    method: str
    path: str
    version: str
    #: Header names lower-cased, the first of repeated ones (as `email.message.Message.get` reads).
    headers: Mapping[str, str]
    #: The client asked to close after the response (HTTP/1.0, ``Connection: close``).
    close: bool
    expect_continue: bool


class Request:
    """One request, its body read whole."""

    __slots__ = ("head", "body", "peer", "_bind")

    def __init__(self, head: Head, body: bytes, peer: str, bind: Callable[[str], None]) -> None:
        self.head = head
        self.body = body
        #: ``host:port`` of the client.
        self.peer = peer
        self._bind = bind

    @property
    def method(self) -> str:
        return self.head.method

    @property
    def path(self) -> str:
        return self.head.path

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (any case), or None."""
        return self.head.headers.get(name.lower())

    def bind(self, identity: str) -> None:
        """Tie this request's connection to ``identity`` (rebinding drops the old one): when the peer
        closes the identity's last bound connection, the handler hears `Handler.identity_lost`."""
        self._bind(identity)


class Response:
    """A complete response. Its bytes are encoded once and reused: a quorum answer, shared by every
    member, is encoded once however many connections it goes to."""

    __slots__ = ("status", "body", "content_type", "headers", "close", "_wire")

    def __init__(
        self,
        status: int,
        body: bytes = b"",
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
        *,
        close: bool = False,
    ) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers or {}
        #: Close the connection after this response.
        self.close = close
        self._wire: bytes | None = None

    def encode(self, *, close: bool, head_only: bool = False) -> bytes:
        """Status line, headers (``Connection: close`` if ``close``) and, unless ``head_only``, the body."""
        if self._wire is not None and not close and not head_only:
            return self._wire
        lines = [
            f"HTTP/1.1 {self.status} {phrase(self.status)}",
            f"Content-Type: {self.content_type}",
            f"Content-Length: {len(self.body)}",
            *(f"{k}: {v}" for k, v in self.headers.items()),
        ]
        if close:
            lines.append("Connection: close")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if head_only:
            return head
        wire = head + self.body
        if not close:
            self._wire = wire
        return wire


class LongPoll(Protocol):
    """A request answered later: its connection waits (parked) until the poll is ready."""

    #: Seconds from parking after which the transport calls `expire`.
    timeout: float

    def on_ready(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from any thread, or at once) when `answer` has something to say."""

    def expire(self) -> None:
        """The timeout passed: become ready with a timeout answer (unless already ready)."""

    def cancel(self) -> None:
        """The connection closed: nobody will read the answer."""

    def answer(self) -> Response | None:
        """The answer, once ready; None to close the connection without one."""


class Handler(Protocol):
    """What the transport serves (``routes.Routes``). Called on the event-loop thread only."""

    def handle(self, request: Request) -> Response | LongPoll:
        """Answer ``request`` now or later; raises `HttpError` to refuse it."""

    def error(self, error: HttpError, head: Head | None, peer: str) -> Response:
        """The response for a refusal (also the transport's own: bad head, 408, 413, ...)."""

    def identity_lost(self, identity: str) -> None:
        """The peer closed the last connection bound to ``identity`` (see `Request.bind`)."""


class HeadParser(BaseHTTPRequestHandler):
    """http.server's parsing of a request head, applied to a head already received whole.

    Only `BaseHTTPRequestHandler.parse_request` is used: ``__init__`` takes no socket (the base class
    would serve one), errors are returned instead of written, and ``Expect: 100-continue`` is noted
    for the connection to answer. One instance serves every connection of a thread.
    """

    protocol_version = "HTTP/1.1"

    def __init__(self) -> None:  # deliberately not BaseRequestHandler.__init__
        self._error: tuple[int, str] | None = None
        self._expect_continue = False

    def parse(self, raw: bytes) -> Head:
        """Parse ``raw`` (request line, headers, blank line); raises `HttpError` (status 0: nothing
        to answer, the connection just closes)."""
        line_end = raw.find(b"\n") + 1
        self.raw_requestline = raw[:line_end]
        self.rfile = io.BytesIO(raw[line_end:])
        self.command, self.request_version = "", self.default_request_version
        self.close_connection = True
        self._error, self._expect_continue = None, False
        if not self.parse_request():
            if self._error is None:  # an empty request line: http.server closes silently
                raise HttpError(0, "empty request line")
            raise HttpError(*self._error, close=True)
        if self.command not in METHODS:
            raise HttpError(501, f"Unsupported method ({self.command!r})", close=True)
        headers: dict[str, str] = {}
        for name, value in self.headers.items():
            headers.setdefault(name.lower(), value)
        return Head(
            self.command,
            self.path,
            self.request_version,
            headers,
            self.close_connection,
            self._expect_continue,
        )

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        self._error = (code, message or phrase(code))

    def handle_expect_100(self) -> bool:
        self._expect_continue = True
        return True


_LENGTH_LINE = b"\r\nContent-Length: "


def with_new_length(last_raw: bytes, last_head: Head, raw: bytes) -> Head | None:
    """The parse of ``raw`` when it is ``last_raw`` (parsed as ``last_head``) with only the value of
    its one ``Content-Length`` header changed to other ASCII digits; else None (parse it in full).

    Why: a keep-alive client sends the same head request after request, but its body length moves
    whenever a step, a revision or a progress report gains a digit; a full parse (http.server, the
    email package) is most of a request's cost. Every other byte of the head is the same, and so is
    everything http.server reads from them (method, path, version, the other headers, keep-alive,
    ``Expect``)."""
    i = raw.find(_LENGTH_LINE)
    if i < 0 or last_raw.find(_LENGTH_LINE) != i or raw[:i] != last_raw[:i]:
        return None
    start = i + len(_LENGTH_LINE)
    j, k = raw.find(b"\r\n", start), last_raw.find(b"\r\n", start)
    value = raw[start:j]
    if j < 0 or k < 0 or raw[j:] != last_raw[k:] or not value.isdigit() or len(value) > 18:
        return None
    if raw.lower().count(b"\ncontent-length:") != 1:  # another spelling too: http.server reads the first
        return None
    headers = dict(last_head.headers)
    headers["content-length"] = value.decode("ascii")
    return Head(
        last_head.method,
        last_head.path,
        last_head.version,
        headers,
        last_head.close,
        last_head.expect_continue,
    )


def head_end(buf: bytearray, start: int, limit: int | None = None) -> int:
    """Index just past the blank line that ends the head in ``buf`` (searched from ``start`` up to
    ``limit``), or -1.

    Lines end in CRLF or, as http.server also accepts, in a bare LF. Neither search runs past the
    other's match or ``limit``: with thousands of requests pipelined in ``buf``, searching to its end
    for each one was quadratic and stalled the event loop for every other client.
    """
    end = len(buf) if limit is None else min(limit, len(buf))
    crlf = buf.find(b"\n\r\n", start, end)
    lf = buf.find(b"\n\n", start, crlf + 2 if crlf >= 0 else end)
    if crlf < 0:
        return -1 if lf < 0 else lf + 2
    return crlf + 3 if lf < 0 or crlf < lf else lf + 2


def body_length(head: Head, max_body: int) -> int:
    """How many body bytes follow ``head``; raises `HttpError` (closing) for a body that cannot be
    read: chunked (411), a bad ``Content-Length`` (400), over ``max_body`` (413, left unread)."""
    if head.headers.get("transfer-encoding"):
        raise HttpError(411, "chunked request bodies are not supported: send Content-Length", close=True)
    text = head.headers.get("content-length")
    if text is None:
        return 0
    try:
        length = int(text)
        if length < 0:
            raise ValueError
    except ValueError:
        raise HttpError(400, f"bad Content-Length {text!r}", close=True) from None
    if length > max_body:
        raise HttpError(413, f"request body of {length} bytes exceeds the limit of {max_body}", close=True)
    return length
