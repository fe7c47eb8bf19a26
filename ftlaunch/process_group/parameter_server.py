"""torchft's fault-tolerant parameter server: one fresh two-member process group per client session.

Why it is built on reconfigurable groups: a session is a group of two (server rank 0, client
rank 1) made with ``configure`` on its own store prefix, so a client that dies ends only its own
session - the server's group fails with `CommunicationError`, its thread ends, and every other
session carries on. No lighthouse is involved.

Protocol: a client asks ``GET /new_session`` on the server's HTTP port; the answer is JSON
``{"session_id": ..., "store_addr": "host:port/session/<id>"}`` (never pickle), pointing into a
TCPStore the server hosts. Both sides then ``configure`` a group of the subclass's kind on that
address, and the server calls `ParameterServer.forward` with its end on a thread of its own.

Differences from torchft, on purpose: the HTTP endpoint listens on loopback unless ``bind`` says
otherwise (the endpoint is unauthenticated: anyone who reaches it can open sessions), and
`shutdown` ends the sessions and releases the ports and threads (torchft's server has no
shutdown). The TCPStore, like every torch TCPStore server, listens on all interfaces.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
import urllib.request
import uuid
from abc import ABC, abstractmethod
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch.distributed as dist

from ftlaunch import env
from ftlaunch.addresses import format_host_port, http_url, parse_store_addr
from ftlaunch.errors import CommunicationError
from ftlaunch.process_group.base import ProcessGroup

logger = logging.getLogger(__name__)

__all__ = ["ParameterServer"]

_SERVER_RANK, _CLIENT_RANK = 0, 1


class _Handler(BaseHTTPRequestHandler):
    server: _SessionServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path != "/new_session":
            self._reply(404, {"error": f"unknown path {self.path!r}; sessions start at /new_session"})
            return
        ps = self.server.owner
        session_id = uuid.uuid4().hex
        store_addr = f"{ps.store_host_port}/session/{session_id}"
        self._reply(200, {"session_id": session_id, "store_addr": store_addr})
        # The client has its answer (the connection is closed): this thread now serves the session.
        self.close_connection = True
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_WR)
        ps._run_session(session_id, store_addr)

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = (json.dumps(body) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        logger.debug("parameter server: " + format, *args)


class _SessionServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, owner: ParameterServer, addr: tuple[str, int]) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.owner = owner
        super().__init__(addr, _Handler)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # no reverse DNS lookup (HTTPServer's getfqdn)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("parameter server: error serving %s", client_address, exc_info=True)


class ParameterServer(ABC):
    """A threaded parameter server (torchft's API): subclass it, implement `new_process_group`
    (a fresh, unconfigured group per session) and `forward` (one session, server side).

    ``ParameterServer(port, store_port=0, bind="127.0.0.1")`` serves at once: ``port`` is the HTTP
    port (0: any free one, see `address`), ``store_port`` the session TCPStore's, ``bind`` the
    host the HTTP endpoint listens on (``0.0.0.0``/``::`` for clients on other hosts).
    Clients call ``MyServer.new_session(server.address())`` and get their end of the group.
    """

    def __init__(self, port: int, store_port: int = 0, bind: str = "127.0.0.1") -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[threading.Thread, ProcessGroup | None]] = {}
        self._closed = False
        wildcard = bind in ("", "0.0.0.0", "::")
        advertised = (env.local_addr() or socket.gethostname()) if wildcard else bind
        self.store = dist.TCPStore(
            advertised, store_port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.store_host_port = format_host_port(advertised, self.store.port)
        self._server = _SessionServer(self, (bind, port))
        self._url = http_url(advertised, int(self._server.server_address[1]))
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="ftlaunch-ps-http",
            daemon=True,
        )
        self._thread.start()
        logger.info("parameter server: sessions at %s", self.address())

    def address(self) -> str:
        """``http://host:port/new_session``: what clients pass to `new_session`."""
        return f"{self._url}/new_session"

    # ---- what a subclass provides ------------------------------------------------------------
    @classmethod
    @abstractmethod
    def new_process_group(cls) -> ProcessGroup:
        """A new, unconfigured group for one session (both ends call it)."""

    @abstractmethod
    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        """Serve one session on ``pg`` (server rank 0, client rank 1), on a thread of its own.

        Loop inside for several exchanges. When it returns or raises (e.g. `CommunicationError`
        because the client died) the session's group is shut down; the client must start a new
        session.
        """

    # ---- client side -------------------------------------------------------------------------
    @classmethod
    def new_session(cls, address: str, timeout: timedelta | float = timedelta(seconds=60)) -> ProcessGroup:
        """Start a session on the server at ``address``; returns this client's end (rank 1 of 2).

        Raises `CommunicationError` when the server cannot be reached or answers nonsense.
        """
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        try:
            with urllib.request.urlopen(address, timeout=seconds) as f:
                data = json.loads(f.read(1 << 16))
            session_id, store_addr = data["session_id"], data["store_addr"]
            if not isinstance(session_id, str) or not isinstance(store_addr, str):
                raise ValueError("session_id and store_addr must be strings")
            parse_store_addr(store_addr)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CommunicationError(f"parameter server {address}: cannot start a session: {e}") from e
        logger.info("parameter server: joining session %s at %s", session_id, store_addr)
        pg = cls.new_process_group()
        pg.configure(store_addr, _CLIENT_RANK, 2)
        return pg

    # ---- server side -------------------------------------------------------------------------
    def _run_session(self, session_id: str, store_addr: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._sessions[session_id] = (threading.current_thread(), None)
        pg: ProcessGroup | None = None
        try:
            pg = self.new_process_group()
            with self._lock:
                self._sessions[session_id] = (threading.current_thread(), pg)
                closed = self._closed
            if closed:
                return
            pg.configure(store_addr, _SERVER_RANK, 2)
            logger.info("parameter server: session %s started", session_id)
            self.forward(session_id, pg)
        except CommunicationError as e:
            logger.info("parameter server: session %s ended: %s", session_id, e)
        except Exception:
            logger.exception("parameter server: session %s failed", session_id)
        finally:
            if pg is not None:
                pg.shutdown()
            with self._lock:
                self._sessions.pop(session_id, None)

    def num_sessions(self) -> int:
        """Sessions in progress."""
        with self._lock:
            return len(self._sessions)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting sessions, abort the running ones, wait for their threads up to
        ``timeout`` seconds and release the ports. Idempotent.

        An aborted session's `forward` fails at once with a Baby group; an op blocked in an
        in-process gloo group cannot be interrupted and fails within the group's op timeout.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sessions = list(self._sessions.values())
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout)
        for _, pg in sessions:
            if pg is not None:
                pg.abort()
        for thread, _ in sessions:
            thread.join(timeout)
        del self.store

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
