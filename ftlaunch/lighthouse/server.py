"""The lighthouse: a small HTTP/JSON quorum server; requests are parsed by the standard library's
`http.server.BaseHTTPRequestHandler`, connections are driven by one event-loop thread.

One I/O thread multiplexes every connection with a selector (no thread per connection: with 64
groups asking at once, 64 handler threads handing the GIL to one another cost more CPU than the
requests themselves). Each connection keeps one `_Handler`, whose request parsing is http.server's
own: the bytes received so far are offered to it, and if they do not hold a whole request yet the
attempt is dropped and replayed from the start when more bytes arrive (`_Reader`). A quorum request
parks without blocking anything; its answer is written by the loop when the quorum forms (encoded
once per quorum, the same bytes for every keep-alive member).

One lock guards all state, and the decision is recomputed on every event (request arrival,
disconnect, failure report, eviction) by the pure `decide_quorum`. A timer thread ticking every
``quorum_tick`` seconds covers what only time changes: the join timeout and heartbeat expiry.

Failure detection: requests carrying the ``X-Ftlaunch-Replica`` header bind their connection to
that replica group. When the peer closes the group's last bound connection (EOF or reset: the
process died) without a prior ``leave``, the group is marked disconnected at once and the quorum
is recomputed; the loop watches parked connections too, so a long poll's death is seen at once.
A group that stays connected but silent drops out after ``heartbeat_timeout``.
"""

from __future__ import annotations

import heapq
import hmac
import io
import itertools
import json
import logging
import math
import os
import select
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from ftlaunch.addresses import http_url, parse_host_port
from ftlaunch.errors import ConfigurationError
from ftlaunch.lighthouse import dashboard
from ftlaunch.lighthouse.protocol import (
    API_VERSION,
    DEFAULT_QUORUM_TIMEOUT,
    MAX_BODY_BYTES,
    MAX_QUORUM_TIMEOUT,
    MAX_REPLICA_ID_LEN,
    PATH_PREFIX,
    REPLICA_HEADER,
)
from ftlaunch.lighthouse.quorum import (
    Connection,
    GroupState,
    Health,
    LighthouseState,
    Quorum,
    QuorumIdAllocator,
    QuorumMember,
    QuorumOptions,
    decide_quorum,
    group_health,
    may_form,
)

log = logging.getLogger(__name__)

#: Events kept for the dashboard / status.
HISTORY_LEN = 200
#: Time a client has to send a whole request (line, headers, body) once its first byte arrived.
REQUEST_READ_TIMEOUT = 10.0
#: Minimum time an idle keep-alive connection is kept open between requests (see `idle_timeout`).
MIN_IDLE_TIMEOUT = 120.0
#: Pending connections the kernel queues before the loop accepts them.
LISTEN_BACKLOG = 256
#: Bytes asked of the kernel per recv.
RECV_SIZE = 65536
#: A parked connection whose peer sends more than this before its answer is dropped.
MAX_PIPELINED_BYTES = 2 * MAX_BODY_BYTES
#: How long shutdown keeps trying to write answers already due (the 503s of parked requests).
SHUTDOWN_FLUSH_TIMEOUT = 1.0

# The highest quorum id any server in this process handed out: a server started in the same
# millisecond as its predecessor (tests do that) still starts above it.
_last_issued_id = 0
_ids_lock = threading.Lock()


