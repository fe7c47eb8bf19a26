"""The lighthouse: a small HTTP/JSON quorum server (protocol: docs/lighthouse.md).

`LighthouseServer` composes three parts, each with one job:

* `membership.Membership` — the bookkeeping: groups, quorum requests, the decision (the pure
  `quorum.decide_quorum`), heartbeats, failures, evictions, history. No HTTP, no sockets.
* `routes.Routes` — the endpoints: JSON validation, the admin token, the membership's refusals as
  status codes.
* `transport.HttpServer` — connections on one asyncio event-loop thread: HTTP/1.1 parsing by the
  standard library, keep-alive, long polls, limits, and connections bound to a replica id, whose
  last one closing without a leave is reported at once (a dead process is out within milliseconds).

A timer on the same loop ticks every ``quorum_tick`` seconds for what only time changes (the join
timeout, heartbeat expiry). The in-process calls (`report_failure`, `evict`, `status`, `snapshot`)
are thread-safe: the supervisor makes them from its own threads.
"""

from __future__ import annotations

import gc
import ipaddress
import logging
import math
import socket
from datetime import timedelta
from typing import Any

from ftlaunch import env
from ftlaunch.addresses import http_url, parse_host_port
from ftlaunch.env import FTLAUNCH_TOKEN, Duration
from ftlaunch.errors import ConfigurationError
from ftlaunch.lighthouse.membership import Membership
from ftlaunch.lighthouse.progress import GroupProgress, Rewind
from ftlaunch.lighthouse.protocol import MAX_BODY_BYTES
from ftlaunch.lighthouse.quorum import QUICK_HEARTBEAT_TIMEOUT, QuorumOptions
from ftlaunch.lighthouse.routes import Routes
from ftlaunch.lighthouse.status import LighthouseStatus, StragglersStatus
from ftlaunch.lighthouse.stragglers import REPORT, check_policy
from ftlaunch.lighthouse.transport import LISTEN_BACKLOG, HttpServer

log = logging.getLogger(__name__)

#: Time a client has to send a whole request (line, headers, body) once its first byte arrived.
REQUEST_READ_TIMEOUT = 10.0
#: Minimum time an idle keep-alive connection is kept open between requests (see `idle_timeout`).
MIN_IDLE_TIMEOUT = 120.0


#: Cyclic garbage collection in a lighthouse process (`collect_less`): the youngest generation is
#: collected per this many net allocations (Python's default: 700), the older ones as usual.
GC_THRESHOLDS = (20_000, 10, 10)


def collect_less() -> None:
    """Tune the cyclic garbage collector for a process that is a lighthouse (``ftlaunch-lighthouse``).

    Why: with 1024 groups a round makes thousands of short-lived objects (requests, tickets,
    answers) while ~2,000 connections and the imported modules stay; Python's defaults then ran a
    full collection, scanning all of them (~65 ms under load), every few rounds, and a young one
    every ~35 requests: ~10 % of the lighthouse's CPU, and its slowest rounds. What it allocates
    is freed by reference counting (no cycles on the request path), so the collector may run
    rarely: the objects alive at start are frozen out of every scan, and the youngest generation
    is collected per `GC_THRESHOLDS` allocations. Process-wide, so only for a process that does
    nothing else: the library's `LighthouseServer` leaves its host's collector alone.
    """
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class UnauthenticatedBindError(ConfigurationError):
    """A lighthouse without a job token was asked to serve on an address other machines can reach."""


def _listen(bind: str, host: str, port: int) -> socket.socket:
    """The listening socket for ``host:port``. The IPv6 wildcard (``[::]``, torchft's usual bind) is
    dual-stack where the system allows it, so v4 clients reach it too (the advertised host name often
    resolves to an IPv4 address)."""
    try:
        if ":" not in host:
            return socket.create_server((host, port), family=socket.AF_INET, backlog=LISTEN_BACKLOG)
        dualstack = host == "::" and socket.has_dualstack_ipv6()
        return socket.create_server(
            (host, port), family=socket.AF_INET6, backlog=LISTEN_BACKLOG, dualstack_ipv6=dualstack
        )
    except OSError as e:
        raise ConfigurationError(f"lighthouse: cannot bind {bind!r}: {e}") from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


#: Bounds of the timer period (``--quorum-tick``): every tick costs a little CPU even when idle
#: (~1.3 % of a core at 10 ms, ~5 % at 1 ms on a 2-core host), and what only time changes (a join
#: timeout, a silent group) is noticed up to a tick late.
QUORUM_TICK = Duration(0.01, 60.0)
#: Bounds of ``--startup-grace`` (0: none).
STARTUP_GRACE = Duration(0.0)


