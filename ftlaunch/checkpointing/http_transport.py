"""Live recovery over HTTP: the healthy group serves its state, the healing group fetches it.

Protocol (HTTP/1.1, standard library server and client; see docs/checkpointing.md):

``GET /checkpoint/<step>/header`` -> 200, the header frame (`serialization.frame_header`), ``ETag``.

``GET /checkpoint/<step>/body`` with ``Range: bytes=a-b`` and ``If-Match: <etag>`` -> 206, body bytes.

Errors are JSON ``{"error": "..."}``: 404 unknown path, 409 another step is being served (with
``"serving_step"``), 412 the served snapshot changed (etag), 416 bad range, 503 nothing is being
served. A receiver that gets 503, or 409 for an older step, retries until its deadline (source and
healer act on the same quorum concurrently, so the healer may ask first); 409 for a newer step fails
at once.

Speed: the receiver splits the body into ``num_chunks`` ranges fetched over parallel connections
(by default one per CPU this process may use, at most 4), each read straight from the socket into
the destination tensors (fresh ones, or the caller's own via ``state_dict``), one
``recv(MSG_WAITALL)`` per piece; fresh memory is backed with pages (`serialization.prefault`) just
before each piece is read into it. The sender writes memoryviews of its tensors (no copy for
contiguous CPU tensors). Socket I/O, prefaulting and the checksums release the GIL, so the threads
overlap.

Snapshot semantics (as torchft's): `send_checkpoint` does not copy contiguous CPU tensors; the
caller must not mutate them until `disallow_checkpoint` returns. `disallow_checkpoint` cuts off
in-flight transfers before returning, so a receiver gets an error, never bytes of the next step; a
caller that breaks the rule anyway is caught by the per-tensor checksums on the receiving side.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import re
import socket
import socketserver
import struct
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar
from urllib.parse import urlsplit

import torch

from ftlaunch.checkpointing import serialization as ser
from ftlaunch.checkpointing.transport import CheckpointTransport
from ftlaunch.errors import CheckpointTransportError

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Largest single send/readinto; also how often a stream checks for revocation / abort.
PIECE_BYTES = 8 << 20
#: Pieces shorter than this (small tensors, padding) are sent/received in runs of up to RUN_BYTES.
SMALL_PIECE_BYTES = 64 << 10
RUN_BYTES = 1 << 20
#: Chunks smaller than this are not worth an extra connection.
MIN_CHUNK_BYTES = 1 << 20
_MAX_ERROR_BODY = 64 << 10
_PATH = re.compile(r"/checkpoint/(-?\d{1,20})/(header|body)")
_RANGE = re.compile(r"bytes=(\d{1,20})-(\d{1,20})")
_CPU = torch.device("cpu")


def _parse_bind(bind: str) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]:port`` or a bare IPv6 address -> (host, port)."""
    if bind.startswith("["):
        host, _, rest = bind[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else 0
    if bind.count(":") == 1:
        host, port = bind.split(":")
        return host, int(port)
    return bind, 0


class _Snapshot:
    """One state being served: its header frame, body layout, and who is streaming it."""

    def __init__(self, step: int, enc: ser.Encoded) -> None:
        self.step = step
        self.etag = f'"{uuid.uuid4().hex}"'
        self.frame = enc.frame
        self.body_nbytes = enc.body_nbytes
        self.ntensors = len(enc.tensors)
        self.segments = ser.layout(enc.header, [ser.byte_view(t) for t in enc.tensors])
        self.revoked = False
        self.active = 0
        self.streams: set[socket.socket] = set()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], request_timeout: float) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.request_timeout = request_timeout
        self.cond = threading.Condition()
        self.snapshot: _Snapshot | None = None
        self.connections: dict[socket.socket, threading.Thread] = {}
        super().__init__(addr, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup (getfqdn); we never need it.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("checkpoint server: error serving %s", client_address, exc_info=True)

    # -- serving state ----------------------------------------------------------------------------

    def publish(self, snap: _Snapshot | None, wait: float) -> None:
        """Serve ``snap`` (or nothing); cut off streams of the previous snapshot and wait for them."""
        with self.cond:
            old, self.snapshot = self.snapshot, snap
            if old is None:
                return
            old.revoked = True
            streams = list(old.streams)
        for s in streams:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes a sendall blocked on a slow or stopped receiver
        with self.cond:
            if not self.cond.wait_for(lambda: old.active == 0, timeout=wait) and wait > 0:
                logger.warning(
                    "checkpoint server: %d transfers of step %d still running", old.active, old.step
                )

    def acquire(self, step: int, stream: socket.socket | None) -> tuple[_Snapshot | None, int, dict]:
        """The snapshot of ``step`` (counted as in use), or an error status and JSON body."""
        with self.cond:
            snap = self.snapshot
            if snap is None:
                return None, 503, {"error": "no checkpoint is being served (not sent yet, or disallowed)"}
            if snap.step != step:
                return (
                    None,
                    409,
                    {"error": f"serving step {snap.step}, not step {step}", "serving_step": snap.step},
                )
            snap.active += 1
            if stream is not None:
                snap.streams.add(stream)
            return snap, 200, {}

    def release(self, snap: _Snapshot, stream: socket.socket | None) -> None:
        with self.cond:
            snap.active -= 1
            snap.streams.discard(stream)  # type: ignore[arg-type]
            self.cond.notify_all()

    # -- connections (so shutdown can close them) --------------------------------------------------

    def track(self, conn: socket.socket, add: bool) -> None:
        with self.cond:
            if add:
                self.connections[conn] = threading.current_thread()
            else:
                self.connections.pop(conn, None)

    def close_connections(self, wait: float) -> None:
        """Shut down every open client connection; wait up to ``wait`` s for their handler threads."""
        with self.cond:
            conns = dict(self.connections)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + wait
        for t in conns.values():
            t.join(max(0.0, deadline - time.monotonic()))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _Server

    def setup(self) -> None:
        # bounds a stalled peer (recv and sendall); StreamRequestHandler reads it as the socket timeout
        self.timeout = self.server.request_timeout  # type: ignore[misc]
        super().setup()
        self.server.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        logger.debug("checkpoint server: " + format, *args)

    def _reply(self, code: int, body: bytes, ctype: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, msg: str, doc: dict | None = None) -> None:
        self._reply(code, json.dumps(doc or {"error": msg}).encode(), "application/json")

    def do_GET(self) -> None:
        m = _PATH.fullmatch(self.path)
        if m is None:
            self._error(404, f"unknown path {self.path!r}; expected /checkpoint/<step>/header or /body")
            return
        step, what = int(m[1]), m[2]
        stream = self.connection if what == "body" else None
        snap, code, doc = self.server.acquire(step, stream)
        if snap is None:
            self._error(code, doc["error"], doc)
            return
        try:
            if what == "header":
                self._reply(200, snap.frame, "application/octet-stream", {"ETag": snap.etag})
            else:
                self._send_body(snap)
        finally:
            self.server.release(snap, stream)

    def _send_body(self, snap: _Snapshot) -> None:
        total = snap.body_nbytes
        if_match = self.headers.get("If-Match")
        if if_match is not None and if_match != snap.etag:
            self._error(412, "the served checkpoint changed since its header was fetched")
            return
        rng = self.headers.get("Range")
        if rng is None:
            start, end, code = 0, total, 200
        else:
            m = _RANGE.fullmatch(rng.strip())
            if m is None:
                self._error(416, f"only a single 'bytes=a-b' range is supported, got {rng!r}")
                return
            start, end, code = int(m[1]), int(m[2]) + 1, 206
            if not start < end <= total:
                self._error(416, f"range {rng!r} is not within the body of {total} bytes")
                return
        self.send_response(code)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("ETag", snap.etag)
        if code == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{total}")
        self.end_headers()
        try:
            pieces = ser.iter_range(snap.segments, start, end, PIECE_BYTES)
            for run in ser.batches(pieces, SMALL_PIECE_BYTES, RUN_BYTES):
                if snap.revoked:
                    raise ConnectionAbortedError("checkpoint disallowed during transfer")
                self.wfile.write(run[0].view if len(run) == 1 else b"".join(p.view for p in run))
        except OSError as e:
            self.close_connection = True
            logger.debug("checkpoint server: body stream of step %d ended early: %s", snap.step, e)


class _BodyReader:
    """Reads one response body straight from the socket, each piece with one ``recv(MSG_WAITALL)``.

    http.client's buffered reader hands back whatever one ``recv`` returns (often 64 KiB on
    loopback), so a multi-megabyte piece took dozens of trips through Python and the GIL while the
    other fetch threads competed for it. Here the kernel fills the whole piece before returning.
    The socket is made blocking (``MSG_WAITALL`` needs it); each ``recv`` is bounded by
    ``SO_RCVTIMEO`` (the time left when the body starts), and the fetch's watchdog still shuts the
    socket down at the deadline.
    """

    def __init__(
        self, resp: http.client.HTTPResponse, sock: socket.socket, length: int, fetch: _Fetch
    ) -> None:
        # Body bytes the response's buffered reader took from the socket along with the headers:
        # peek() returns exactly what is buffered (it reads only if nothing is), and reading that
        # many bytes is served from the buffer alone, which leaves the socket at the next byte.
        buffered = resp.fp.peek()
        if len(buffered) > length:
            raise CheckpointTransportError(
                f"checkpoint server {fetch.url} sent more than the {length} bytes asked for"
            )
        self.head = resp.fp.read(len(buffered))
        self.pos = 0
        self.sock = sock
        left = fetch.remaining()
        sock.settimeout(None)
        with contextlib.suppress(OSError, struct.error):  # the watchdog bounds the reads regardless
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(left), int(left % 1 * 1e6) + 1)
            )

    def read(self, view: memoryview) -> int:
        """Fill ``view`` completely (or raise); returns its length."""
        n = len(view)
        got = 0
        if self.pos < len(self.head):
            got = min(n, len(self.head) - self.pos)
            view[:got] = self.head[self.pos : self.pos + got]
            self.pos += got
        while got < n:
            k = self.sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            if not k:
                raise http.client.IncompleteRead(b"", n - got)
            got += k
        return got


