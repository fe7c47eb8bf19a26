"""torchft-compatible defaults: what a Manager that was not given them reads from the environment.

torchft's Manager finds its replica group, rank and lighthouse in the environment when they are
not passed, and scripts ported from torchft rely on it. Those reads live here, and so does the
long form's factory (`manager_parts`: torchft's arguments in, `ManagerParts` out), so the Manager
itself works only with explicit values and collaborators (``ftlaunch.init`` builds every one).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ftlaunch import env
from ftlaunch.addresses import parse_host_port, reachable_address
from ftlaunch.checkpointing.transport import CheckpointTransport
from ftlaunch.errors import ConfigurationError, install_brief_errors
from ftlaunch.lighthouse.client import LighthouseClient, QuorumClient
from ftlaunch.lighthouse.reconnect import OutageTolerantClient
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.timeouts import Timeouts, to_seconds
from ftlaunch.worker.group_store import GroupStore
from ftlaunch.worker.manager_parts import ManagerParts, ManagerSettings, check_knobs
from ftlaunch.worker.plan import WorldSizeMode

_Seconds = timedelta | float | None


def _timeouts(
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


def _replica_id() -> str:
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
    install_brief_errors(env.error_file(), env.rendezvous_error_file())  # a bad value: one line
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


def _worker_env() -> env.WorkerEnv:
    """What the user tuned through the environment (``ftlaunch.init`` reads it once and passes it)."""
    install_brief_errors(env.error_file(), env.rendezvous_error_file())  # a bad value: one line
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


def manager_parts(
    pg: ProcessGroup,
    load_state_dict: Callable[[Any], None] | None,
    state_dict: Callable[[], Any] | None,
    min_replica_size: int = 1,
    use_async_quorum: bool = True,
    timeout: _Seconds = None,
    quorum_timeout: _Seconds = None,
    connect_timeout: _Seconds = None,
    rank: int | None = None,
    world_size: int | None = None,
    world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
    store_addr: str | None = None,
    store_port: int | None = None,
    lighthouse_addr: str | None = None,
    replica_id: str | None = None,
    port: int | None = None,
    hostname: str | None = None,
    heartbeat_interval: timedelta | float = timedelta(milliseconds=100),
    checkpoint_transport: CheckpointTransport[Any] | None = None,
    init_sync: bool = True,
    max_retries: int | None = None,
    quorum_retries: int = 0,
    token: str | None = None,
    heal_timeout: _Seconds = None,
    commit_timeout: _Seconds = None,
    timeouts: Timeouts | None = None,
    quorum_client: QuorumClient | None = None,
    group_store: dist.Store | None = None,
    worker_env: env.WorkerEnv | None = None,
) -> ManagerParts:
    """torchft's long-form constructor (`ftlaunch.Manager`'s arguments, documented there): what is
    not given comes from the environment. Checks come before anything connects, and a missing
    lighthouse address is raised before a store or a transport is left behind."""
    interval = to_seconds(heartbeat_interval, "heartbeat_interval")
    check_knobs(min_replica_size, max_retries, world_size_mode, interval)
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    if (load_state_dict is None) != (state_dict is None):
        raise ValueError("pass both load_state_dict and state_dict, or neither")
    derived = _timeouts(
        timeouts,
        timeout,
        quorum=quorum_timeout,
        connect=connect_timeout,
        heal=heal_timeout,
        commit=commit_timeout,
    )
    group = group_env()
    settings = ManagerSettings(
        replica_id=_replica_id() if replica_id is None else replica_id,
        group_rank=group.rank if rank is None else rank,
        group_world_size=group.world_size if world_size is None else world_size,
        timeouts=derived,
        min_replica_size=min_replica_size,
        world_size_mode=world_size_mode,
        use_async_quorum=use_async_quorum,
        init_sync=init_sync,
        max_retries=max_retries,
        quorum_retries=quorum_retries,
        heartbeat_interval=interval,
        worker_env=_worker_env() if worker_env is None else worker_env,
    )
    client = None
    if settings.group_rank == 0:  # only the leader talks to the lighthouse
        client = quorum_client or lighthouse_client(
            lighthouse_addr, token, derived.connect, settings.worker_env.lighthouse_outage
        )
    store = GroupStore.open(
        group_store,
        store_addr if store_addr is not None else group.master_addr,
        store_port if store_port is not None else group.master_port,
        replica_id=settings.replica_id,
        attempt=group.incarnation,
        rank=settings.group_rank,
        world_size=settings.group_world_size,
        hostname=hostname or local_addr(lighthouse_addr),
        timeouts=derived,
        leader_outage=settings.worker_env.lighthouse_outage,
    )
    if checkpoint_transport is None:
        from ftlaunch.checkpointing import HTTPTransport

        checkpoint_transport = HTTPTransport(
            timeout=derived.as_timedelta("heal"), bind=local_addr(lighthouse_addr) or "127.0.0.1"
        )
    return ManagerParts(settings, pg, store, checkpoint_transport, client, load_state_dict, state_dict)