class _HTTPError(Exception):
    """Turns into a JSON error response; ``close`` drops the connection (body left unread)."""

    def __init__(self, code: int, message: str, *, close: bool = False, headers: dict | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.close = close
        self.headers = headers or {}


class _Conn:
    """Server-side record of one client connection (I/O fields: event-loop thread only)."""

    __slots__ = (
        "sock", "peer", "replica_id", "closed", "busy", "pending", "timed_out", "handler",
        "inbuf", "outbuf", "eof", "close_after_write", "deadline", "scheduled", "reading", "want", "nl_from", "continue_sent",
        "events", "io_closed",
    )

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.replica_id: str | None = None
        self.closed = False  # bookkeeping done (`_close_locked`); the socket may still be open
        self.busy = False  # parked in a long poll
        self.pending: _Pending | None = None
        self.timed_out = False  # the read deadline passed with a partial request
        self.handler: _Handler | None = None
        self.inbuf = bytearray()  # received, not yet consumed by a complete request
        self.outbuf = bytearray()  # to send once the socket takes more
        self.eof = False  # the peer closed its side (or reset)
        self.close_after_write = False
        self.deadline: float | None = None  # idle, read or long-poll deadline (monotonic)
        self.reading = False  # a partial request is buffered: `deadline` is its read deadline
        self.want = 0  # replay the parse once inbuf holds this many bytes ...
        self.nl_from = -1  # ... or a newline at or after this offset
        self.continue_sent = False  # "100 Continue" already sent for the current request
        self.scheduled: float | None = None  # the earliest entry of this connection in the deadline heap
        self.events = selectors.EVENT_READ  # what the selector watches for
        self.io_closed = False  # socket closed and unregistered


class _Pending:
    """A quorum request parked in a long poll; resolved (once, under the server lock) with a quorum
    or an error, and then answered by the event loop."""

    __slots__ = ("member", "conn", "timeout", "done", "result", "body", "response", "error", "_notify")

    def __init__(self, member: QuorumMember, conn: _Conn, notify: Any) -> None:
        self.member = member
        self.conn = conn
        self.timeout = DEFAULT_QUORUM_TIMEOUT
        self.done = False
        self.result: Quorum | None = None
        self.body = b""  # the encoded 200 response body for `result`
        self.response = b""  # the whole keep-alive HTTP/1.1 response for `result`, shared by all members
        self.error: tuple[int, str] | None = None  # (status, message); status 0 = drop silently
        self._notify = notify

    def resolve(
        self,
        result: Quorum | None = None,
        error: tuple[int, str] | None = None,
        body: bytes = b"",
        response: bytes = b"",
    ) -> None:
        if self.done:  # first answer wins
            return
        self.result, self.error, self.body, self.response = result, error, body, response
        self.done = True
        self._notify(self)


class _Incomplete(Exception):
    """The buffered bytes do not hold a whole request yet (raised inside http.server's parsing)."""


class _Reader:
    """The ``rfile`` a `_Handler` parses from: the connection's buffered bytes.

    Raises `_Incomplete` where a socket file would block, so a parse attempt on a partial request
    is abandoned and replayed from the start when more bytes arrive; ``pos`` is how much a complete
    request consumed. With ``eof`` (peer closed, or read deadline passed) it returns short reads
    like a socket file at EOF, and http.server produces its usual errors.
    """

    __slots__ = ("buf", "pos", "eof", "want", "nl_from")

    def __init__(self, buf: bytearray, eof: bool) -> None:
        self.buf = buf
        self.pos = 0
        self.eof = eof
        self.want = 0  # after _Incomplete: inbuf size worth another attempt ...
        self.nl_from = -1  # ... or the offset from which a newline is (readline)

    def readline(self, limit: int = -1) -> bytes:
        buf, pos = self.buf, self.pos
        stop = len(buf) if limit is None or limit < 0 else min(len(buf), pos + limit)
        nl = buf.find(b"\n", pos, stop)
        if nl >= 0:
            end = nl + 1
        elif stop - pos == limit or self.eof:
            end = stop
        else:  # retry when a newline arrives (or enough bytes to hit the limit)
            self.want, self.nl_from = len(buf) + RECV_SIZE, len(buf)
            raise _Incomplete
        self.pos = end
        return bytes(buf[pos:end])

    def read(self, n: int = -1) -> bytes:
        buf, pos = self.buf, self.pos
        if n is None or n < 0:
            if not self.eof:
                self.want = len(buf) + 1
                raise _Incomplete
            n = len(buf) - pos
        if len(buf) - pos < n and not self.eof:
            self.want = pos + n
            raise _Incomplete
        data = bytes(buf[pos : pos + n])
        self.pos += len(data)
        return data


class _Waker:
    """A file descriptor the event loop selects on; `set` (any thread) makes it readable."""

    def __init__(self) -> None:
        self._closed = False
        if hasattr(os, "eventfd"):
            self._r = self._w = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:  # pragma: no cover - non-Linux
            self._r, self._w = os.pipe()
            for fd in (self._r, self._w):
                os.set_blocking(fd, False)

    def fileno(self) -> int:
        return self._r

    def set(self) -> None:
        if self._closed:
            return
        try:
            os.write(self._w, b"\1\0\0\0\0\0\0\0")  # an eventfd takes exactly 8 bytes
        except OSError:  # full pipe/counter (it is readable then) or closed at shutdown
            pass

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except OSError:  # EAGAIN: drained
            pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for fd in {self._r, self._w}:
                os.close(fd)


@dataclass
class _GroupInfo:
    """Per-group facts for status/dashboard that the decision does not need."""

    first_seen: float  # wall clock
    step: int = 0
    address: str = ""
    reason: str = ""  # why it is disconnected / failed
    heartbeats: int = 0
    silent_noted: bool = False


class LighthouseServer:
    """Quorum server. ``start()`` serves in background threads; ``shutdown()`` stops everything."""

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        *,
        min_replicas: int = 1,
        join_timeout: float = 60.0,
        quorum_tick: float = 0.1,
        heartbeat_timeout: float = 5.0,
        token: str | None = None,
    ) -> None:
        try:
            self._options = QuorumOptions(
                min_replicas=min_replicas, join_timeout=join_timeout, heartbeat_timeout=heartbeat_timeout
            )
        except (TypeError, ValueError) as e:
            raise ConfigurationError(f"lighthouse: {e}") from None
        if not isinstance(quorum_tick, (int, float)) or not math.isfinite(quorum_tick) or quorum_tick <= 0:
            raise ConfigurationError(f"lighthouse: quorum_tick must be a number > 0, got {quorum_tick!r}")
        try:
            host, port = parse_host_port(bind, default_port=0)
        except ValueError as e:
            raise ConfigurationError(f"lighthouse: bad bind address: {e}") from None
        self._tick = float(quorum_tick)
        self._token = token or None
        #: An idle keep-alive connection (e.g. a heartbeat connection between beats) is closed by the
        #: server after this long; well above any sane heartbeat interval. Not counted as a death.
        self.idle_timeout = max(MIN_IDLE_TIMEOUT, 4 * self._options.heartbeat_timeout)
        self.read_timeout = REQUEST_READ_TIMEOUT

        self._lock = threading.Lock()
        self._groups: dict[str, GroupState] = {}
        self._info: dict[str, _GroupInfo] = {}
        self._requests: dict[str, QuorumMember] = {}
        self._pending: dict[str, _Pending] = {}
        self._round_start: float | None = None
        self._quorum: Quorum | None = None
        self._prev_ids: frozenset[str] = frozenset()
        self._prev_broken = False
        with _ids_lock:
            self._ids = QuorumIdAllocator(int(time.time() * 1000), floor=_last_issued_id)
        self._evicted: dict[str, str] = {}
        self._conns: set[_Conn] = set()
        self._by_replica: dict[str, set[_Conn]] = {}
        self._history: deque[dict[str, Any]] = deque(maxlen=HISTORY_LEN)
        self._stopping = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

        # Event loop (see the module docstring): owned by the "lighthouse-io" thread once started.
        self._resolved: deque[_Pending] = deque()  # resolved long polls for the loop to answer
        self._loop_ident: int | None = None
        self._deadlines: list[tuple[float, int, _Conn]] = []  # heap; stale entries are skipped
        self._seq = itertools.count()
        self._io_conns: set[_Conn] = set()
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._listener = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        except OSError as e:
            raise ConfigurationError(f"lighthouse: cannot bind {bind!r}: {e}") from None
        self._listener.setblocking(False)
        self._waker = _Waker()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._waker.fileno(), selectors.EVENT_READ, self._waker)
        bound_host, bound_port = self._listener.getsockname()[:2]
        if bound_host in ("0.0.0.0", "::", ""):
            bound_host = socket.gethostname()
        self._address = http_url(bound_host, bound_port)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> LighthouseServer:
        if self._threads:
            raise RuntimeError("lighthouse already started")
        serve = threading.Thread(target=self._serve, name="lighthouse-io", daemon=True)
        tick = threading.Thread(target=self._tick_loop, name="lighthouse-tick", daemon=True)
        self._threads = [serve, tick]
        serve.start()
        tick.start()
        log.info(
            "lighthouse: serving on %s (min_replicas=%d join_timeout=%.3gs heartbeat_timeout=%.3gs tick=%.3gs admin=%s)",
            self._address,
            self._options.min_replicas,
            self._options.join_timeout,
            self._options.heartbeat_timeout,
            self._tick,
            "token" if self._token else "disabled",
        )
        return self

    @property
    def address(self) -> str:
        """``http://host:port`` clients connect to."""
        return self._address

    @property
    def options(self) -> QuorumOptions:
        return self._options

    def shutdown(self) -> None:
        """Answer parked long polls with 503, stop serving, close every connection."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            for pending in self._pending.values():
                pending.resolve(error=(503, "lighthouse shutting down"))
            self._pending.clear()
            self._requests.clear()
        self._stop.set()
        self._waker.set()
        # The loop writes the 503s it can, closes every connection and the listener, then exits.
        for t in self._threads:
            t.join(timeout=5.0)
        if not self._threads:
            self._close_io()
        log.info("lighthouse: %s stopped", self._address)

    def __enter__(self) -> LighthouseServer:
        return self.start() if not self._threads else self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ public operations

    def report_failure(self, replica_id: str, reason: str = "") -> None:
        """Mark a group failed at once (the supervisor saw it die). Unknown groups are only logged."""
        self._report_failure(replica_id, reason or "reported failed")

    def evict(self, replica_id: str, reason: str = "") -> bool:
        """Drop a group; its next heartbeat/quorum request gets 410. False if the group is unknown."""
        return self._evict(replica_id, reason or "evicted")

    def status(self) -> dict:
        now, wall = time.monotonic(), time.time()
        hb = self._options.heartbeat_timeout
        with self._lock:
            members = set(self._quorum.replica_ids) if self._quorum else set()
            groups = []
            for rid in sorted(self._groups):
                g, info = self._groups[rid], self._info[rid]
                groups.append(
                    {
                        "replica_id": rid,
                        "health": group_health(g, now, self._options).value,
                        "step": info.step,
                        "address": info.address,
                        "last_seen_age": round(now - g.last_seen, 4),
                        "heartbeat_timeout": hb,
                        "connections": len(self._by_replica.get(rid, ())),
                        "requesting": rid in self._requests,
                        "in_quorum": rid in members,
                        "heartbeats": info.heartbeats,
                        "reason": info.reason,
                        "first_seen": info.first_seen,
                    }
                )
            return {
                "version": API_VERSION,
                "address": self._address,
                "time": wall,
                "options": {
                    "min_replicas": self._options.min_replicas,
                    "join_timeout": self._options.join_timeout,
                    "heartbeat_timeout": hb,
                    "quorum_tick": self._tick,
                    "admin": self._token is not None,
                },
                "quorum": self._quorum.to_json() if self._quorum else None,
                "next_quorum_id": self._ids.peek(),
                "groups": groups,
                "pending": sorted(self._requests),
                "decision": self._waiting_reason(now),
                "evicted": sorted(self._evicted),
                "history": [dict(h) for h in reversed(self._history)],
            }

    # ------------------------------------------------------------------ request handling (locked)

    def _record(self, event: str, replica_id: str | None, detail: str = "", **extra: Any) -> None:
        self._history.append({"time": time.time(), "event": event, "replica_id": replica_id, "detail": detail, **extra})

    def _mark_prev_broken(self, replica_id: str) -> None:
        if replica_id in self._prev_ids:
            self._prev_broken = True

    def _admit(self, conn: _Conn, rid: str, now: float, *, bind: bool) -> bool:
        """Common start of a group's request (under the lock): refuse while stopping, refuse an
        evicted group, bind the connection to the group if asked, and count a sign of life.
        Returns True if the group was not live before (see `_touch`)."""
        if self._stopping:
            raise _HTTPError(503, "lighthouse shutting down")
        self._take_eviction(rid)
        if bind:
            self._bind(conn, rid)
        return self._touch(rid, now)

    def _touch(self, rid: str, now: float) -> bool:
        """Register a sign of life; returns True if the group was not live before."""
        g = self._groups.get(rid)
        if g is None:
            self._info[rid] = _GroupInfo(first_seen=time.time())
            self._record("joined", rid)
            log.info("lighthouse: replica %s joined", rid)
            self._mark_prev_broken(rid)
            revived = True
        else:
            health = group_health(g, now, self._options)
            revived = health is not Health.LIVE
            if revived:
                self._record("revived", rid, f"was {health.value}")
                log.info("lighthouse: replica %s is back (was %s)", rid, health.value)
                self._mark_prev_broken(rid)
                info = self._info[rid]
                info.reason, info.silent_noted = "", False
        self._groups[rid] = GroupState(rid, now, Connection.CONNECTED)
        return revived

    def _bind(self, conn: _Conn, rid: str) -> None:
        if conn.replica_id == rid or conn.closed:
            return
        if conn.replica_id is not None:
            self._unbind(conn)
        conn.replica_id = rid
        self._by_replica.setdefault(rid, set()).add(conn)

    def _unbind(self, conn: _Conn) -> None:
        peers = self._by_replica.get(conn.replica_id or "")
        if peers is not None:
            peers.discard(conn)
            if not peers:
                del self._by_replica[conn.replica_id or ""]

    def _take_eviction(self, rid: str) -> None:
        reason = self._evicted.pop(rid, None)
        if reason is not None:
            raise _HTTPError(410, f"replica {rid} was evicted: {reason}")

    def _state(self) -> LighthouseState:
        # A view, not a copy: only used under the lock, and the decision functions do not mutate.
        return LighthouseState(
            groups=self._groups,
            requests=self._requests,
            round_start=self._round_start,
            prev_quorum=self._quorum,
            prev_quorum_broken=self._prev_broken,
            next_quorum_id=self._ids.peek(),
        )

    def _waiting_reason(self, now: float) -> str:
        if not self._requests:
            return "no pending quorum requests"
        return decide_quorum(self._state(), now, self._options).reason

    def _decide(self, now: float) -> None:
        """Recompute the decision after an event; form the quorum and wake its members if due."""
        if not self._requests:
            return
        state = self._state()
        if not may_form(state, now, self._options):  # O(1) on most arrivals; see may_form
            return
        decision = decide_quorum(state, now, self._options)
        if not decision.formed:
            return
        if decision.new_id:
            global _last_issued_id
            with _ids_lock:
                self._ids.take()
                _last_issued_id = max(_last_issued_id, decision.quorum_id or 0)
        quorum = decision.to_quorum(created=time.time())
        changed = self._quorum is None or quorum.quorum_id != self._quorum.quorum_id
        self._quorum = quorum
        self._prev_ids = frozenset(quorum.replica_ids)
        self._prev_broken = False
        # Encoded once per formed quorum, not once per waiter: with 64 groups that is most of the work.
        body = json.dumps({"quorum": quorum.to_json(), "version": API_VERSION}).encode()
        response = _RESPONSE_200_JSON % len(body) + body
        for member in quorum.participants:
            rid = member.replica_id
            del self._requests[rid]
            self._pending.pop(rid).resolve(result=quorum, body=body, response=response)
            self._info[rid].step = member.step
        self._round_start = now if self._requests else None
        if changed:
            self._record(
                "quorum", None, decision.reason, quorum_id=quorum.quorum_id, participants=list(quorum.replica_ids)
            )
            log.info(
                "lighthouse: quorum %d formed with %s (%s)", quorum.quorum_id, ", ".join(quorum.replica_ids), decision.reason
            )
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("lighthouse: quorum %d re-formed (%s)", quorum.quorum_id, decision.reason)

    def _drop_request(self, rid: str, pending: _Pending | None = None) -> None:
        if pending is not None and self._pending.get(rid) is not pending:
            return
        if self._pending.pop(rid, None) is not None:
            del self._requests[rid]
            if not self._requests:
                self._round_start = None

    def _mark_down(self, rid: str, connection: Connection, reason: str, now: float) -> bool:
        g = self._groups.get(rid)
        if g is None or g.connection is connection:
            return False
        self._groups[rid] = GroupState(rid, g.last_seen, connection)
        self._info[rid].reason = reason
        self._record(connection.value, rid, reason)
        self._mark_prev_broken(rid)
        log.warning("lighthouse: replica %s %s: %s", rid, connection.value, reason)
        self._decide(now)
        return True

    # -- endpoint bodies (called by the handler; raise _HTTPError for error responses)

    def _op_quorum(self, conn: _Conn, member: QuorumMember, *, bind: bool) -> _Pending:
        """Park ``member``'s request until a quorum containing it forms (maybe at once).

        Returns the request; the event loop answers it once it is resolved, or times it out.
        """
        rid = member.replica_id
        now = time.monotonic()
        with self._lock:
            self._admit(conn, rid, now, bind=bind)
            info = self._info[rid]
            info.step, info.address = member.step, member.address
            old = self._pending.get(rid)
            if old is not None:
                old.resolve(error=(409, f"superseded by a newer quorum request of replica {rid}"))
            pending = _Pending(member, conn, self._pending_resolved)
            self._pending[rid] = pending
            self._requests[rid] = member
            if self._round_start is None:
                self._round_start = now
            conn.busy, conn.pending = True, pending
            self._decide(now)
        return pending

    def _expire_long_poll(self, pending: _Pending, timeout: float) -> None:
        rid = pending.member.replica_id
        with self._lock:
            if not pending.done:
                reason = self._waiting_reason(time.monotonic())
                self._drop_request(rid, pending)
                pending.resolve(error=(408, f"no quorum containing {rid} within {timeout:g}s: {reason}"))

    def _pending_resolved(self, pending: _Pending) -> None:
        """`_Pending.resolve` hook (under the lock): queue the answer for the event loop."""
        self._resolved.append(pending)
        if threading.get_ident() != self._loop_ident:
            self._waker.set()

    def _op_heartbeat(self, conn: _Conn, rid: str, *, bind: bool) -> dict:
        now = time.monotonic()
        with self._lock:
            revived = self._admit(conn, rid, now, bind=bind)
            self._info[rid].heartbeats += 1
            if revived and rid in self._requests:
                self._decide(now)
        return {"ok": True}

    def _op_leave(self, conn: _Conn, rid: str) -> dict:
        now = time.monotonic()
        with self._lock:
            self._evicted.pop(rid, None)
            known = self._groups.pop(rid, None) is not None
            self._info.pop(rid, None)
            pending = self._pending.get(rid)
            if pending is not None:
                pending.resolve(error=(409, f"replica {rid} left"))
                self._drop_request(rid)
            if known:
                self._record("left", rid)
                self._mark_prev_broken(rid)
                log.info("lighthouse: replica %s left", rid)
                self._decide(now)
        return {"left": known}

    def _report_failure(self, rid: str, reason: str) -> bool:
        with self._lock:
            if rid not in self._groups:
                self._record("failure_report", rid, f"unknown replica: {reason}")
                log.warning("lighthouse: failure reported for unknown replica %s: %s", rid, reason)
                return False
            self._mark_down(rid, Connection.FAILED, reason, time.monotonic())
            return True

    def _evict(self, rid: str, reason: str) -> bool:
        now = time.monotonic()
        with self._lock:
            if rid not in self._groups:
                return False
            del self._groups[rid]
            self._info.pop(rid, None)
            self._evicted[rid] = reason
            pending = self._pending.get(rid)
            if pending is not None:
                # The parked request learns of the eviction: that is its one notice.
                del self._evicted[rid]
                pending.resolve(error=(410, f"replica {rid} was evicted: {reason}"))
                self._drop_request(rid)
            self._record("evicted", rid, reason)
            self._mark_prev_broken(rid)
            log.warning("lighthouse: replica %s evicted: %s", rid, reason)
            self._decide(now)
            return True

    def _check_token(self, header: str | None) -> None:
        if self._token is None:
            raise _HTTPError(403, "admin endpoints are disabled: the lighthouse was started without a token")
        if not header:
            raise _HTTPError(
                401, "admin endpoint needs 'Authorization: Bearer <token>'", headers={"WWW-Authenticate": "Bearer"}
            )
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token.encode()):
            raise _HTTPError(403, "wrong token")

    # ------------------------------------------------------------------ connections

    def _close_locked(self, conn: _Conn, *, peer_eof: bool, now: float) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        if conn.pending is not None:  # parked long poll of a dead peer: withdraw it, answer nobody
            pending = conn.pending
            pending.resolve(error=(0, "connection closed by peer"))
            self._drop_request(pending.member.replica_id, pending)
        rid = conn.replica_id
        if rid is None:
            return
        self._unbind(conn)
        if not peer_eof or self._stopping:
            return
        # All sockets of a dead process close together: probe the group's other parked connections
        # so that the last one is noticed now, whatever order the loop sees their EOFs in.
        for other in list(self._by_replica.get(rid, ())):
            if other.busy and _peer_closed(other.sock):
                self._close_locked(other, peer_eof=True, now=now)
        if rid in self._by_replica:
            return
        self._mark_down(rid, Connection.DISCONNECTED, "connection closed without leave", now)

    # ------------------------------------------------------------------ event loop ("lighthouse-io")
    #
    # Everything below runs in the loop thread only, except `_close_io` before `start`. Other
    # threads reach a connection only through its bookkeeping, under the lock, and through
    # `_resolved` + the waker.

    def _serve(self) -> None:
        self._loop_ident = threading.get_ident()
        select_ = self._selector.select
        try:
            while not self._stop.is_set():
                for key, mask in select_(self._next_timeout()):
                    conn = key.data
                    if conn is None:
                        self._accept()
                    elif conn is self._waker:
                        self._waker.clear()
                    elif not conn.io_closed:
                        try:
                            if mask & selectors.EVENT_WRITE:
                                self._on_writable(conn)
                            if mask & selectors.EVENT_READ and not conn.io_closed:
                                self._on_readable(conn)
                        except Exception:
                            log.exception("lighthouse: unexpected error serving %s", conn.peer)
                            self._close(conn, peer_eof=False)
                    # Answer a quorum formed by this event before looking at the next one.
                    self._answer_resolved()
                self._answer_resolved()
                self._expire_deadlines()
            self._answer_resolved()  # the 503s of shutdown
            self._flush_before_exit()
        except Exception:  # pragma: no cover - a bug; leave a trace instead of a silent dead server
            log.exception("lighthouse: event loop failed")
        finally:
            self._close_io()

    def _close_io(self) -> None:
        for conn in list(self._io_conns):
            self._close(conn, peer_eof=False)
        for closable in (self._selector, self._listener, self._waker):
            try:
                closable.close()
            except (OSError, ValueError, RuntimeError):
                pass

    def _flush_before_exit(self) -> None:
        deadline = time.monotonic() + SHUTDOWN_FLUSH_TIMEOUT
        while time.monotonic() < deadline:
            waiting = [c for c in self._io_conns if c.outbuf]
            if not waiting:
                return
            for conn in waiting:
                self._on_writable(conn)
            time.sleep(0.005)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: retried on the next readiness
                log.warning("lighthouse: accept failed: %s", e)
                time.sleep(0.01)
                return
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                sock.close()
                continue
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            conn = _Conn(sock, peer)
            conn.handler = _Handler(self, conn, addr)
            with self._lock:
                if self._stopping:
                    sock.close()
                    continue
                self._conns.add(conn)
            self._io_conns.add(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._set_deadline(conn, time.monotonic() + self.idle_timeout)

    def _set_deadline(self, conn: _Conn, when: float) -> None:
        conn.deadline = when
        if conn.scheduled is None or when < conn.scheduled:  # a later deadline re-arms lazily
            conn.scheduled = when
            heapq.heappush(self._deadlines, (when, next(self._seq), conn))

    def _next_timeout(self) -> float | None:
        return max(0.0, self._deadlines[0][0] - time.monotonic()) if self._deadlines else None

    def _expire_deadlines(self) -> None:
        heap = self._deadlines
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            when, _, conn = heapq.heappop(heap)
            if when != conn.scheduled or conn.io_closed:
                continue  # superseded by an earlier entry, or gone
            conn.scheduled = None
            if conn.deadline is None:
                continue
            if conn.deadline > now:  # pushed back since: re-arm
                self._set_deadline(conn, conn.deadline)
                continue
            conn.deadline = None
            try:
                self._on_deadline(conn)
            except Exception:
                log.exception("lighthouse: unexpected error serving %s", conn.peer)
                self._close(conn, peer_eof=False)
            self._answer_resolved()

    def _on_deadline(self, conn: _Conn) -> None:
        if conn.pending is not None:  # long poll: answered 408 by _answer_resolved
            self._expire_long_poll(conn.pending, conn.pending.timeout)
        elif conn.reading:  # partial request: http.server's parse at "EOF" yields the 408
            conn.timed_out = True
            self._process(conn)
        else:  # idle keep-alive, or a peer that does not read its response: not a death
            self._close(conn, peer_eof=False)

    def _watch(self, conn: _Conn) -> None:
        events = (0 if conn.eof else selectors.EVENT_READ) | (selectors.EVENT_WRITE if conn.outbuf else 0)
        if events != conn.events:
            if events:
                self._selector.modify(conn.sock, events, conn)
            else:
                self._selector.unregister(conn.sock)
            conn.events = events

    def _on_readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset: the peer is gone
            data = b""
        if data:
            conn.inbuf += data
            if conn.pending is None:
                self._process(conn)
            elif len(conn.inbuf) > MAX_PIPELINED_BYTES:
                log.warning("lighthouse: %s sent %d bytes while parked; dropping it", conn.peer, len(conn.inbuf))
                self._close(conn, peer_eof=False)
            return
        conn.eof = True
        if conn.pending is not None:  # the peer died while parked: withdraw the request
            self._close(conn, peer_eof=not self._stopping)
            return
        self._watch(conn)
        self._process(conn)

    def _on_writable(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn, peer_eof=not self._stopping)
            return
        del conn.outbuf[:sent]
        if not conn.outbuf:
            self._watch(conn)
            if self._written(conn):
                self._process(conn)

    def _write(self, conn: _Conn, data: bytes) -> None:
        """Send ``data`` now as far as the socket takes it; the rest once it is writable."""
        if conn.outbuf:
            conn.outbuf += data
            return
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(conn, peer_eof=not self._stopping)
            return
        if sent < len(data):
            conn.outbuf += memoryview(data)[sent:]
            self._watch(conn)
            if not conn.reading:  # a peer that never reads its answer is closed when idle
                self._set_deadline(conn, time.monotonic() + self.idle_timeout)

    def _written(self, conn: _Conn) -> bool:
        """A response went out completely: close, or return True if requests may follow."""
        if conn.close_after_write:
            self._close(conn, peer_eof=conn.eof and not conn.timed_out and not self._stopping)
            return False
        if not conn.reading:
            self._set_deadline(conn, time.monotonic() + self.idle_timeout)
        return True

    def _process(self, conn: _Conn) -> None:
        """Parse and serve the requests buffered on ``conn``, one at a time, until one is partial,
        parks, or leaves a response the socket has not taken yet."""
        handler = conn.handler
        assert handler is not None
        while not conn.io_closed and conn.pending is None and not conn.outbuf:
            final = conn.eof or conn.timed_out
            if not conn.inbuf:
                if conn.eof:
                    self._close(conn, peer_eof=not conn.timed_out and not self._stopping)
                return
            if not final and not self._worth_replay(conn):
                return  # replaying the parse now would stop at the same place
            reader = _Reader(conn.inbuf, final)
            handler.begin(reader)
            try:
                head = handler.known_head
                if head is not None and conn.inbuf.startswith(head):
                    reader.pos = len(head)
                    handler.handle_known_head()
                else:
                    BaseHTTPRequestHandler.handle_one_request(handler)
                    handler.remember_head(conn.inbuf)
            except _Incomplete:
                conn.want, conn.nl_from = reader.want, reader.nl_from
                if handler.continue_written:  # the client waits for it before sending the body
                    conn.continue_sent = True
                    self._write(conn, handler.wfile.getvalue())  # type: ignore[attr-defined]  # a BytesIO (begin())
                if not conn.reading:  # the whole request must arrive within read_timeout
                    conn.reading = True
                    self._set_deadline(conn, time.monotonic() + self.read_timeout)
                return
            del conn.inbuf[: reader.pos]
            conn.want, conn.nl_from, conn.reading, conn.continue_sent = 0, -1, False, False
            out = handler.wfile.getvalue()  # type: ignore[attr-defined]  # a BytesIO (begin())
            pending, handler.parked = handler.parked, None
            if pending is not None:  # long poll: answered by _answer_resolved, maybe right away
                if out:  # "100 Continue"
                    self._write(conn, out)
                self._set_deadline(conn, time.monotonic() + pending.timeout)
                return
            if handler.close_connection:
                conn.close_after_write = True
            if out:
                self._write(conn, out)
            if conn.io_closed or conn.outbuf or not self._written(conn):
                return

    @staticmethod
    def _worth_replay(conn: _Conn) -> bool:
        if len(conn.inbuf) >= conn.want:
            return True
        if conn.nl_from < 0:  # waiting for body bytes
            return False
        if conn.inbuf.find(b"\n", conn.nl_from) >= 0:
            return True
        conn.nl_from = len(conn.inbuf)  # scan each byte once, however slowly a line trickles in
        return False

    def _answer_resolved(self) -> None:
        """Write the answers of resolved long polls (a formed quorum: one shared byte string)."""
        resolved = self._resolved
        while resolved:
            pending = resolved.popleft()
            conn = pending.conn
            if conn.pending is not pending or conn.io_closed:
                continue
            conn.busy, conn.pending = False, None
            try:
                self._answer(conn, pending)
            except Exception:
                log.exception("lighthouse: unexpected error serving %s", conn.peer)
                self._close(conn, peer_eof=False)

    def _answer(self, conn: _Conn, pending: _Pending) -> None:
        handler = conn.handler
        assert handler is not None
        if pending.error is not None:
            code, message = pending.error
            if code == 0:  # the peer is gone: nothing to answer
                self._close(conn, peer_eof=True)
                return
            data = handler.render(handler._send_error_json, code, message)
        elif handler.close_connection or not pending.response:
            data = handler.render(handler._send, 200, "application/json", pending.body)
        else:
            data = pending.response
        if handler.close_connection:
            conn.close_after_write = True
        self._write(conn, data)
        if not conn.io_closed and not conn.outbuf and self._written(conn):
            self._process(conn)  # what the peer sent meanwhile

    def _close(self, conn: _Conn, *, peer_eof: bool) -> None:
        if conn.io_closed:
            return
        with self._lock:
            self._close_locked(conn, peer_eof=peer_eof, now=time.monotonic())
        conn.io_closed = True
        self._io_conns.discard(conn)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        _shutdown_socket(conn.sock, socket.SHUT_WR)
        conn.sock.close()
        conn.inbuf, conn.outbuf = bytearray(), bytearray()

    # ------------------------------------------------------------------ timer

    def _tick_loop(self) -> None:
        while not self._stop.wait(self._tick):
            try:
                self._on_tick()
            except Exception:  # keep ticking: a bug here must not silently stop failure detection
                log.exception("lighthouse: tick failed")

    def _on_tick(self) -> None:
        now = time.monotonic()
        hb = self._options.heartbeat_timeout
        with self._lock:
            for rid, g in self._groups.items():
                info = self._info[rid]
                if g.connection is Connection.CONNECTED and now - g.last_seen > hb and not info.silent_noted:
                    info.silent_noted = True
                    info.reason = f"no heartbeat for {hb:g}s"
                    self._record("silent", rid, info.reason)
                    self._mark_prev_broken(rid)
                    log.warning("lighthouse: replica %s silent: %s", rid, info.reason)
            self._decide(now)


#: The quorum response, byte for byte what `_Handler._send` produces for a 200 JSON body.
_RESPONSE_200_JSON = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


_HANGUP = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)


def _peer_closed(sock: socket.socket) -> bool:
    """True if the peer closed or reset the connection.

    Asks poll() for hang-up flags (POLLRDHUP: the peer's FIN, on Linux) instead of reading: the
    socket's own handler thread may be reading it at the same moment, and a recv here would either
    steal its data or block for the socket's timeout while the caller holds the server lock.
    """
    try:
        fd = sock.fileno()
        if fd < 0:
            return True
        poller = select.poll()
        poller.register(fd, select.POLLIN | _HANGUP)
        return any(events & _HANGUP for _, events in poller.poll(0))
    except (OSError, ValueError):
        return True


def _shutdown_socket(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass


def _expect(obj: dict, required: dict[str, tuple[type, ...]], optional: dict[str, tuple[type, ...]]) -> None:
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        raise _HTTPError(400, f"unknown field(s): {', '.join(map(repr, unknown))}")
    for name, types in (*required.items(), *optional.items()):
        if name not in obj:
            if name in required:
                raise _HTTPError(400, f"missing field {name!r}")
            continue
        value = obj[name]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise _HTTPError(400, f"field {name!r} must be {types[0].__name__}, got {type(value).__name__}")


def _check_replica_id(rid: str) -> None:
    if not rid or len(rid) > MAX_REPLICA_ID_LEN or not rid.isprintable():
        raise _HTTPError(400, f"replica_id must be 1..{MAX_REPLICA_ID_LEN} printable characters")


class _Handler(BaseHTTPRequestHandler):
    """http.server's request parsing and our endpoints, for one connection of the event loop.

    Not driven by socketserver: the loop calls `BaseHTTPRequestHandler.handle_one_request` once per
    request attempt, with ``rfile`` reading the connection's buffered bytes (`_Reader`) and
    ``wfile`` collecting the response, which the loop then sends without blocking.
    """

    protocol_version = "HTTP/1.1"
    server_version = "ftlaunch-lighthouse"

    _ROUTES: dict[str, dict[str, str]] = {
        "/": {"GET": "_get_dashboard"},
        "/status": {"GET": "_get_status"},
        "/quorum": {"POST": "_post_quorum"},
        "/heartbeat": {"POST": "_post_heartbeat"},
        "/leave": {"POST": "_post_leave"},
        "/admin/report_failure": {"POST": "_post_report_failure"},
        "/admin/evict": {"POST": "_post_evict"},
    }

    def __init__(self, lh: LighthouseServer, conn: _Conn, client_address: Any) -> None:
        # Deliberately not BaseRequestHandler.__init__, which would serve the socket in this call.
        self.lh = lh
        self.conn = conn
        self.request = self.connection = conn.sock
        self.client_address = client_address
        self.server = None  # type: ignore[assignment]  # served by the loop, not a socketserver
        self.peer = conn.peer
        self.rfile: Any = None
        self.wfile = io.BytesIO()
        self.body_read = False
        self.parked: _Pending | None = None
        self.continue_written = False
        self.known_head: bytes | None = None  # request line + headers of the last parsed request ...
        self._known: tuple | None = None  # ... and what parse_request made of them
        self._parsed: tuple | None = None

    def begin(self, reader: _Reader) -> None:
        """Reset the per-request state for one parse attempt over ``reader``."""
        self.rfile = reader
        self.wfile = io.BytesIO()
        self.close_connection = True
        self.raw_requestline = b""
        self.requestline = ""
        self.request_version = self.default_request_version
        self.command = None  # type: ignore[assignment]  # unset until parse_request succeeds
        self.headers = None  # type: ignore[assignment]  # (as in http.server before a parse)
        self.body_read = False
        self.parked = None
        self.continue_written = False
        self._parsed = None

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:
            self._parsed = (
                self.rfile.pos, self.raw_requestline, self.requestline, self.command, self.path,
                self.request_version, self.headers, self.close_connection,
            )
        return ok

    # A keep-alive client sends the same request line and headers again and again (a heartbeat
    # connection: always the same bytes; a quorum connection: the same until the body's length
    # changes). parse_request is a function of those bytes, so when the buffer starts with exactly
    # the bytes parsed last time on this connection, its result is reused instead of recomputed
    # (about 40% of the server's work per request). Any other bytes go through http.server again.

    def remember_head(self, buf: bytearray) -> None:
        parsed = self._parsed
        if parsed is None or self.headers.get("Expect") is not None or not hasattr(self, "do_" + self.command):
            self.known_head = self._known = None
            return
        self.known_head = bytes(buf[: parsed[0]])
        self._known = parsed[1:]

    def handle_known_head(self) -> None:
        """`BaseHTTPRequestHandler.handle_one_request` after its parse, from the remembered parse."""
        assert self._known is not None
        (
            self.raw_requestline, self.requestline, self.command, self.path,
            self.request_version, self.headers, self.close_connection,
        ) = self._known
        getattr(self, "do_" + self.command)()

    def render(self, write: Any, *args: Any) -> bytes:
        """The bytes ``write(*args)`` (one of the ``_send`` methods) produces for the current request."""
        self.wfile = io.BytesIO()
        write(*args)
        return self.wfile.getvalue()

    def handle_expect_100(self) -> bool:
        if not self.conn.continue_sent:  # once per request, however often its parse is replayed
            self.send_response_only(HTTPStatus.CONTINUE)
            self.end_headers()
            self.continue_written = True
        return True

    # -- logging: http.server writes to stderr; route it to our logger, quietly

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        pass

    def log_error(self, format: str, *args: Any) -> None:
        log.debug("lighthouse: %s: " + format, self.peer, *args)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("lighthouse: %s: " + format, self.peer, *args)

    # -- responses

    def _send_json(self, code: int, payload: dict, headers: dict | None = None) -> None:
        payload["version"] = API_VERSION
        body = json.dumps(payload).encode()
        self._send(code, "application/json", body, headers)

    def _send(self, code: int, ctype: str, body: bytes, headers: dict | None = None) -> None:
        if self.request_version == "HTTP/0.9":  # we speak 1.x only; make error replies readable
            self.request_version = "HTTP/1.0"
        self.send_response_only(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_error_json(self, code: int, message: str, *, close: bool = False, headers: dict | None = None) -> None:
        if close or (not self.body_read and self._has_body()):
            # An unread body would be parsed as the next request: drop the connection instead.
            self.close_connection = True
        level = logging.INFO if code in (408, 409, 410, 503) else logging.WARNING
        log.log(
            level, "lighthouse: %d for %s %s from %s: %s",
            code, self.command or "-", getattr(self, "path", "-"), self.peer, message,
        )
        self._send_json(code, {"error": message}, headers)

    def _has_body(self) -> bool:
        headers = getattr(self, "headers", None) or {}
        length = headers.get("Content-Length")
        return bool(headers.get("Transfer-Encoding")) or (length is not None and length.strip() not in ("", "0"))

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (bad request line, too many headers, ...), as JSON."""
        self.close_connection = True
        if self.conn.timed_out:
            code, message = 408, f"request not received within {self.lh.read_timeout:g}s"
        try:
            self._send_error_json(code, message or HTTPStatus(code).phrase, close=True)
        except OSError:
            pass

    # -- dispatch

    def _dispatch(self) -> None:
        try:
            if self.conn.timed_out:
                raise _HTTPError(408, f"request not received within {self.lh.read_timeout:g}s", close=True)
            path = urlsplit(self.path).path
            if path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/"):
                path = path[len(PATH_PREFIX) :] or "/"
            if len(path) > 1:
                path = path.rstrip("/")
            methods = self._ROUTES.get(path)
            if methods is None:
                raise _HTTPError(404, f"no such endpoint: {path}")
            name = methods.get(self.command)
            if name is None:
                raise _HTTPError(
                    405, f"{self.command} not allowed on {path} (use {', '.join(methods)})",
                    headers={"Allow": ", ".join(methods)},
                )
            getattr(self, name)()
        except _HTTPError as e:
            if e.code == 0:  # the peer is gone (detected while parked): nothing to answer
                self.close_connection = True
                return
            self._send_error_json(e.code, e.message, close=e.close, headers=e.headers)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _dispatch

    def _read_json(self) -> dict:
        if self.headers.get("Transfer-Encoding"):
            raise _HTTPError(411, "chunked request bodies are not supported: send Content-Length", close=True)
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            raise _HTTPError(411, "Content-Length required")
        try:
            length = int(length_text)
            if length < 0:
                raise ValueError
        except ValueError:
            raise _HTTPError(400, f"bad Content-Length {length_text!r}", close=True) from None
        if length > MAX_BODY_BYTES:
            raise _HTTPError(413, f"request body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}", close=True)
        body = self.rfile.read(length)
        if len(body) < length:  # only at EOF or past the read deadline
            if self.conn.timed_out:
                raise _HTTPError(408, f"request not received within {self.lh.read_timeout:g}s", close=True)
            raise _HTTPError(400, "truncated request body", close=True)
        self.body_read = True
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise _HTTPError(400, f"malformed JSON: {e}") from None
        if not isinstance(obj, dict):
            raise _HTTPError(400, f"request body must be a JSON object, got {type(obj).__name__}")
        return obj

    def _replica_id(self, obj: dict) -> str:
        rid = obj["replica_id"]
        _check_replica_id(rid)
        header = self.headers.get(REPLICA_HEADER)
        if header is not None and header != rid:
            raise _HTTPError(400, f"header {REPLICA_HEADER}={header!r} does not match replica_id {rid!r}")
        return rid

    # -- endpoints

    def _get_dashboard(self) -> None:
        html = dashboard.render(self.lh.status())
        self._send(200, "text/html; charset=utf-8", html.encode())

    def _get_status(self) -> None:
        self._send_json(200, self.lh.status())

    def _post_quorum(self) -> None:
        obj = self._read_json()
        _expect(obj, {"member": (dict,)}, {"timeout": (float, int)})
        try:
            member = QuorumMember.from_json(obj["member"])
        except (TypeError, ValueError) as e:
            raise _HTTPError(400, f"bad member: {e}") from None
        self._replica_id({"replica_id": member.replica_id})
        timeout = float(obj.get("timeout", DEFAULT_QUORUM_TIMEOUT))
        if not (0 < timeout <= MAX_QUORUM_TIMEOUT):
            raise _HTTPError(400, f"timeout must be in (0, {MAX_QUORUM_TIMEOUT:g}] seconds, got {timeout:g}")
        bind = self.headers.get(REPLICA_HEADER) is not None
        self.parked = self.lh._op_quorum(self.conn, member, bind=bind)  # the loop answers it
        self.parked.timeout = timeout

    def _post_heartbeat(self) -> None:
        obj = self._read_json()
        _expect(obj, {"replica_id": (str,)}, {})
        rid = self._replica_id(obj)
        bind = self.headers.get(REPLICA_HEADER) is not None
        self._send_json(200, self.lh._op_heartbeat(self.conn, rid, bind=bind))

    def _post_leave(self) -> None:
        obj = self._read_json()
        _expect(obj, {"replica_id": (str,)}, {})
        self._send_json(200, self.lh._op_leave(self.conn, self._replica_id(obj)))

    def _admin_body(self) -> tuple[str, str]:
        self.lh._check_token(self.headers.get("Authorization"))
        obj = self._read_json()
        _expect(obj, {"replica_id": (str,)}, {"reason": (str,)})
        rid = obj["replica_id"]
        _check_replica_id(rid)
        return rid, obj.get("reason", "")

    def _post_report_failure(self) -> None:
        rid, reason = self._admin_body()
        if not self.lh._report_failure(rid, reason or f"reported failed by admin {self.peer}"):
            raise _HTTPError(404, f"unknown replica {rid!r}")
        self._send_json(200, {"ok": True})

    def _post_evict(self) -> None:
        rid, reason = self._admin_body()
        if not self.lh._evict(rid, reason or f"evicted by admin {self.peer}"):
            raise _HTTPError(404, f"unknown replica {rid!r}")
        self._send_json(200, {"ok": True})