class LighthouseServer:
    """Quorum server. ``start()`` serves in a background thread; ``shutdown()`` stops everything."""

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        *,
        min_replicas: int = 1,
        join_timeout: float = 60.0,
        quorum_tick: float = 0.1,
        heartbeat_timeout: float = 5.0,
        token: str | None = None,
        expected_replicas: int = 0,
        startup_grace: float = 0.0,
        stragglers: str = REPORT,
    ) -> None:
        """``expected_replicas``: the groups the launcher starts; the first quorum waits for them
        (up to ``join_timeout``) instead of forming with whoever asks first (0: nobody announced).
        ``stragglers``: ``report`` slow groups, or also ``replace`` persistent ones
        (lighthouse/stragglers.py)."""
        try:
            self._options = QuorumOptions(
                min_replicas=min_replicas,
                join_timeout=join_timeout,
                heartbeat_timeout=heartbeat_timeout,
                expected_replicas=expected_replicas,
            )
        except (TypeError, ValueError) as e:
            raise ConfigurationError(f"lighthouse: {e}") from None
        if self._options.heartbeat_timeout < QUICK_HEARTBEAT_TIMEOUT:
            log.warning(
                "lighthouse: heartbeat_timeout=%gs leaves groups that beat every 0.1 s (the Manager's "
                "default) fewer than 5 beats: a late beat calls a healthy group silent. Lower their "
                "heartbeat_interval, or use %gs or more",
                self._options.heartbeat_timeout,
                QUICK_HEARTBEAT_TIMEOUT,
            )
        try:
            check_policy(stragglers)
        except ValueError as e:
            raise ConfigurationError(f"lighthouse: {e}") from None
        quorum_tick = QUORUM_TICK.checked(quorum_tick, "lighthouse: quorum_tick")
        startup_grace = STARTUP_GRACE.checked(startup_grace, "lighthouse: startup_grace")
        try:
            host, port = parse_host_port(bind, default_port=0)
        except ValueError as e:
            raise ConfigurationError(f"lighthouse: bad bind address: {e}") from None
        self._token = token or None
        sock = _listen(bind, host, port)
        bound_host, bound_port = sock.getsockname()[:2]
        if not self._token and not _is_loopback(bound_host):
            sock.close()
            raise UnauthenticatedBindError(
                f"lighthouse: refusing to serve on {bind!r} without a job token: anyone who reaches the port "
                f"could join, stop or poison the job. Pass --token (or set ${FTLAUNCH_TOKEN}; workers "
                "read the "
                "same variable), or bind 127.0.0.1 / [::1] (docs/security.md)"
            )
        if bound_host in ("0.0.0.0", "::", ""):
            bound_host = socket.gethostname()  # a wildcard is not connectable: advertise this host
        self._address = http_url(bound_host, bound_port)
        self._tick = float(quorum_tick)
        # startup_grace > 0 for a lighthouse started again for a running job (docs/lighthouse.md,
        # "When the lighthouse dies"): no first quorum before it unless the groups' reports arrive.
        self._membership = Membership(self._options, startup_grace=startup_grace, stragglers=stragglers)
        self._http = HttpServer(
            sock,
            Routes(self._membership, token=self._token, snapshot=self.snapshot),
            # An idle keep-alive connection (e.g. a heartbeat connection between beats) is closed
            # after this long: well above any sane heartbeat interval. Not counted as a death.
            idle_timeout=max(MIN_IDLE_TIMEOUT, 4 * self._options.heartbeat_timeout),
            read_timeout=REQUEST_READ_TIMEOUT,
            max_body=MAX_BODY_BYTES,
        )
        self._started = self._stopped = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> LighthouseServer:
        if self._started:
            raise RuntimeError("lighthouse already started")
        self._started = True
        self._http.start()
        self._http.call_every(self._tick, self._membership.tick)
        log.info(
            "lighthouse: serving on %s (min_replicas=%d join_timeout=%.3gs heartbeat_timeout=%.3gs "
            "tick=%.3gs "
            "stragglers=%s token=%s)",
            self._address,
            self._options.min_replicas,
            self._options.join_timeout,
            self._options.heartbeat_timeout,
            self._tick,
            self._membership.stragglers().policy,
            "required" if self._token else "none",
        )
        if not self._token:
            log.warning(
                "lighthouse: no job token: serving loopback only, and any process on this machine "
                "can act as a "
                "replica group; admin endpoints are disabled (pass --token or set $%s)",
                FTLAUNCH_TOKEN,
            )
        return self

    def shutdown(self) -> None:
        """Answer parked long polls with 503, stop serving, close every connection."""
        if self._stopped:
            return
        self._stopped = True
        self._membership.close()
        self._http.close()
        log.info("lighthouse: %s stopped", self._address)

    @property
    def serving(self) -> bool:
        """Started, not shut down, and its event-loop thread alive (the launcher restarts one that is not)."""
        return self._started and not self._stopped and self._http.running

    def __enter__(self) -> LighthouseServer:
        return self if self._started else self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def address(self) -> str:
        """``http://host:port`` clients connect to."""
        return self._address

    @property
    def options(self) -> QuorumOptions:
        return self._options

    @property
    def idle_timeout(self) -> float:
        """Seconds an idle keep-alive connection stays open: max(120 s, 4 x heartbeat_timeout)."""
        return self._http.idle_timeout

    @idle_timeout.setter
    def idle_timeout(self, seconds: float) -> None:
        self._http.idle_timeout = seconds

    @property
    def read_timeout(self) -> float:
        """Seconds a client has to send a whole request once its first byte arrived (10 s)."""
        return self._http.read_timeout

    @read_timeout.setter
    def read_timeout(self, seconds: float) -> None:
        self._http.read_timeout = seconds

    # ------------------------------------------------------------------ in-process operations

    def report_failure(self, replica_id: str, reason: str = "") -> None:
        """Mark a group failed at once (the supervisor saw it die). Unknown groups are only logged."""
        self._membership.report_failure(replica_id, reason or "reported failed")

    def evict(self, replica_id: str, reason: str = "") -> bool:
        """Drop a group; its next heartbeat/quorum request gets 410. False if the group is unknown."""
        return self._membership.evict(replica_id, reason or "evicted")

    def snapshot(self) -> LighthouseStatus:
        """Everything the lighthouse knows now, typed (``GET /status`` serves its JSON)."""
        return self._membership.snapshot(
            address=self._address,
            quorum_tick=self._tick,
            admin=self._token is not None,
            connections=self._http.bound_count,
        )

    def progress(self) -> tuple[GroupProgress, ...]:
        """Every group's training progress (what the launcher's status line and summary read)."""
        return self._membership.progress()

    def stragglers(self) -> StragglersStatus:
        """The slow groups and their replacements (what the launcher's notices and timeline read)."""
        return self._membership.stragglers()

    def rewinds(self) -> tuple[Rewind, ...]:
        """The times the job went back to an earlier step (lighthouse/progress.py, `Rewind`)."""
        return self._membership.rewinds()

    def status(self) -> dict[str, Any]:
        """The ``GET /status`` document (see docs/lighthouse.md)."""
        return self.snapshot().to_json()


