"""The lighthouse's transport (ftlaunch.lighthouse.transport) with a toy handler that knows no quorums:
responses, long polls answered from another thread, expiry, identities, limits, shutdown."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from ftlaunch.lighthouse.http import Head, HttpError, LongPoll, Request, Response
from ftlaunch.lighthouse.transport import MAX_HEAD_BYTES, HttpServer

pytestmark = pytest.mark.timeout(60)


class Poll:
    """A long poll made ready by a test (from any thread) or by its own expiry."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.text: str | None = None
        self.cancelled = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def on_ready(self, callback: Callable[[], None]) -> None:
        with self._lock:
            ready = self.text is not None
            if not ready:
                self._callbacks.append(callback)
        if ready:
            callback()

    def ready(self, text: str) -> None:
        with self._lock:
            self.text, callbacks = text, self._callbacks
        for callback in callbacks:
            callback()

    def expire(self) -> None:
        self.ready("expired")

    def cancel(self) -> None:
        self.cancelled.set()

    def answer(self) -> Response | None:
        return Response(200, (self.text or "").encode(), "text/plain")


class Toy:
    """``/echo`` answers the body, ``/bind/<id>`` binds the connection, ``/wait/<s>`` parks."""

    def __init__(self) -> None:
        self.lost: list[str] = []
        self.polls: list[Poll] = []
        self.errors: list[int] = []

    def handle(self, request: Request) -> Response | LongPoll:
        if request.path == "/echo":
            return Response(200, request.body, "text/plain")
        if request.path.startswith("/bind/"):
            request.bind(request.path[len("/bind/") :])
            return Response(204 if request.method == "POST" else 200, b"")
        if request.path.startswith("/wait/"):
            poll = Poll(float(request.path[len("/wait/") :]))
            self.polls.append(poll)
            return poll
        raise HttpError(404, "nope")

    def error(self, error: HttpError, head: Head | None, peer: str) -> Response:
        self.errors.append(error.status)
        return Response(
            error.status,
            json.dumps({"error": error.message}).encode(),
            headers=error.headers,
            close=error.close,
        )

    def identity_lost(self, identity: str) -> None:
        self.lost.append(identity)


@pytest.fixture
def served() -> Iterator[tuple[HttpServer, Toy, tuple[str, int]]]:
    _buffers.clear()
    toy = Toy()
    sock = socket.create_server(("127.0.0.1", 0))
    server = HttpServer(sock, toy, idle_timeout=30.0, read_timeout=5.0, max_body=1000)
    address = sock.getsockname()[:2]
    server.start()
    yield server, toy, address
    server.close()


_buffers: dict[int, bytes] = {}  # bytes received past the response read, per socket


def send(sock: socket.socket, method: str, path: str, body: bytes = b"", extra: str = "") -> None:
    sock.sendall(
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body
    )


