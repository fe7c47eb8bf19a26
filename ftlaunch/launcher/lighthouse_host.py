"""The launcher's one way to host a lighthouse, or to use one that runs elsewhere.

Three launch paths may need a lighthouse beside the groups: the ``ftlaunch`` supervisor, the
rendezvous handler on the endpoint host (``torchrun --rdzv-backend ftlaunch``) and the torchx
``lighthouse`` role. All three host it through `HostedLighthouse` (start, address, stop, linger).
``ftlaunch --lighthouse ADDR`` uses a lighthouse that runs elsewhere through `RemoteLighthouse`, which
has the same surface (`JobLighthouse`), so the supervisor does not care which one it has.

The launcher reads the lighthouse's status only here, typed (`JobLighthouse.snapshot`, a
`ftlaunch.lighthouse.status.LighthouseStatus`; `quorum_id`, `live_groups`) and the groups' training
progress (`progress`: what their leaders report, so it is right for a script that prints nothing).

A hosted lighthouse lives in this process: it is a single point of failure for the job (see
docs/lighthouse.md, *When the lighthouse dies*). `HostedLighthouse.restart` brings one back on the
same address (the supervisor calls it when the lighthouse stopped serving, and ``--chaos
lighthouse=`` to rehearse it); the groups wait for it and resume with a quorum of all of them.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ftlaunch import env
from ftlaunch.errors import FtlaunchError, LighthouseError
from ftlaunch.lighthouse.health import FAILING as HEALTH_FAILED
from ftlaunch.lighthouse.progress import GroupProgress, Rewind
from ftlaunch.lighthouse.status import HistoryEvent, LighthouseStatus, StragglersStatus

if TYPE_CHECKING:
    from ftlaunch.lighthouse.client import LighthouseClient
    from ftlaunch.lighthouse.server import LighthouseServer

logger = logging.getLogger(__name__)

#: How often a lingering lighthouse looks whether groups still use it.
_LINGER_POLL_S = 0.2
#: How long a restart retries binding the same port (a socket of the old one may still hold it).
_REBIND_S = 10.0


@dataclass(frozen=True)
class LighthouseSettings:
    """How to run a lighthouse the launcher hosts: where it listens, its quorum options, its token."""

    bind: str = "127.0.0.1:0"
    min_replicas: int = 1
    join_timeout: float = 60.0
    heartbeat_timeout: float = 5.0
    #: Replica groups the launcher starts: the first quorum waits for them (0: not announced).
    expected_replicas: int = 0
    #: Job token required by the admin endpoints (None: they are disabled).
    token: str | None = None
    #: Slow groups: ``report`` them, or also ``replace`` persistent ones (lighthouse/stragglers.py).
    stragglers: str = "report"


class JobLighthouse(abc.ABC):
    """The lighthouse of a job, as the launcher uses it, wherever it runs."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """``http://host:port`` the groups connect to."""

    @abc.abstractmethod
    def snapshot(self) -> LighthouseStatus:
        """The lighthouse's status. Raises `LighthouseError` or `OSError` if it cannot be read."""

    @abc.abstractmethod
    def report_failure(self, replica_id: str, reason: str) -> None:
        """Take ``replica_id`` out of the quorum at once. Raises `LighthouseError` or `OSError`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release it (a hosted lighthouse stops serving). Never raises."""

    def status(self) -> dict[str, Any]:
        """The same as JSON: the ``GET /status`` document (docs/lighthouse.md)."""
        return self.snapshot().to_json()

    # --- what the launcher reads from the status (informational: never raises) ------------------

    def quorum_id(self) -> int | None:
        """The current quorum id, or None (no quorum yet, or the lighthouse cannot be read)."""
        return self._snapshot_or_empty().quorum_id

    def live_groups(self) -> int:
        """How many replica groups the lighthouse reports as live (0 if it cannot be read)."""
        return self._snapshot_or_empty().live_count

    def progress(self) -> tuple[GroupProgress, ...] | None:
        """Every group's training progress as the group leaders reported it (steps committed, heals,
        timings, final checksums), or None when the lighthouse cannot be read."""
        try:
            return self._progress()
        except Exception:  # noqa: BLE001 - informational: the caller keeps what it read last
            return None

    def _progress(self) -> tuple[GroupProgress, ...]:
        return self.snapshot().progress

    def stragglers(self) -> StragglersStatus | None:
        """The slow groups the lighthouse found and replaced, or None when it cannot be read (or
        judges none: an older lighthouse)."""
        try:
            return self._stragglers()
        except Exception:  # noqa: BLE001 - informational: the caller reads it again later
            return None

    def _stragglers(self) -> StragglersStatus | None:
        return self.snapshot().stragglers

    def health_failures(self) -> tuple[HistoryEvent, ...] | None:
        """Each time a group's health check began failing (the history's ``health_failed`` events,
        oldest first), or None when the lighthouse cannot be read."""
        try:
            history = self.snapshot().history
        except Exception:  # noqa: BLE001 - informational: the caller reads it again later
            return None
        return tuple(sorted((h for h in history if h.event == HEALTH_FAILED), key=lambda h: h.time))

    def rewinds(self) -> tuple[Rewind, ...] | None:
        """The times the job went back to an earlier step because no group holding its state was
        left (`Rewind`), or None when the lighthouse cannot be read."""
        try:
            return self._rewinds()
        except Exception:  # noqa: BLE001 - informational: the caller keeps what it read last
            return None

    def _rewinds(self) -> tuple[Rewind, ...]:
        return self.snapshot().rewinds

    def _snapshot_or_empty(self) -> LighthouseStatus:
        try:
            return self.snapshot()
        except Exception:  # noqa: BLE001 - status is informational; a broken one reads as empty
            return LighthouseStatus()


