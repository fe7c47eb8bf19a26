"""What a Manager is made of: its settings (`ManagerSettings`) and the collaborators built before it
(`ManagerParts`: the cross-group process group, the replica group's store, the heal transport, the
leader's lighthouse client, the user's state functions).

Why apart: two callers build them. ``ftlaunch.init`` has every value already (it read the
launcher's environment once) and builds the parts itself; torchft's long-form constructor
(``Manager(pg, load_state_dict, state_dict, ...)``) fills what it was not given from the environment
(`ftlaunch.worker.defaults.manager_parts`). Both hand the parts to `Manager.from_parts`. The
settings check themselves when made, so a bad value fails in one line before anything connects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftlaunch import env
from ftlaunch.checkpointing.transport import CheckpointTransport
from ftlaunch.errors import ConfigurationError
from ftlaunch.lighthouse.client import QuorumClient
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.timeouts import Timeouts
from ftlaunch.worker.group_store import GroupStore
from ftlaunch.worker.plan import WorldSizeMode

__all__ = ["HEARTBEAT_INTERVAL", "ManagerParts", "ManagerSettings", "check_knobs"]

#: The leader's heartbeat period: below 10 ms it would mostly send heartbeats, and a lighthouse's
#: heartbeat timeout is never under 50 ms (`ftlaunch.lighthouse.quorum.HEARTBEAT_TIMEOUT`).
HEARTBEAT_INTERVAL = env.Duration(0.01, 60.0)


def check_knobs(
    min_replica_size: int, max_retries: int | None, world_size_mode: WorldSizeMode, heartbeat_interval: float
) -> None:
    """The settings torch would only reject much later, or never (checked before any is derived
    from the environment, so that the error names the argument)."""
    if min_replica_size < 1:
        raise ValueError(f"min_replica_size must be >= 1, got {min_replica_size}")
    if max_retries is not None and max_retries < 0:
        raise ValueError(f"max_retries must be >= 0 or None, got {max_retries}")
    if not isinstance(world_size_mode, WorldSizeMode):
        raise TypeError(f"world_size_mode must be a WorldSizeMode, got {world_size_mode!r}")
    HEARTBEAT_INTERVAL.checked(heartbeat_interval, "heartbeat_interval")


@dataclass(frozen=True)
class ManagerSettings:
    """How one worker's Manager runs the per-step protocol (torchft's arguments, checked).

    ``min_replica_size``: the fewest up-to-date groups a step commits with. ``world_size_mode``:
    `WorldSizeMode.DYNAMIC` averages over every up-to-date group, ``FIXED_WITH_SPARES`` over exactly
    ``min_replica_size`` of them. ``use_async_quorum``: the quorum overlaps the forward pass.
    ``init_sync``: at step 0 every group heals from the primary. ``max_retries``: consecutive
    failed steps before the Manager raises (None: never). ``quorum_retries``: lighthouse errors a
    quorum request retries. ``worker_env``: what the user tuned through the environment.
    """

    replica_id: str
    group_rank: int
    group_world_size: int
    timeouts: Timeouts
    min_replica_size: int = 1
    world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC
    use_async_quorum: bool = True
    init_sync: bool = True
    max_retries: int | None = None
    quorum_retries: int = 0
    #: Seconds between the leader's heartbeats.
    heartbeat_interval: float = 0.1
    worker_env: env.WorkerEnv = field(default_factory=env.WorkerEnv)

    def __post_init__(self) -> None:
        check_knobs(self.min_replica_size, self.max_retries, self.world_size_mode, self.heartbeat_interval)
        if not 0 <= self.group_rank < self.group_world_size:
            raise ConfigurationError(f"rank {self.group_rank} is outside world_size {self.group_world_size}")

    @property
    def heal_claims(self) -> bool:
        return self.worker_env.heal_claims


@dataclass
class ManagerParts:
    """The collaborators a Manager is made from; the Manager owns them from then on (``shutdown``
    closes the client, the store's connection and the transport, and releases the process group).

    ``client``: the group leader's (rank 0's) lighthouse client, None on the other ranks.
    ``load_state_dict``/``state_dict``: what travels with a heal (both or neither; more with
    `Manager.register_state_dict_fn`).
    """

    settings: ManagerSettings
    pg: ProcessGroup
    group: GroupStore
    transport: CheckpointTransport[Any]
    client: QuorumClient | None
    load_state_dict: Callable[[Any], None] | None = None
    state_dict: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        if (self.load_state_dict is None) != (self.state_dict is None):
            raise ValueError("pass both load_state_dict and state_dict, or neither")
        if (self.client is not None) != (self.settings.group_rank == 0):
            raise ValueError("the group leader (rank 0), and only it, needs a lighthouse client")
