"""torchft-compatible defaults: what a Manager that was not given them reads from the environment.

torchft's Manager finds its replica group, rank and lighthouse in the environment when they are
not passed, and scripts ported from torchft rely on it. Those reads live here, so the Manager
itself works only with explicit values (``ftlaunch.init`` passes every one of them).
"""

from __future__ import annotations

from datetime import timedelta

from ftlaunch import env
from ftlaunch.addresses import parse_host_port, reachable_address
from ftlaunch.errors import ConfigurationError, install_brief_errors
from ftlaunch.lighthouse.client import LighthouseClient, QuorumClient
from ftlaunch.lighthouse.reconnect import OutageTolerantClient
from ftlaunch.timeouts import Timeouts, to_seconds
from ftlaunch.worker.plan import WorldSizeMode

_Seconds = timedelta | float | None


#: The leader's heartbeat period: below 10 ms it would mostly send heartbeats, and a lighthouse's
#: heartbeat timeout is never under 0.5 s (`ftlaunch.lighthouse.quorum.HEARTBEAT_TIMEOUT`).
HEARTBEAT_INTERVAL = env.Duration(0.01, 60.0)


def check_arguments(
    min_replica_size: int,
    max_retries: int | None,
    world_size_mode: WorldSizeMode,
    port: int | None,
    heartbeat_interval: timedelta | float = 0.1,
) -> None:
    """The Manager's arguments that torch would only reject much later, or never."""
    if min_replica_size < 1:
        raise ValueError(f"min_replica_size must be >= 1, got {min_replica_size}")
    if max_retries is not None and max_retries < 0:
        raise ValueError(f"max_retries must be >= 0 or None, got {max_retries}")
    if not isinstance(world_size_mode, WorldSizeMode):
        raise TypeError(f"world_size_mode must be a WorldSizeMode, got {world_size_mode!r}")
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    HEARTBEAT_INTERVAL.checked(to_seconds(heartbeat_interval, "heartbeat_interval"), "heartbeat_interval")


def timeouts(
    given: Timeouts | None,
    timeout: _Seconds,
    *,
    quorum: _Seconds,
    connect: _Seconds,
    heal: _Seconds,
    commit: _Seconds,
) -> Timeouts:
    """``given``, or the set derived from the one knob ``timeout`` (else ``FTLAUNCH_TIMEOUT``) and
    the explicit overrides; passing both is a ValueError."""
    if given is None:
        return Timeouts.derive(timeout, quorum=quorum, connect=connect, heal=heal, commit=commit)
    if any(t is not None for t in (timeout, quorum, connect, heal, commit)):
        raise ValueError("pass either timeouts= or the individual timeouts, not both")
    return given


def replica_id() -> str:
    """This worker's replica id from ``REPLICA_GROUP_ID``; `ConfigurationError` naming the fix."""
    group = env.count(env.REPLICA_GROUP_ID)
    if group is None:
        raise ConfigurationError(
            f"no replica_id given and {env.REPLICA_GROUP_ID} is not set: launch with "
            "`ftlaunch --replicas N script.py` or pass replica_id="
        )
    return env.replica_id(group)


def group_env() -> env.GroupEnv:
    """Rank, size, store and restart count of this worker's replica group, as torchelastic set them."""
    install_brief_errors()  # a bad value reads as one line, not a traceback
    return env.GroupEnv.from_environ()


def local_addr(lighthouse_addr: str | None = None) -> str | None:
    """This node's address for the job's other hosts: ``FTLAUNCH_LOCAL_ADDR`` (the launcher's
    choice), else the local address of the route to the lighthouse (``lighthouse_addr``, else
    ``FTLAUNCH_LIGHTHOUSE``; `ftlaunch.addresses.reachable_address`). None without either."""
    chosen = env.local_addr()
    if chosen:
        return chosen
    addr = lighthouse_addr or env.lighthouse_address()
    if not addr:
        return None
    try:
        host, _ = parse_host_port(addr)
    except ValueError:
        return None  # the lighthouse client reports the malformed address
    return reachable_address(host)


def worker_env() -> env.WorkerEnv:
    """What the user tuned through the environment (``ftlaunch.init`` reads it once and passes it)."""
    install_brief_errors()  # a bad value reads as one line, not a traceback
    return env.WorkerEnv.from_environ()


def lighthouse_client(
    addr: str | None, token: str | None, connect_timeout: float, outage_timeout: float
) -> QuorumClient:
    """A client of the lighthouse at ``addr`` (else ``FTLAUNCH_LIGHTHOUSE``), with the job token
    ``token`` (else ``FTLAUNCH_TOKEN``), that waits out a lighthouse outage of up to
    ``outage_timeout`` seconds."""
    what = "lighthouse_addr" if addr else env.FTLAUNCH_LIGHTHOUSE
    addr = addr or env.lighthouse_address()
    if not addr:
        raise ConfigurationError(
            f"no lighthouse address: pass lighthouse_addr= or set {env.FTLAUNCH_LIGHTHOUSE} "
            "(the `ftlaunch` launcher sets it for you)"
        )
    addr = env.normalize_lighthouse(addr, what)
    client = LighthouseClient(addr, connect_timeout=connect_timeout, token=token or env.job_token())
    # A worker torchelastic restarted, or one whose launcher reached the lighthouse (a respawned
    # agent's), belongs to a job that reached its lighthouse: an unreachable one is an outage to
    # wait out even before its first answer.
    reached = (env.count(env.TORCHELASTIC_RESTART_COUNT, 0) or 0) > 0 or env.lighthouse_reached()
    return OutageTolerantClient(client, outage_timeout, known_reachable=reached)