def read(sock: socket.socket, *, head_only: bool = False) -> tuple[int, bytes, bytes]:
    """The next response on ``sock``: (status, head, body)."""
    buf = _buffers.pop(sock.fileno(), b"")
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {buf!r}"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = (
        0
        if head_only
        else int(
            next(
                line.split(b":")[1]
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
        )
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    _buffers[sock.fileno()] = rest[length:]
    return int(head.split(b" ")[1]), head, rest[:length]


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_keepalive_responses_in_order_and_head_without_body(served) -> None:
    _, toy, address = served
    with socket.create_connection(address, timeout=10) as sock:
        send(sock, "POST", "/echo", b"one")
        send(sock, "POST", "/echo", b"two")
        assert read(sock)[2] == b"one" and read(sock)[2] == b"two"
        send(sock, "HEAD", "/echo", b"abc")
        sock.sendall(b"POST /echo HTTP/1.1\r\nContent-Length: 5\r\n\r\nthree")
        status, head, _ = read(sock, head_only=True)  # no body after a HEAD answer: the next response follows
        assert status == 200 and b"Content-Length: 3" in head and read(sock)[2] == b"three"
        send(sock, "GET", "/missing")
        assert read(sock)[0] == 404 and toy.errors == [404]


def test_a_long_poll_is_answered_from_another_thread_and_blocks_nothing(served) -> None:
    _, toy, address = served
    with (
        socket.create_connection(address, timeout=10) as parked,
        socket.create_connection(address, timeout=10) as other,
    ):
        send(parked, "GET", "/wait/30")
        send(parked, "POST", "/echo", b"after")  # pipelined: answered after the poll
        wait_for(lambda: len(toy.polls) == 1, "parked")
        send(other, "POST", "/echo", b"meanwhile")
        assert read(other)[2] == b"meanwhile"
        threading.Thread(target=toy.polls[0].ready, args=("done",)).start()
        assert read(parked)[2] == b"done" and read(parked)[2] == b"after"


def test_a_long_poll_expires_and_a_dead_peer_cancels_it(served) -> None:
    _, toy, address = served
    with socket.create_connection(address, timeout=10) as sock:
        send(sock, "GET", "/wait/0.2")
        assert read(sock)[2] == b"expired"
    sock = socket.create_connection(address, timeout=10)
    send(sock, "GET", "/wait/30")
    wait_for(lambda: len(toy.polls) == 2, "parked")
    sock.close()
    assert toy.polls[1].cancelled.wait(10)


def test_identity_lost_only_when_the_peer_closes_its_last_connection(served) -> None:
    server, toy, address = served
    a1, a2 = (socket.create_connection(address, timeout=10) for _ in range(2))
    for sock in (a1, a2):
        send(sock, "POST", "/bind/a")
        assert read(sock)[0] == 204
    assert server.bound_count("a") == 2
    a1.close()
    wait_for(lambda: server.bound_count("a") == 1, "one closed")
    assert toy.lost == []
    a2.close()
    wait_for(lambda: toy.lost == ["a"], "identity lost")
    # Rebinding moves a connection; a connection the server closes (here: a 400) is no loss.
    with socket.create_connection(address, timeout=10) as sock:
        send(sock, "POST", "/bind/b")
        send(sock, "POST", "/bind/c")
        read(sock), read(sock)
        assert server.bound_count("b") == 0 and server.bound_count("c") == 1
        sock.sendall(b"GET /echo HTTP/1.1\r\nContent-Length: -1\r\n\r\n")
        assert read(sock)[0] == 400 and sock.recv(100) == b""
    wait_for(lambda: server.bound_count("c") == 0, "c unbound")
    assert toy.lost == ["a"]


def test_limits(served) -> None:
    server, toy, address = served
    with socket.create_connection(address, timeout=10) as sock:
        send(sock, "POST", "/echo", b"x" * 1001)
        status, head, _ = read(sock)
        assert status == 413 and b"Connection: close" in head
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(b"GET /" + b"a" * (MAX_HEAD_BYTES + 10))
        assert read(sock)[0] == 414
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\n" + b"X-Long: " + b"b" * MAX_HEAD_BYTES + b"\r\n")
        assert read(sock)[0] == 431
    server.read_timeout = 0.2
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
        assert read(sock)[0] == 408
    server.idle_timeout = 0.2
    with socket.create_connection(address, timeout=10) as sock:
        send(sock, "POST", "/bind/idle")
        read(sock)
        assert sock.recv(100) == b""  # closed by the server when idle ...
    wait_for(lambda: server.bound_count("idle") == 0, "idle unbound")
    assert "idle" not in toy.lost  # ... which is no death


def test_close_answers_what_is_due_and_stops(served) -> None:
    server, toy, address = served
    sock = socket.create_connection(address, timeout=10)
    send(sock, "GET", "/wait/30")
    wait_for(lambda: len(toy.polls) == 1, "parked")
    toy.polls[0].ready("bye")  # e.g. a 503 made ready just before the shutdown
    server.close()
    assert read(sock)[2] == b"bye" and sock.recv(100) == b""
    sock.close()
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=2).close()
    server.close()  # idempotent
