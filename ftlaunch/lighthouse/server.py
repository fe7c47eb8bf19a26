"""The lighthouse: a small HTTP/JSON quorum server on the standard library's ThreadingHTTPServer.

One thread per connection (clients keep connections alive, so no per-request thread), one lock
guarding all state, and the decision recomputed on every event (request arrival, disconnect,
failure report, eviction) by the pure `decide_quorum`. A timer thread ticking every
``quorum_tick`` seconds covers what only time changes: the join timeout, heartbeat expiry, dead
peers of connections that are parked in a long poll, and clients too slow to send their request.

Failure detection: requests carrying the ``X-Ftlaunch-Replica`` header bind their connection to
that replica group. When the peer closes the group's last bound connection (EOF or reset: the
process died) without a prior ``leave``, the group is marked disconnected at once and the quorum
is recomputed. A group that stays connected but silent drops out after ``heartbeat_timeout``.

Fan-out: the thread that forms a quorum encodes it once and writes it to every parked keep-alive
waiter with non-blocking sends before waking them (see `_deliver_directly`), so the latency of a
64-group quorum is not 64 scheduler wake-ups long.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import select
import socket
import socketserver
import threading
import time
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

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
    format_url,
    parse_host_port,
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
    """Server-side record of one client connection."""

    __slots__ = ("sock", "peer", "replica_id", "closed", "busy", "pending", "timed_out")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.replica_id: str | None = None
        self.closed = False
        self.busy = False  # parked in a long poll: nobody reads it, so the tick probes it for hang-up
        self.pending: _Pending | None = None
        self.timed_out = False  # the read watchdog fired


class _Pending:
    """A quorum request parked in a long poll; resolved (once) with a quorum or an error.

    The waiter sleeps on its own Event, not on the server lock, so waking 64 of them does not make
    them queue for the lock one after another.
    """

    __slots__ = ("member", "done", "result", "body", "error", "sock", "response", "sent")

    def __init__(self, member: QuorumMember, sock: socket.socket | None = None) -> None:
        self.member = member
        self.done = threading.Event()
        self.result: Quorum | None = None
        self.body = b""  # the encoded 200 response body for `result`
        self.error: tuple[int, str] | None = None  # (status, message); status 0 = drop silently
        self.sock = sock  # set if the forming thread may write the response directly (keep-alive 1.1)
        self.response = b""  # full HTTP response, when written (partly) by the forming thread
        self.sent = 0  # bytes of `response` already written by the forming thread

    def resolve(
        self, result: Quorum | None = None, error: tuple[int, str] | None = None, body: bytes = b""
    ) -> None:
        if self.done.is_set():  # first answer wins; the waiter may already be writing it
            return
        self.result, self.error, self.body = result, error, body
        self.done.set()


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
        self._reading: dict[_Conn, float] = {}  # connections mid-request -> read deadline
        self._history: deque[dict[str, Any]] = deque(maxlen=HISTORY_LEN)
        self._stopping = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

        try:
            self._httpd = _HTTPServer((host, port), self)
        except OSError as e:
            raise ConfigurationError(f"lighthouse: cannot bind {bind!r}: {e}") from None
        bound_host, bound_port = self._httpd.server_address[:2]
        if bound_host in ("0.0.0.0", "::", ""):
            bound_host = socket.gethostname()
        self._address = format_url(bound_host, bound_port)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> LighthouseServer:
        if self._threads:
            raise RuntimeError("lighthouse already started")
        serve = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="lighthouse-http", daemon=True
        )
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
            conns = list(self._conns)
        self._stop.set()
        if self._threads:
            self._httpd.shutdown()
        self._httpd.server_close()
        # Reading half only: parked long polls can still write their 503, idle readers see EOF.
        for conn in conns:
            _shutdown_socket(conn.sock, socket.SHUT_RD)
        for t in self._threads:
            t.join(timeout=5.0)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            with self._lock:
                if not self._conns:
                    break
            time.sleep(0.01)
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
        delivered = []
        for member in quorum.participants:
            rid = member.replica_id
            del self._requests[rid]
            pending = self._pending.pop(rid)
            _deliver_directly(pending, response)
            delivered.append(pending)
            self._info[rid].step = member.step
        # Wake the waiters only after all sends: a woken waiter competes for the GIL with this loop.
        for pending in delivered:
            pending.resolve(result=quorum, body=body)
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

    def _op_quorum(
        self, conn: _Conn, member: QuorumMember, timeout: float, *, bind: bool, direct: bool
    ) -> _Pending:
        """Park until a quorum containing ``member`` forms; returns the resolved request.

        ``direct``: the forming thread may write the response itself (see `_deliver_directly`).
        """
        rid = member.replica_id
        now = time.monotonic()
        with self._lock:
            if self._stopping:
                raise _HTTPError(503, "lighthouse shutting down")
            self._take_eviction(rid)
            if bind:
                self._bind(conn, rid)
            self._touch(rid, now)
            info = self._info[rid]
            info.step, info.address = member.step, member.address
            old = self._pending.get(rid)
            if old is not None:
                old.resolve(error=(409, f"superseded by a newer quorum request of replica {rid}"))
            pending = _Pending(member, conn.sock if direct else None)
            self._pending[rid] = pending
            self._requests[rid] = member
            if self._round_start is None:
                self._round_start = now
            conn.busy, conn.pending = True, pending
            self._decide(now)
        try:
            if not pending.done.wait(timeout):
                with self._lock:
                    if not pending.done.is_set():
                        reason = self._waiting_reason(time.monotonic())
                        self._drop_request(rid, pending)
                        pending.resolve(error=(408, f"no quorum containing {rid} within {timeout:g}s: {reason}"))
        finally:
            conn.busy, conn.pending = False, None
        if pending.error is not None:
            code, message = pending.error
            raise _HTTPError(code, message, close=code == 0)
        return pending

    def _op_heartbeat(self, conn: _Conn, rid: str, *, bind: bool) -> dict:
        now = time.monotonic()
        with self._lock:
            if self._stopping:
                raise _HTTPError(503, "lighthouse shutting down")
            self._take_eviction(rid)
            if bind:
                self._bind(conn, rid)
            revived = self._touch(rid, now)
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

    def _conn_opened(self, sock: socket.socket, peer: str) -> _Conn:
        conn = _Conn(sock, peer)
        with self._lock:
            self._conns.add(conn)
        return conn

    def _conn_closed(self, conn: _Conn, *, peer_eof: bool) -> None:
        with self._lock:
            self._close_locked(conn, peer_eof=peer_eof, now=time.monotonic())

    def _close_locked(self, conn: _Conn, *, peer_eof: bool, now: float) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        self._reading.pop(conn, None)
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
        # All sockets of a dead process close together, but a parked long poll is not being read:
        # probe the group's other connections so the last one is noticed now, not a tick later.
        for other in list(self._by_replica.get(rid, ())):
            if other.busy and _peer_closed(other.sock):
                self._close_locked(other, peer_eof=True, now=now)
        if rid in self._by_replica:
            return
        self._mark_down(rid, Connection.DISCONNECTED, "connection closed without leave", now)

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
            for conn in [c for c in self._conns if c.busy]:
                if _peer_closed(conn.sock):
                    self._close_locked(conn, peer_eof=True, now=now)
            self._decide(now)
        for conn, deadline in list(self._reading.items()):
            if now > deadline and not conn.timed_out:
                conn.timed_out = True
                _shutdown_socket(conn.sock, socket.SHUT_RD)  # the blocked read returns EOF -> 408


#: The quorum response, byte for byte what `_Handler._send` produces for a 200 JSON body.
_RESPONSE_200_JSON = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


def _deliver_directly(pending: _Pending, response: bytes) -> None:
    """Write a formed quorum's response from the forming thread, without blocking.

    Waking N handler threads so that each writes its own response costs N thread switches, each
    at the mercy of the scheduler on a busy host; one thread doing N non-blocking sends does not.
    Whatever the socket does not take at once, the waiter's own thread writes after it wakes.
    """
    sock = pending.sock
    if sock is None or pending.done.is_set():
        return
    pending.response = response
    # A socket with a timeout polls (up to the timeout) before sending, even with MSG_DONTWAIT;
    # timeout 0 makes it a plain non-blocking send. Safe: its handler is parked, not using it.
    timeout = sock.gettimeout()
    try:
        sock.settimeout(0.0)
        pending.sent = sock.send(response)
    except (OSError, ValueError):  # EAGAIN or a dead peer: the waiter's own thread writes / sees it
        pending.sent = 0
    finally:
        try:
            sock.settimeout(timeout)
        except OSError:
            pass


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


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, address: tuple[str, int], lighthouse: LighthouseServer) -> None:
        self.lighthouse = lighthouse
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the FQDN (a DNS lookup that can stall); we do not need it.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.exception("lighthouse: unexpected error serving %s", client_address)


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
    protocol_version = "HTTP/1.1"
    server_version = "ftlaunch-lighthouse"
    disable_nagle_algorithm = True
    wbufsize = -1  # buffered: status line, headers and body leave in one send at flush
    server: _HTTPServer

    _ROUTES: dict[str, dict[str, str]] = {
        "/": {"GET": "_get_dashboard"},
        "/status": {"GET": "_get_status"},
        "/quorum": {"POST": "_post_quorum"},
        "/heartbeat": {"POST": "_post_heartbeat"},
        "/leave": {"POST": "_post_leave"},
        "/admin/report_failure": {"POST": "_post_report_failure"},
        "/admin/evict": {"POST": "_post_evict"},
    }

    def setup(self) -> None:
        super().setup()
        self.lh: LighthouseServer = self.server.lighthouse
        self.connection.settimeout(self.lh.idle_timeout)
        peer = self.client_address
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.conn = self.lh._conn_opened(self.connection, self.peer)
        self.peer_eof = False
        self.body_read = False

    def handle_one_request(self) -> None:
        # Idle phase: wait (up to idle_timeout) for the first byte of the next request.
        try:
            head = self.rfile.peek(1)
        except TimeoutError:
            self.close_connection = True
            return
        except OSError:
            self.peer_eof = self.close_connection = True
            return
        if not head:
            self.peer_eof = not self.conn.timed_out and not self.lh._stopping
            self.close_connection = True
            return
        # Request phase: the whole request must arrive within read_timeout (tick-driven watchdog).
        self.body_read = False
        self.lh._reading[self.conn] = time.monotonic() + self.lh.read_timeout
        try:
            super().handle_one_request()
        except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError):
            self.peer_eof = self.close_connection = True
        finally:
            self.lh._reading.pop(self.conn, None)
        if self.conn.timed_out:
            self.close_connection = True

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        finally:
            self.lh._conn_closed(self.conn, peer_eof=self.peer_eof)

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
        self.lh._reading.pop(self.conn, None)  # request fully received: the read deadline is over
        if len(body) < length:
            if self.conn.timed_out:
                raise _HTTPError(408, f"request not received within {self.lh.read_timeout:g}s", close=True)
            self.peer_eof = True
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
        self.lh._reading.pop(self.conn, None)
        html = dashboard.render(self.lh.status())
        self._send(200, "text/html; charset=utf-8", html.encode())

    def _get_status(self) -> None:
        self.lh._reading.pop(self.conn, None)
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
        direct = self.request_version == "HTTP/1.1" and not self.close_connection
        pending = self.lh._op_quorum(self.conn, member, timeout, bind=bind, direct=direct)
        if pending.response:
            self.wfile.write(pending.response[pending.sent :])  # the rest, if any
        else:
            self._send(200, "application/json", pending.body)

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