class HostedLighthouse(JobLighthouse):
    """A lighthouse served from this process (background threads) until `stop`."""

    def __init__(self, server: LighthouseServer, settings: LighthouseSettings | None = None) -> None:
        self._server: LighthouseServer | None = server
        self._address = server.address
        self._settings = settings or LighthouseSettings()
        self._crashed = False  # `crash` stopped it; `restart` may bring it back
        #: How many times `restart` brought it back.
        self.restarts = 0

    @classmethod
    def start(cls, settings: LighthouseSettings, *, restarted: bool = False) -> HostedLighthouse:
        """Bind ``settings.bind`` and serve (``restarted``: for a job already running, see `restart`).

        Raises `ConfigurationError` when the address cannot be bound (e.g. the port is in use) or an
        option is invalid.
        """
        return cls(_new_server(settings, settings.bind, restarted=restarted).start(), settings)

    @property
    def address(self) -> str:
        return self._address

    # --- when it dies: the single point of failure and its remedy -------------------------------

    @property
    def serving(self) -> bool:
        """Whether it answers: started, not stopped, its event loop alive."""
        return self._server is not None and self._server.serving

    @property
    def needs_restart(self) -> bool:
        """It stopped serving without `stop` (a crash, or `crash`): `restart` it."""
        return (self._server is not None or self._crashed) and not self.serving

    def crash(self) -> None:
        """Stop serving at once, as a crash would, but so that `restart` may bring it back (chaos)."""
        if self._server is None:
            return
        server, self._server = self._server, None
        self._crashed = True
        with contextlib.suppress(Exception):
            server.shutdown()

    def restart(self) -> None:
        """Serve again on the same address with empty bookkeeping; the groups report their last
        quorum to it (ftlaunch.lighthouse.reconnect) and resume. Retries the bind for a few seconds.
        Raises `ConfigurationError` if the port cannot be bound again."""
        from ftlaunch.errors import ConfigurationError

        old, self._server = self._server, None
        if old is not None:
            with contextlib.suppress(Exception):
                old.shutdown()
        split = urlsplit(self._address)
        host = _bind_host(self._settings.bind, split.hostname or "127.0.0.1")
        bind = f"[{host}]:{split.port}" if ":" in host else f"{host}:{split.port}"
        deadline = time.monotonic() + _REBIND_S
        while True:
            try:
                self._server = _new_server(self._settings, bind, restarted=True).start()
                break
            except ConfigurationError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self._crashed = False
        self.restarts += 1
        logger.warning("lighthouse: restarted on %s (restart %d)", self._address, self.restarts)

    def snapshot(self) -> LighthouseStatus:
        return self._running().snapshot()

    def report_failure(self, replica_id: str, reason: str) -> None:
        self._running().report_failure(replica_id, reason)

    def _progress(self) -> tuple[GroupProgress, ...]:
        return self._running().progress()  # in process, without building the whole status

    def _stragglers(self) -> StragglersStatus | None:
        return self._running().stragglers()

    def _rewinds(self) -> tuple[Rewind, ...]:
        return self._running().rewinds()

    def stop(self, linger: float = 0.0) -> None:
        """Stop serving; idempotent.

        With ``linger`` > 0, first keep serving while any group is still live, at most ``linger``
        seconds: a lighthouse hosted by one group's agent must not vanish under the others.
        """
        self._crashed = False
        if self._server is None:
            return
        deadline = time.monotonic() + linger
        while time.monotonic() < deadline and self.live_groups() > 0:
            time.sleep(_LINGER_POLL_S)
        server, self._server = self._server, None
        with contextlib.suppress(Exception):
            server.shutdown()

    def close(self) -> None:
        self.stop()

    def _running(self) -> LighthouseServer:
        if self._server is None:
            raise LighthouseError(f"the lighthouse at {self._address} was stopped")
        return self._server


