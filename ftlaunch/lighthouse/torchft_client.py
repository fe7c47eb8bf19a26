"""torchft's form of the lighthouse client (``torchft.coordination.LighthouseClient``).

A script or test written against torchft's coordination API asks for a quorum with keyword fields
(``client.quorum(replica_id=..., timeout=timedelta(...), step=..., data=...)``) and heartbeats by
replica id; this class speaks that form over ftlaunch's own `LighthouseClient`, so such code ports
by changing the import. Durations are ``timedelta`` as in torchft. The job token comes from
``token=`` or ``$FTLAUNCH_TOKEN``, as for every ftlaunch client.
"""

from __future__ import annotations

from datetime import timedelta

from ftlaunch import env
from ftlaunch.lighthouse.client import LighthouseClient
from ftlaunch.lighthouse.quorum import Quorum, QuorumMember

__all__ = ["TorchftLighthouseClient"]


def _seconds(name: str, value: timedelta | float) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return seconds


class TorchftLighthouseClient:
    """``LighthouseClient(addr, connect_timeout)`` with torchft's ``quorum``/``heartbeat`` calls."""

    def __init__(
        self,
        addr: str,
        connect_timeout: timedelta | float = timedelta(seconds=10),
        *,
        token: str | None = None,
    ) -> None:
        self.addr = addr
        self.connect_timeout = connect_timeout
        self._client = LighthouseClient(
            addr,
            connect_timeout=_seconds("connect_timeout", connect_timeout),
            token=token if token is not None else env.job_token(),
        )

    def quorum(
        self,
        replica_id: str,
        timeout: timedelta | float,
        address: str | None = None,
        store_address: str | None = None,
        step: int | None = None,
        world_size: int | None = None,
        shrink_only: bool | None = None,
        data: dict | None = None,
    ) -> Quorum:
        """Join the next quorum and block until it forms (torchft's defaults for omitted fields)."""
        member = QuorumMember(
            replica_id=replica_id,
            address=address or "",
            store_address=store_address or "",
            step=step or 0,
            world_size=world_size or 1,  # torchft sends 0 for "not given"; a group has >= 1 rank
            shrink_only=bool(shrink_only),
            data=dict(data) if data else {},
        )
        return self._client.quorum(member, _seconds("timeout", timeout))

    def heartbeat(self, replica_id: str, timeout: timedelta | float = timedelta(seconds=5)) -> None:
        """Tell the lighthouse ``replica_id`` is alive (``timeout`` bounds the connection)."""
        _seconds("timeout", timeout)
        self._client.heartbeat(replica_id)

    @property
    def client(self) -> LighthouseClient:
        """ftlaunch's form of the same client (status, leave, report_failure)."""
        return self._client

    def close(self) -> None:
        self._client.close()
