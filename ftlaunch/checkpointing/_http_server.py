"""The serving side of `HTTPTransport`: one snapshot at a time, streamed from the tensors' memory.

Why a standard-library ``ThreadingHTTPServer``: one thread per connection is what a handful of
parallel range requests per heal needs, and each handler's ``sendall`` of a memoryview releases the
GIL, so streams overlap. What we add is the snapshot's life cycle: `CheckpointServer.publish`
replaces the served state and cuts off streams of the old one *before* returning, which is how
`disallow_checkpoint` guarantees that no byte of the next step ever reaches a receiver.

Routes (see docs/checkpointing.md): ``GET /checkpoint/<step>/header`` (200, ETag) and
``GET /checkpoint/<step>/body`` with ``Range: bytes=a-b`` and ``If-Match`` (206). Errors are JSON
``{"error": ...}``: 404 unknown path, 409 another step (with ``"serving_step"``), 412 the snapshot
changed, 416 bad range, 503 nothing served.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import socketserver
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ftlaunch.checkpointing.serialization.buffers import byte_view
from ftlaunch.checkpointing.serialization.encode import Encoded
from ftlaunch.checkpointing.serialization.layout import layout, runs

logger = logging.getLogger(__name__)

__all__ = ["CheckpointServer", "Snapshot"]

_PATH = re.compile(r"/checkpoint/(-?\d{1,20})/(header|body)")
_RANGE = re.compile(r"bytes=(\d{1,20})-(\d{1,20})")


class Snapshot:
    """One state being served: its header frame, body layout, and who is streaming it."""

    def __init__(self, step: int, enc: Encoded) -> None:
        self.step = step
        self.etag = f'"{uuid.uuid4().hex}"'
        self.frame = enc.frame
        self.body_nbytes = enc.body_nbytes
        self.ntensors = len(enc.tensors)
        self.segments = layout(enc.header, [byte_view(t) for t in enc.tensors])
        self.revoked = False
        self.active = 0
        self.streams: set[socket.socket] = set()


class CheckpointServer(ThreadingHTTPServer):
    """Serves the current `Snapshot` (or answers 503); tracks connections so shutdown closes them."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], request_timeout: float) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.request_timeout = request_timeout
        self.cond = threading.Condition()
        self.snapshot: Snapshot | None = None
        self.connections: dict[socket.socket, threading.Thread] = {}
        super().__init__(addr, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup (getfqdn); we never need it.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("checkpoint server: error serving %s", client_address, exc_info=True)

    # -- serving state ----------------------------------------------------------------------------

    def publish(self, snap: Snapshot | None, wait: float) -> None:
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

    def acquire(self, step: int, stream: socket.socket | None) -> tuple[Snapshot | None, int, dict]:
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

    def release(self, snap: Snapshot, stream: socket.socket | None) -> None:
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
    server: CheckpointServer

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

    def _send_body(self, snap: Snapshot) -> None:
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
            for run in runs(snap.segments, start, end):
                if snap.revoked:
                    raise ConnectionAbortedError("checkpoint disallowed during transfer")
                self.wfile.write(run[0].view if len(run) == 1 else b"".join(p.view for p in run))
        except OSError as e:
            self.close_connection = True
            logger.debug("checkpoint server: body stream of step %d ended early: %s", snap.step, e)
