"""The fetching side of `HTTPTransport`: one `Fetch` per `recv_checkpoint`.

The header comes first, over one connection (retried while the source has not published the step
yet: source and healer act on the same quorum concurrently, so the healer often asks first). Then
the body, split into ranges on checksum-block boundaries, comes over parallel connections, each
read straight from its socket into the destination tensors (`_BodyReader`) and checksummed piece
by piece as it lands; fresh memory is backed with pages just before each piece is read into it.
Socket I/O, prefaulting and checksums release the GIL, so the connections' threads overlap.

Bounded in time whatever the peer does: a watchdog shuts every socket down at the deadline, which
wakes reads blocked on a silent (e.g. SIGSTOPped) or trickling server, and the first failing
connection aborts the others. Every failure is a `CheckpointTransportError`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import struct
import threading
import time
from typing import Any

import torch

from ftlaunch.addresses import parse_host_port
from ftlaunch.checkpointing.serialization.buffers import byte_view, prefault
from ftlaunch.checkpointing.serialization.checksum import BLOCK_BYTES, IncrementalChecksum
from ftlaunch.checkpointing.serialization.header import MAX_FRAME_BYTES, parse_header
from ftlaunch.checkpointing.serialization.layout import RUN_BYTES, Segment, layout, runs, split_body
from ftlaunch.checkpointing.serialization.limits import Deadline, ReceiveLimits
from ftlaunch.checkpointing.serialization.receive import Slot, finish, plan_slots
from ftlaunch.checkpointing.serialization.spec import ALIGNMENT
from ftlaunch.errors import CheckpointTransportError, CheckpointUnreachableError

__all__ = ["Fetch"]

#: Chunks smaller than this are not worth an extra connection.
MIN_CHUNK_BYTES = 1 << 20
_MAX_ERROR_BODY = 64 << 10
_CPU = torch.device("cpu")


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
        self, resp: http.client.HTTPResponse, sock: socket.socket, length: int, fetch: Fetch
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


class Fetch:
    """One `recv_checkpoint`: header, then the body over parallel ranged connections."""

    def __init__(
        self,
        url: str,
        step: int,
        timeout: float,
        num_chunks: int,
        template: Any,
        limits: ReceiveLimits | None = None,
    ) -> None:
        try:
            if not url.startswith("http://"):
                raise ValueError("no http:// scheme")
            host, port = parse_host_port(url)
        except ValueError as e:
            raise CheckpointTransportError(
                f"bad checkpoint address {url!r} (expected http://host:port): {e}"
            ) from None
        self.url, self.host, self.port, self.step = url, host, port, step
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.num_chunks = num_chunks
        self.template = template
        self.limits = limits or ReceiveLimits()
        self.header_deadline = Deadline(timeout, f"step {step} from {url}", self.deadline)
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
                if length is None or length > MAX_FRAME_BYTES:
                    raise CheckpointTransportError(
                        f"checkpoint server {self.url} sent a header of bad length {length}"
                    )
                if length > self.limits.max_header_bytes:  # refused before a byte of it is read
                    raise CheckpointTransportError(
                        f"invalid checkpoint payload: the header from {self.url} is {length} bytes, more "
                        f"than the {self.limits.max_header_bytes} this receiver accepts (its own "
                        "state's is far smaller)"
                    )
                return resp.read(), resp.getheader("ETag") or ""
            except _NotServedYet as e:
                last = e
                if self.deadline - time.monotonic() <= delay:
                    raise CheckpointTransportError(f"{e} (waited until the timeout)") from None
            except (OSError, http.client.HTTPException):
                # The deadline cut a poll short (socket timeout or the watchdog's shutdown). If the
                # server had already answered "not yet", that is what the caller needs to hear.
                if last is None or (time.monotonic() < self.deadline and not self.aborted):
                    raise
                raise CheckpointTransportError(f"{last} (waited until the timeout)") from None
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
            # Every stage from here to the body obeys the deadline (a hostile header of many tiny
            # tensors costs CPU, not bytes) and the receiver's limits (checked before allocating).
            deadline = self.header_deadline
            deadline.check("fetching the header")
            header = parse_header(frame, expected_step=self.step, max_tensors=self.limits.max_tensors,
                                  deadline=deadline)  # fmt: skip
            del frame
        except CheckpointTransportError:
            raise
        except (OSError, http.client.HTTPException) as e:
            raise self._wrap(e, "fetching the header") from e
        slots = plan_slots(header, _CPU, self.template, deadline)
        views = []
        for i, s in enumerate(slots):
            if i % 1024 == 1023:
                deadline.check("preparing the received state")
            if s.entry.nbytes >= BLOCK_BYTES:  # small tensors are verified together at the end
                with contextlib.suppress(ValueError):  # so are misaligned in-place targets
                    s.incremental = IncrementalChecksum(s.landing)
            views.append(byte_view(s.landing))
        segments = layout(header, views, memoryview(bytearray(ALIGNMENT)), deadline)
        self._fetch_body(header.body_nbytes, segments, slots, etag)
        return finish(header, slots)

    def _fetch_body(self, total: int, segments: list[Segment], slots: list[Slot], etag: str) -> None:
        if total == 0:
            return
        bounds = split_body(segments, max(1, min(self.num_chunks, total // MIN_CHUNK_BYTES)))
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

    def _worker(self, start: int, end: int, segments: list[Segment], slots: list[Slot], etag: str) -> None:
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
                for run in runs(segments, start, end):
                    if len(run) == 1:
                        p = run[0]
                        slot = slots[p.segment.index] if p.segment.index >= 0 else None
                        if slot is not None and slot.fresh:
                            # Back the piece with pages before reading into it: faulting them in
                            # during the read costs more, and stalls the connection meanwhile.
                            prefault(slot.landing, p.lo, p.hi)
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
            return CheckpointUnreachableError(
                f"cannot connect to the checkpoint server {self.url} for step {self.step}: {e!r}"
            )
        if isinstance(e, (TimeoutError, BlockingIOError)) or time.monotonic() >= self.deadline:
            return CheckpointUnreachableError(
                f"timed out after {self.timeout:.1f}s {what} of step {self.step} from {self.url}"
            )
        if isinstance(e, (http.client.IncompleteRead, ConnectionError, http.client.RemoteDisconnected)):
            return CheckpointTransportError(
                f"truncated transfer: {what} of step {self.step} from {self.url}: the connection "
                f"closed early ({e!r})"
            )
        return CheckpointTransportError(
            f"{what} of step {self.step} from {self.url} failed: {type(e).__name__}: {e}"
        )
