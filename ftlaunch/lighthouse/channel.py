"""One persistent HTTP connection to the lighthouse, with retries (`Channel`), and how an answer
reads (`decode`, `raise_for`): the wire under `client.LighthouseClient`.

Why apart: the client's own job is the protocol's calls (quorum, heartbeat, leave, claim, ...);
this is how one request travels: keep-alive reuse, a stale connection retried at once, connection
failures retried with exponential backoff for at most ``connect_timeout``, a read timeout on every
socket operation, the job token and the incarnation on every request.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable

from ftlaunch.addresses import http_url
from ftlaunch.errors import (
    EvictedError,
    LighthouseError,
    LighthouseUnavailableError,
    QuorumTimeoutError,
    TrainingFinishedError,
)
from ftlaunch.lighthouse.protocol import API_VERSION, INCARNATION_HEADER, REPLICA_HEADER

_BACKOFF_START = 0.02
_BACKOFF_MAX = 1.0
#: The least time one connection attempt gets when a call shortens its retry budget.
_MIN_CONNECT = 0.1


class Channel:
    """One persistent HTTP connection with retry-on-connection-error. Used by one thread at a time."""

    def __init__(
        self,
        host: str,
        port: int,
        connect_timeout: float,
        token: str | None,
        incarnation: str,
        on_connection: Callable[[bool], None] | None = None,
    ) -> None:
        self._host, self._port = host, port
        self._on_connection = on_connection  # told of every answer (True) and failed connection (False)
        self._connect_timeout = connect_timeout
        self._token = token
        self._incarnation = incarnation
        self._http: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()  # guards _http against a concurrent abort()

    def close(self) -> None:
        with self._lock:
            conn, self._http = self._http, None
        if conn is not None:
            conn.close()

    def abort(self) -> None:
        """Unblock a request in flight from another thread (shutdown, not close: no fd reuse race)."""
        with self._lock:
            sock = self._http.sock if self._http is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def call(
        self,
        method: str,
        path: str,
        payload: dict | None,
        *,
        bind_replica: str | None = None,
        read_timeout: float,
        stop: threading.Event | None = None,
        connect_timeout: float | None = None,
    ) -> tuple[int, dict]:
        """Send one request and read its answer. ``connect_timeout`` (default: the channel's) bounds
        the retries of failed connections for this call (0: one attempt): a group stepping through a
        lighthouse outage (worker/outage.py) gives up after half a second instead of ten."""
        budget = self._connect_timeout if connect_timeout is None else connect_timeout
        body = json.dumps(payload).encode() if payload is not None else None
        headers = {"Content-Type": "application/json"} if body is not None else {}
        headers[INCARNATION_HEADER] = self._incarnation
        if bind_replica is not None:
            headers[REPLICA_HEADER] = bind_replica
        if self._token:  # every request but a read needs it (docs/security.md); sent on all, it costs nothing
            headers["Authorization"] = f"Bearer {self._token}"
        url = http_url(self._host, self._port)
        deadline: float | None = None  # set at the first failure: retries get connect_timeout from there
        backoff = _BACKOFF_START
        last_error: BaseException | None = None
        stale_retry_used = False
        while True:
            if stop is not None and stop.is_set():
                raise LighthouseUnavailableError(f"request to lighthouse {url} abandoned: stopping")
            conn, reused = self._http, self._http is not None
            attempt_start = time.monotonic()
            try:
                if conn is None:
                    remaining = budget if deadline is None else max(0.001, deadline - time.monotonic())
                    if connect_timeout is not None:  # a short budget (0: one attempt) still connects
                        remaining = max(remaining, _MIN_CONNECT)
                    conn = http.client.HTTPConnection(self._host, self._port, timeout=remaining)
                    conn.connect()  # sets TCP_NODELAY
                    with self._lock:
                        self._http = conn
            except OSError as e:  # refused, unreachable, connect timeout
                last_error = e
                if self._on_connection is not None:
                    self._on_connection(False)
                conn = None
                if deadline is None:
                    deadline = attempt_start + budget
            if conn is not None:
                try:
                    if conn.sock is not None:
                        conn.sock.settimeout(read_timeout)
                    conn.request(method, path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    if self._on_connection is not None:
                        self._on_connection(True)
                    if resp.will_close:
                        self.close()
                    return resp.status, decode(resp.status, data, url)
                except TimeoutError:
                    self.close()
                    raise LighthouseUnavailableError(
                        f"lighthouse {url} did not answer {method} {path} within {read_timeout:g}s"
                    ) from None
                except (OSError, http.client.HTTPException) as e:
                    self.close()
                    last_error = e
                    if self._on_connection is not None:
                        self._on_connection(False)
                    if reused and not stale_retry_used:
                        # The server may have closed an idle keep-alive connection: retry at once.
                        stale_retry_used = True
                        continue
            if deadline is None:
                deadline = time.monotonic() + budget
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LighthouseUnavailableError(
                    f"lighthouse {url} unreachable for {budget:g}s ({method} {path}): {last_error}"
                ) from None
            pause = min(backoff, remaining)
            if stop is not None:
                stop.wait(pause)
            else:
                time.sleep(pause)
            backoff = min(backoff * 2, _BACKOFF_MAX)


def decode(status: int, data: bytes, url: str) -> dict:
    try:
        obj = json.loads(data) if data else {}
    except ValueError:
        raise LighthouseError(
            f"lighthouse {url} answered HTTP {status} with a non-JSON body: {data[:200]!r}"
        ) from None
    if not isinstance(obj, dict):
        raise LighthouseError(f"lighthouse {url} answered HTTP {status} with JSON that is not an object")
    version = obj.get("version")
    if version != API_VERSION:
        raise LighthouseError(
            f"lighthouse {url} speaks protocol version {version!r}, this client {API_VERSION}"
        )
    return obj


def raise_for(status: int, payload: dict, what: str) -> None:
    if status == 200:
        return
    message = f"{what}: HTTP {status}: {payload.get('error', 'no error message')}"
    if status == 410:
        raise EvictedError(message)
    if status == 408:
        raise QuorumTimeoutError(message)
    if status == 412:
        raise TrainingFinishedError(message)
    if status == 503:
        raise LighthouseUnavailableError(message)
    raise LighthouseError(message)
