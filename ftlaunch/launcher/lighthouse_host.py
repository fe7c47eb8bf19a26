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
docs/launcher.md). Restarting one the launcher hosts, on the same address, belongs to
`HostedLighthouse` as well.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ftlaunch.errors import LighthouseError
from ftlaunch.lighthouse.progress import GroupProgress
from ftlaunch.lighthouse.status import LighthouseStatus

if TYPE_CHECKING:
    from ftlaunch.lighthouse.client import LighthouseClient
    from ftlaunch.lighthouse.server import LighthouseServer

logger = logging.getLogger(__name__)

#: How often a lingering lighthouse looks whether groups still use it.
_LINGER_POLL_S = 0.2


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

    def _snapshot_or_empty(self) -> LighthouseStatus:
        try:
            return self.snapshot()
        except Exception:  # noqa: BLE001 - status is informational; a broken one reads as empty
            return LighthouseStatus()


class HostedLighthouse(JobLighthouse):
    """A lighthouse served from this process (background threads) until `stop`."""

    def __init__(self, server: LighthouseServer) -> None:
        self._server: LighthouseServer | None = server
        self._address = server.address

    @classmethod
    def start(cls, settings: LighthouseSettings) -> HostedLighthouse:
        """Bind ``settings.bind`` and serve.

        Raises `ConfigurationError` when the address cannot be bound (e.g. the port is in use) or an
        option is invalid.
        """
        from ftlaunch.lighthouse.server import LighthouseServer

        server = LighthouseServer(
            settings.bind,
            min_replicas=settings.min_replicas,
            join_timeout=settings.join_timeout,
            heartbeat_timeout=settings.heartbeat_timeout,
            token=settings.token,
            expected_replicas=settings.expected_replicas,
        )
        return cls(server.start())

    @property
    def address(self) -> str:
        return self._address

    def snapshot(self) -> LighthouseStatus:
        return self._running().snapshot()

    def report_failure(self, replica_id: str, reason: str) -> None:
        self._running().report_failure(replica_id, reason)

    def _progress(self) -> tuple[GroupProgress, ...]:
        return self._running().progress()  # in process, without building the whole status

    def stop(self, linger: float = 0.0) -> None:
        """Stop serving; idempotent.

        With ``linger`` > 0, first keep serving while any group is still live, at most ``linger``
        seconds: a lighthouse hosted by one group's agent must not vanish under the others.
        """
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