def _new_server(settings: LighthouseSettings, bind: str, *, restarted: bool = False) -> LighthouseServer:
    from ftlaunch.lighthouse.server import LighthouseServer

    return LighthouseServer(
        bind,
        min_replicas=settings.min_replicas,
        join_timeout=settings.join_timeout,
        heartbeat_timeout=settings.heartbeat_timeout,
        token=settings.token,
        # A restarted lighthouse waits (at most a heartbeat timeout) for the groups that hold the
        # job's state to report, before a freshly started group could form a quorum of its own.
        startup_grace=settings.heartbeat_timeout if restarted else 0.0,
        # The first quorum of the job waits for the groups the launcher starts; a restarted
        # lighthouse instead takes the groups' resume reports (their last quorum).
        expected_replicas=0 if restarted else settings.expected_replicas,
        stragglers=settings.stragglers,
    )


def _bind_host(bind: str, served_host: str) -> str:
    """The host to bind again: the configured one (a wildcard stays a wildcard), else the served one."""
    from ftlaunch.addresses import parse_host_port

    try:
        host, _ = parse_host_port(bind, default_port=0)
    except ValueError:
        return served_host
    return host or served_host


class RemoteLighthouse(JobLighthouse):
    """A lighthouse that runs elsewhere (``ftlaunch --lighthouse``, ``ftlaunch-lighthouse``)."""

    def __init__(self, client: LighthouseClient) -> None:
        self._client = client

    @classmethod
    def connect(cls, address: str, *, token: str | None = None, timeout: float = 5.0) -> RemoteLighthouse:
        """A lighthouse known to answer at ``address``.

        Raises `ValueError` for a malformed address and `LighthouseError` or `OSError` when nothing
        answers within ``timeout`` seconds.
        """
        from ftlaunch.lighthouse.client import LighthouseClient

        client = LighthouseClient(address, connect_timeout=timeout, token=token)
        try:
            client.status()
        except BaseException:
            client.close()
            raise
        return cls(client)

    @staticmethod
    def answers(address: str, timeout: float = 1.0) -> bool:
        """True when a lighthouse answers a status request at ``address`` within ``timeout``."""
        try:
            RemoteLighthouse.connect(address, timeout=timeout).close()
        except (LighthouseError, OSError, ValueError):
            return False
        return True

    @property
    def address(self) -> str:
        return self._client.address

    def snapshot(self) -> LighthouseStatus:
        return self._client.snapshot()

    def report_failure(self, replica_id: str, reason: str) -> None:
        self._client.report_failure(replica_id, reason)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()


class LaunchError(FtlaunchError):
    """The job could not start (lighthouse, ports, ...): reported as one line, exit code 2."""


def open_job_lighthouse(address: str | None, settings: LighthouseSettings) -> JobLighthouse:
    """``ftlaunch``'s lighthouse: the one at ``address`` (``--lighthouse``), else one hosted here with
    ``settings``. Raises `LaunchError` with the line to print when neither works."""
    if address:
        try:
            return RemoteLighthouse.connect(address, token=settings.token, timeout=5.0)
        except ValueError as e:
            raise LaunchError(f"--lighthouse {address!r}: {e}") from None
        except (LighthouseError, OSError) as e:
            addr = env.normalize_lighthouse(address, "--lighthouse")
            raise LaunchError(f"no lighthouse answers at {addr} ({type(e).__name__}: {e})") from None
    try:
        return HostedLighthouse.start(settings)
    except (OSError, ValueError) as e:  # ConfigurationError: the address is taken or invalid
        raise LaunchError(f"cannot start the lighthouse on {settings.bind}: {e}") from None