def _ms(name: str, value: int | float | timedelta | None, default_s: float) -> float:
    """torchft's millisecond options in seconds (None: torchft's default; a timedelta is accepted too)."""
    if value is None:
        return default_s
    if isinstance(value, timedelta):
        return value.total_seconds()
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigurationError(f"lighthouse: {name} must be a number of milliseconds >= 0, got {value!r}")
    return value / 1000.0


class TorchftLighthouseServer:
    """torchft's form of the lighthouse (``torchft.coordination.LighthouseServer``), for scripts that port
    by changing the import: ``LighthouseServer(bind, min_replicas, join_timeout_ms=, quorum_tick_ms=,
    heartbeat_timeout_ms=)`` serves at once, ``address()`` is a method, ``shutdown()`` stops it.

    The same server as `LighthouseServer` underneath (which takes seconds, starts with ``start()`` and
    has an ``address`` property). One deliberate difference: the job token. ``token=`` (else
    ``$FTLAUNCH_TOKEN``) is required to bind anything but loopback -- torchft's lighthouse has no
    authentication (docs/security.md).
    """

    def __init__(
        self,
        bind: str,
        min_replicas: int,
        join_timeout_ms: int | None = None,
        quorum_tick_ms: int | None = None,
        heartbeat_timeout_ms: int | None = None,
        *,
        token: str | None = None,
    ) -> None:
        self._server = LighthouseServer(
            bind,
            min_replicas=min_replicas,
            join_timeout=_ms("join_timeout_ms", join_timeout_ms, 60.0),
            quorum_tick=_ms("quorum_tick_ms", quorum_tick_ms, 0.1),
            heartbeat_timeout=_ms("heartbeat_timeout_ms", heartbeat_timeout_ms, 5.0),
            token=token if token is not None else env.job_token(),
        ).start()

    def address(self) -> str:
        """``http://host:port`` clients connect to."""
        return self._server.address

    def shutdown(self) -> None:
        self._server.shutdown()

    @property
    def server(self) -> LighthouseServer:
        """ftlaunch's form of the same server (status, evict, report_failure)."""
        return self._server

    def __enter__(self) -> TorchftLighthouseServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