class _NotServedYet(CheckpointTransportError):
    """The source does not serve the requested step *yet* (nothing, or an older step): the
    receiver retries until its deadline. A source already serving a newer step fails at once."""


class _Fetch:
    """One `recv_checkpoint`: header, then the body over parallel ranged connections."""

    def __init__(self, url: str, step: int, timeout: float, num_chunks: int, template: Any) -> None:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme != "http" or not parts.hostname or port is None:
            raise CheckpointTransportError(f"bad checkpoint address {url!r} (expected http://host:port)")
        self.url, self.host, self.port, self.step = url, parts.hostname, port, step
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.num_chunks = num_chunks
        self.template = template
        self.lock = threading.Lock()
        self.socks: set[socket.socket] = set()
        self.aborted = False
        self.errors: list[BaseException] = []
        self.received = 0

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0 or self.aborted:
            raise TimeoutError("deadline passed")
        return left

    def _connect(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.remaining())
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.lock:
            if self.aborted:
                conn.close()
                raise TimeoutError("transfer aborted")
            self.socks.add(conn.sock)
        return conn

    def _close(self, conn: http.client.HTTPConnection) -> None:
        with self.lock:
            self.socks.discard(conn.sock)
        conn.close()

    def _abort(self) -> None:
        with self.lock:
            self.aborted = True
            socks = list(self.socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes workers blocked in recv

    def _get(
        self, conn: http.client.HTTPConnection, path: str, headers: dict[str, str], ok: int
    ) -> http.client.HTTPResponse:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        if resp.status != ok:
            raw = resp.read(_MAX_ERROR_BODY) if (resp.length or 0) <= _MAX_ERROR_BODY else b""
            try:
                doc = json.loads(raw)
                msg = doc["error"]
            except (ValueError, KeyError, TypeError):
                doc, msg = {}, raw[:200].decode(errors="replace") or resp.reason
            serving = doc.get("serving_step") if isinstance(doc, dict) else None
            later = resp.status == 503 or (
                resp.status == 409 and type(serving) is int and serving < self.step
            )
            cls = _NotServedYet if later else CheckpointTransportError
            raise cls(f"checkpoint server {self.url} answered {resp.status} to {path}: {msg}")
        return resp

    def _get_header(self) -> tuple[bytes, str]:
        """Fetch the header frame, waiting while the source has not published this step yet.

        Source and healer act on the same quorum concurrently, so the healer often asks a moment
        before the source's `send_checkpoint`; that is a wait, not a failure (bounded by the timeout).
        """
        delay = 0.002
        last: _NotServedYet | None = None
        while True:
            try:
                conn = self._connect()
            except TimeoutError:
                if last is None:
                    raise
                raise CheckpointTransportError(f"{last} (waited until the timeout)") from None
            try:
                resp = self._get(conn, f"/checkpoint/{self.step}/header", {}, 200)
                length = resp.length
                if length is None or length > ser.FRAME_PREFIX_LEN + ser.MAX_HEADER_BYTES:
                    raise CheckpointTransportError(
                        f"checkpoint server {self.url} sent a header of bad length {length}"
                    )
                return resp.read(), resp.getheader("ETag") or ""
            except _NotServedYet as e:
                last = e
                if self.deadline - time.monotonic() <= delay:
                    raise CheckpointTransportError(f"{e} (waited until the timeout)") from None
            finally:
                self._close(conn)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def run(self) -> Any:
        # Hard bound on the whole call: at the deadline every socket is shut down, which wakes any
        # read blocked on a silent (e.g. SIGSTOPped) or trickling server.
        watchdog = threading.Timer(self.timeout, self._abort)
        watchdog.daemon = True
        watchdog.start()
        try:
            return self._run()
        finally:
            watchdog.cancel()

    def _run(self) -> Any:
        try:
            frame, etag = self._get_header()
            header = ser.parse_header(frame, expected_step=self.step)
        except CheckpointTransportError:
            raise
        except (OSError, http.client.HTTPException) as e:
            raise self._wrap(e, "fetching the header") from e
        try:
            slots = ser.plan_slots(header, _CPU, self.template)
        except RuntimeError as e:  # e.g. a header asking for more memory than we have
            raise CheckpointTransportError(
                f"cannot allocate the received state ({header.body_nbytes} bytes): {e}"
            ) from e
        for s in slots:
            if s.entry.nbytes >= ser.BLOCK_BYTES:  # small tensors are verified together at the end
                with contextlib.suppress(ValueError):  # so are misaligned in-place targets
                    s.incremental = ser.IncrementalChecksum(s.landing)
        segments = ser.layout(
            header, [ser.byte_view(s.landing) for s in slots], memoryview(bytearray(ser.ALIGNMENT))
        )
        self._fetch_body(header.body_nbytes, segments, slots, etag)
        return ser.finish(header, slots)

    def _fetch_body(self, total: int, segments: list[ser.Segment], slots: list[ser.Slot], etag: str) -> None:
        if total == 0:
            return
        bounds = ser.split_body(segments, max(1, min(self.num_chunks, total // MIN_CHUNK_BYTES)))
        workers = [
            threading.Thread(
                target=self._worker,
                args=(bounds[i], bounds[i + 1], segments, slots, etag),
                name=f"ftlaunch-ckpt-fetch-{i}",
                daemon=True,
            )
            for i in range(len(bounds) - 1)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join(max(0.0, self.deadline - time.monotonic()))
        timed_out = any(w.is_alive() for w in workers)
        if timed_out:
            self._abort()
            for w in workers:
                w.join(5.0)
        if timed_out or (self.errors and isinstance(self.errors[0], (TimeoutError, BlockingIOError))):
            raise CheckpointTransportError(
                f"timed out after {self.timeout:.1f}s fetching step {self.step} from {self.url} "
                f"(received {self.received} of {total} bytes)"
            )
        if self.errors:
            e = self.errors[0]
            if isinstance(e, CheckpointTransportError):
                raise e
            raise self._wrap(e, f"fetching the body ({self.received} of {total} bytes received)") from e

    def _worker(
        self, start: int, end: int, segments: list[ser.Segment], slots: list[ser.Slot], etag: str
    ) -> None:
        try:
            conn = self._connect()
            try:
                headers = {"Range": f"bytes={start}-{end - 1}"}
                if etag:
                    headers["If-Match"] = etag
                resp = self._get(conn, f"/checkpoint/{self.step}/body", headers, 206)
                want = f"bytes {start}-{end - 1}/{segments[-1].offset + segments[-1].length}"
                if resp.getheader("Content-Range") != want or resp.length != end - start:
                    raise CheckpointTransportError(
                        f"checkpoint server {self.url} sent the wrong range (wanted {want})"
                    )
                reader = _BodyReader(resp, conn.sock, end - start, self)
                staging = memoryview(bytearray(RUN_BYTES))
                pieces = ser.iter_range(segments, start, end, PIECE_BYTES)
                for run in ser.batches(pieces, SMALL_PIECE_BYTES, RUN_BYTES):
                    if len(run) == 1:
                        p = run[0]
                        slot = slots[p.segment.index] if p.segment.index >= 0 else None
                        if slot is not None and slot.fresh:
                            # Back the piece with pages before reading into it: faulting them in
                            # during the read costs more, and stalls the connection meanwhile.
                            ser.prefault(slot.landing, p.lo, p.hi)
                        got = reader.read(p.view)
                    else:  # a run of small pieces: one read, then copy each piece into place
                        got = reader.read(staging[: sum(p.hi - p.lo for p in run)])
                        pos = 0
                        for p in run:
                            p.view[:] = staging[pos : pos + p.hi - p.lo]
                            pos += p.hi - p.lo
                    for p in run:
                        check = slots[p.segment.index].incremental if p.segment.index >= 0 else None
                        if check is not None:
                            check.update(p.lo, p.hi)
                    with self.lock:
                        self.received += got
            finally:
                self._close(conn)
        except BaseException as e:  # reported by the calling thread
            with self.lock:
                first = not self.errors
                self.errors.append(e)
            if first:
                self._abort()  # fail fast: stop the other chunks

    def _wrap(self, e: BaseException, what: str) -> CheckpointTransportError:
        if isinstance(e, ConnectionRefusedError):
            return CheckpointTransportError(
                f"cannot connect to the checkpoint server {self.url} for step {self.step}: {e!r}"
            )
        if isinstance(e, (TimeoutError, BlockingIOError)) or time.monotonic() >= self.deadline:
            return CheckpointTransportError(
                f"timed out after {self.timeout:.1f}s {what} of step {self.step} from {self.url}"
            )
        if isinstance(e, (http.client.IncompleteRead, ConnectionError, http.client.RemoteDisconnected)):
            return CheckpointTransportError(
                f"truncated transfer: {what} of step {self.step} from {self.url}: the connection closed early ({e!r})"
            )
        return CheckpointTransportError(
            f"{what} of step {self.step} from {self.url} failed: {type(e).__name__}: {e}"
        )


def default_num_chunks() -> int:
    """Parallel connections per receive when ``num_chunks`` is not given: one per CPU this process
    may run on, at most 4. Each connection's thread is busy copying and checksumming; more threads
    than CPUs only contend (measured on 2 CPUs: 2 connections used ~15% less CPU per GB than 4 and
    were faster). Across a network with a per-connection bandwidth limit, pass a larger value."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


class HTTPTransport(CheckpointTransport[T]):
    """Serves this group's state over HTTP and fetches peers' states with parallel range requests.

    ``num_chunks``: parallel connections per receive (default `default_num_chunks`: the usable
    CPUs, at most 4). ``bind`` is ``host`` or ``host:port`` (loopback by default; use
    ``0.0.0.0``/``::`` to serve other hosts — the state is readable by anyone who can reach the
    port). ``state_dict``, when given, returns this group's current state: received tensors of
    matching dtype and shape are written into it in place (on failure their contents are
    unspecified — the heal is retried). Tensors received without a match are freshly allocated,
    each with its own storage.
    """

    def __init__(
        self,
        timeout: timedelta,
        num_chunks: int | None = None,
        bind: str = "127.0.0.1",
        *,
        state_dict: Callable[[], T] | None = None,
    ) -> None:
        if num_chunks is None:
            num_chunks = default_num_chunks()
        if num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
        if timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self._timeout = timeout
        self._num_chunks = num_chunks
        self._state_dict = state_dict
        host, port = _parse_bind(bind)
        self._server = _Server((host, port), timeout.total_seconds())
        port = int(self._server.server_address[1])
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        self._url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="ftlaunch-ckpt-http",
            daemon=True,
        )
        self._thread.start()
        self._closed = False
        logger.info("checkpoint transport: serving at %s", self._url)

    def metadata(self) -> str:
        return self._url

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        """Start serving ``state_dict`` (replacing any previous one); returns at once.

        Contiguous CPU tensors are served in place (not copied); other tensors are copied to CPU
        now. ``dst_ranks`` and ``timeout`` are informational: any receiver may fetch until
        `disallow_checkpoint`.
        """
        if self._closed:
            raise CheckpointTransportError("checkpoint transport is shut down")
        t0 = time.perf_counter()
        snap = _Snapshot(step, ser.encode(state_dict, step, device=_CPU))
        self._server.publish(snap, wait=self._timeout.total_seconds())
        logger.info(
            "checkpoint transport: serving step %d (%d tensors, %d bytes) to ranks %s; prepared in %.3fs",
            step, snap.ntensors, snap.body_nbytes, dst_ranks, time.perf_counter() - t0,
        )  # fmt: skip

    def disallow_checkpoint(self) -> None:
        self._server.publish(None, wait=self._timeout.total_seconds())

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        t0 = time.perf_counter()
        template = self._state_dict() if self._state_dict is not None else None
        result = _Fetch(metadata, step, timeout.total_seconds(), self._num_chunks, template).run()
        logger.info(
            "checkpoint transport: received step %d from rank %d (%s) in %.3fs",
            step, src_rank, metadata, time.perf_counter() - t0,
        )  # fmt: skip
        return result

    def shutdown(self, wait: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.publish(None, wait=self._timeout.total_seconds() if wait else 0.0)
        self._server.shutdown()  # stops serve_forever (returns within poll_interval)
        self._server.server_close()
        self._server.close_connections(wait=10.0 if wait else 0.0)
        if wait:
            self._thread.join()

    def __enter__(self) -> HTTPTransport[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
