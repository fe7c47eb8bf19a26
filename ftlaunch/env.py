"""Every environment variable ftlaunch reads or writes, and the launcher->worker contract.

The launcher, the rendezvous handler and the torchx components *publish* a `JobEnv` to workers
(`JobEnv.to_environ`, the single writer); ``ftlaunch.init`` *reads* it once (`JobEnv.from_environ`,
the single parser, with the error hints) and hands explicit values to the Manager and the sampler.
Keeping the names here means the README table, the writers and the readers cannot drift apart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# --- set by torchrun / torchelastic inside every worker (we set the same ones) -------------------
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
#: Slurm's count of requeues of this job (set in every task of a requeued job).
SLURM_RESTART_COUNT = "SLURM_RESTART_COUNT"
#: Gloo's own choice of interface (torch reads it; ftlaunch then leaves Gloo's address to it).
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"

# --- ftlaunch's own ------------------------------------------------------------------------------
#: Id of this worker's replica group (0..N-1). Same name as torchft's so scripts port unchanged.
REPLICA_GROUP_ID = "REPLICA_GROUP_ID"
#: Number of replica groups the job was started with.
NUM_REPLICA_GROUPS = "NUM_REPLICA_GROUPS"
#: Lighthouse address, ``http://host:port``.
FTLAUNCH_LIGHTHOUSE = "FTLAUNCH_LIGHTHOUSE"
#: torchft's name for the lighthouse address; accepted as a fallback.
TORCHFT_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
#: Hot spares of the job (``ftlaunch --spares K``): when > 0, every group claims a replica-group slot
#: from the lighthouse before it builds its Manager; groups ``NUM_REPLICA_GROUPS``.. start as spares.
FTLAUNCH_SPARES = "FTLAUNCH_SPARES"
#: Job token: required by the lighthouse's admin endpoints (evict, report failure).
FTLAUNCH_TOKEN = "FTLAUNCH_TOKEN"
#: Address the lighthouse binds when the launcher/rendezvous starts one (default loopback).
FTLAUNCH_LIGHTHOUSE_BIND = "FTLAUNCH_LIGHTHOUSE_BIND"
#: The address of this node that the job's other hosts reach its replica group on: the group's
#: store, its state transport and its Gloo connections are published under it. Set by the
#: rendezvous for the workers (torchrun's ``--local-addr``, else the local address of the route to
#: the lighthouse; loopback only when the lighthouse is addressed as loopback); set it yourself to
#: pick an interface. Unset, a worker derives it from the lighthouse address the same way.
FTLAUNCH_LOCAL_ADDR = "FTLAUNCH_LOCAL_ADDR"
#: Incarnation of this replica group's workers, the same on every node of the group: the count of
#: the group's rendezvous rounds before this one (set by the rendezvous). torchelastic's
#: ``TORCHELASTIC_RESTART_COUNT`` counts only the restarts of *this node's* agent, so it differs
#: between the nodes of a group after one of them restarted; it is the fallback outside ftlaunch.
FTLAUNCH_GROUP_INCARNATION = "FTLAUNCH_GROUP_INCARNATION"
#: Cross-group process group built by ``ftlaunch.init()``: baby-gloo, baby-nccl, gloo or nccl.
FTLAUNCH_BACKEND = "FTLAUNCH_BACKEND"
#: Live-recovery transport built by ``ftlaunch.init()``: pg or http.
FTLAUNCH_TRANSPORT = "FTLAUNCH_TRANSPORT"
#: The one timeout knob (seconds); the others derive from it (``ftlaunch.timeouts``).
FTLAUNCH_TIMEOUT = "FTLAUNCH_TIMEOUT"
#: Explicit overrides of the derived timeouts (validated together; see docs/timeouts.md).
FTLAUNCH_COLLECTIVE_TIMEOUT = "FTLAUNCH_COLLECTIVE_TIMEOUT"
FTLAUNCH_HEAL_TIMEOUT = "FTLAUNCH_HEAL_TIMEOUT"
FTLAUNCH_COMMIT_TIMEOUT = "FTLAUNCH_COMMIT_TIMEOUT"
FTLAUNCH_QUORUM_TIMEOUT = "FTLAUNCH_QUORUM_TIMEOUT"
FTLAUNCH_CONNECT_TIMEOUT = "FTLAUNCH_CONNECT_TIMEOUT"
#: How long a group leader waits for an unreachable lighthouse to come back before it gives up
#: (a duration, default 300 s; 0: give up after the connect timeout). ``ftlaunch.lighthouse.reconnect``.
FTLAUNCH_LIGHTHOUSE_OUTAGE = "FTLAUNCH_LIGHTHOUSE_OUTAGE"
#: Set to ``1`` by a launcher that has reached the job's lighthouse (the ``ftlaunch`` supervisor, the
#: rendezvous once it found it): a worker's -- or a respawned agent's -- failed first contact is then
#: an outage to wait out for ``FTLAUNCH_LIGHTHOUSE_OUTAGE``, not a wrong address to report at once.
FTLAUNCH_LIGHTHOUSE_REACHED = "FTLAUNCH_LIGHTHOUSE_REACHED"
#: ``0`` turns off stepping on the last quorum while the lighthouse is unreachable (the groups then
#: wait for it, committing nothing). Default on. ``ftlaunch.worker.outage``.
FTLAUNCH_OUTAGE_STEPS = "FTLAUNCH_OUTAGE_STEPS"
#: A group leader whose training thread made no step call for this long (a duration, default 1.5x the
#: collective timeout; 0: off) leaves the lighthouse until it steps again. ``ftlaunch.worker.watchdog``.
FTLAUNCH_PROGRESS_TIMEOUT = "FTLAUNCH_PROGRESS_TIMEOUT"
#: ``0`` turns heal claims off (``ftlaunch.worker.plan``: a checksum of the state each up-to-date
#: group would offer, taken every step; healers copy only from groups whose claims agree). Set it
#: job-wide: while some groups claim, a group that does not serves nobody.
FTLAUNCH_HEAL_CLAIMS = "FTLAUNCH_HEAL_CLAIMS"
#: Defaults of ``ft.diloco()`` / ``ft.local_sgd()`` for what the script does not pass (set by the
#: torchx component ``ftlaunch:diloco``): inner steps per sync, fragments, overlap steps (tau),
#: mixing alpha, and pseudo-gradient bits (0: full precision, 8 or 4).
FTLAUNCH_SYNC_EVERY = "FTLAUNCH_SYNC_EVERY"
FTLAUNCH_FRAGMENTS = "FTLAUNCH_FRAGMENTS"
FTLAUNCH_FRAGMENT_SYNC_DELAY = "FTLAUNCH_FRAGMENT_SYNC_DELAY"
FTLAUNCH_FRAGMENT_UPDATE_ALPHA = "FTLAUNCH_FRAGMENT_UPDATE_ALPHA"
FTLAUNCH_QUANTIZE = "FTLAUNCH_QUANTIZE"
#: Opt-in start-up phase log (`ftlaunch.phases`): a file path every process of the job appends
#: timestamped JSON lines to (worker exit noticed, process start, init, Baby child ready, quorum,
#: configure, heal, first commit). Unset: nothing is recorded.
FTLAUNCH_PHASE_LOG = "FTLAUNCH_PHASE_LOG"
#: ``0`` turns off the shared torch import of `ftlaunch.bootstrap.prestart` (the worker imports torch before
#: the script runs and forks its Baby child from there): the child is then its own interpreter and
#: imports torch itself, while the script does. Default on.
FTLAUNCH_PRESTART_FORK = "FTLAUNCH_PRESTART_FORK"
#: ``0`` turns off the warm standby interpreter (`ftlaunch.bootstrap.zygote`) the launcher's agent keeps per
#: group: a (re)started worker then imports torch itself instead of being forked, torch imported,
#: from the standby. Default on (``ftlaunch`` launcher only; it costs one idle torch interpreter).
FTLAUNCH_ZYGOTE = "FTLAUNCH_ZYGOTE"
#: Set by the agent for its workers: the Unix socket its standby interpreter listens on (internal).
FTLAUNCH_ZYGOTE_SOCKET = "FTLAUNCH_ZYGOTE_SOCKET"
#: Set in a worker forked from the standby: the pid torchelastic started and knows it by (its
#: proxy, which every signal goes through). Absent in a worker started cold: that pid is its own.
FTLAUNCH_WORKER_PID = "FTLAUNCH_WORKER_PID"

ALL_FTLAUNCH_VARS = (
    REPLICA_GROUP_ID,
    NUM_REPLICA_GROUPS,
    FTLAUNCH_LIGHTHOUSE,
    TORCHFT_LIGHTHOUSE,
    FTLAUNCH_TOKEN,
    FTLAUNCH_SPARES,
    FTLAUNCH_LIGHTHOUSE_BIND,
    FTLAUNCH_LOCAL_ADDR,
    FTLAUNCH_GROUP_INCARNATION,
    FTLAUNCH_BACKEND,
    FTLAUNCH_TRANSPORT,
    FTLAUNCH_TIMEOUT,
    FTLAUNCH_COLLECTIVE_TIMEOUT,
    FTLAUNCH_HEAL_TIMEOUT,
    FTLAUNCH_COMMIT_TIMEOUT,
    FTLAUNCH_QUORUM_TIMEOUT,
    FTLAUNCH_CONNECT_TIMEOUT,
    FTLAUNCH_LIGHTHOUSE_OUTAGE,
    FTLAUNCH_LIGHTHOUSE_REACHED,
    FTLAUNCH_OUTAGE_STEPS,
    FTLAUNCH_PROGRESS_TIMEOUT,
    FTLAUNCH_HEAL_CLAIMS,
    FTLAUNCH_SYNC_EVERY,
    FTLAUNCH_FRAGMENTS,
    FTLAUNCH_FRAGMENT_SYNC_DELAY,
    FTLAUNCH_FRAGMENT_UPDATE_ALPHA,
    FTLAUNCH_QUANTIZE,
    FTLAUNCH_PHASE_LOG,
    FTLAUNCH_PRESTART_FORK,
    FTLAUNCH_ZYGOTE,
    FTLAUNCH_ZYGOTE_SOCKET,
    FTLAUNCH_WORKER_PID,
)


def replica_id(replica_group_id: int) -> str:
    """The lighthouse's name for replica group ``replica_group_id`` (the one place it is spelled)."""
    return f"rg{replica_group_id}"


def lighthouse_reached(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher reached the job's lighthouse before (`FTLAUNCH_LIGHTHOUSE_REACHED`)."""
    return (os.environ if environ is None else environ).get(FTLAUNCH_LIGHTHOUSE_REACHED, "") == "1"


def local_addr(environ: Mapping[str, str] | None = None) -> str | None:
    """This node's address for the job's other hosts, when set (`FTLAUNCH_LOCAL_ADDR`)."""
    value = (os.environ if environ is None else environ).get(FTLAUNCH_LOCAL_ADDR, "").strip()
    return value or None


def slurm_restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How often Slurm requeued this job (0 outside Slurm or on its first run)."""
    return get_int(SLURM_RESTART_COUNT, 0, environ) or 0


def gloo_interface_chosen(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``GLOO_SOCKET_IFNAME`` picks Gloo's interface (then torch's choice stands)."""
    return bool((os.environ if environ is None else environ).get(GLOO_SOCKET_IFNAME, "").strip())


def incarnation_environ(incarnation: int) -> dict[str, str]:
    """What the rendezvous sets for the workers of one round (`FTLAUNCH_GROUP_INCARNATION`)."""
    return {FTLAUNCH_GROUP_INCARNATION: str(incarnation)}


def lighthouse_address(environ: Mapping[str, str] | None = None) -> str | None:
    """The lighthouse address from the environment (ours first, torchft's as fallback)."""
    env = os.environ if environ is None else environ
    return env.get(FTLAUNCH_LIGHTHOUSE) or env.get(TORCHFT_LIGHTHOUSE) or None


def get_int(name: str, default: int | None = None, environ: Mapping[str, str] | None = None) -> int | None:
    """Read an integer variable; a malformed value is a clear `ConfigurationError`, not a traceback."""
    from ftlaunch.errors import ConfigurationError

    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"environment variable {name}={raw!r} is not an integer") from None


HOW_TO_LAUNCH = (
    "Launch the script with one of:\n"
    "  ftlaunch --replicas 2 train.py\n"
    "  torchrun --rdzv-backend ftlaunch --rdzv-endpoint HOST:PORT "
    "--rdzv-conf replica_group_id=G,num_replica_groups=N train.py\n"
    "  torchx run -s local_cwd ftlaunch:hsdp --replicas 2 --script train.py\n"
    f"or set {REPLICA_GROUP_ID}, {NUM_REPLICA_GROUPS} and {FTLAUNCH_LIGHTHOUSE} yourself "
    "(against a running `ftlaunch-lighthouse`), or pass them to ftlaunch.init()"
)


@dataclass(frozen=True)
class JobEnv:
    """What every launch path tells a worker about its job: the launcher->worker contract.

    Built once, validated once: `from_environ` on the worker side, `to_environ` on the launcher
    side (the only writer of these variables), so the three launch paths cannot disagree on a name
    or a format.
    """

    replica_group_id: int
    num_replica_groups: int
    #: The lighthouse, normalised to ``http://host:port``.
    lighthouse: str
    #: The job token the lighthouse requires (None: a lighthouse without one).
    token: str | None = None
    #: Hot spares of the job: groups ``num_replica_groups .. num_replica_groups + spares - 1`` start
    #: as spares, and with spares every group claims its slot (`ftlaunch.worker.spare`).
    spares: int = 0
    #: The launcher reached this lighthouse before starting the group (`FTLAUNCH_LIGHTHOUSE_REACHED`).
    lighthouse_reached: bool = False
    #: This node's address for the job's other hosts (`FTLAUNCH_LOCAL_ADDR`; None: not decided).
    local_addr: str | None = None

    def __post_init__(self) -> None:
        from ftlaunch.errors import ConfigurationError

        if self.num_replica_groups < 1:
            raise ConfigurationError(f"{NUM_REPLICA_GROUPS}={self.num_replica_groups} must be >= 1")
        if self.spares < 0:
            raise ConfigurationError(f"{FTLAUNCH_SPARES}={self.spares} must be >= 0")
        if not 0 <= self.replica_group_id < self.num_replica_groups + self.spares:
            spares = f", {FTLAUNCH_SPARES}={self.spares}" if self.spares else ""
            raise ConfigurationError(
                f"replica group id {self.replica_group_id} is outside 0..{self.num_replica_groups + self.spares - 1} "
                f"({NUM_REPLICA_GROUPS}={self.num_replica_groups}{spares})"
            )
        object.__setattr__(self, "lighthouse", normalize_lighthouse(self.lighthouse, FTLAUNCH_LIGHTHOUSE))

    @property
    def replica_id(self) -> str:
        return replica_id(self.replica_group_id)

    @property
    def starts_as_spare(self) -> bool:
        """This group was started as a hot spare (its id is past the job's replica groups)."""
        return self.replica_group_id >= self.num_replica_groups

    @classmethod
    def from_environ(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        replica_group_id: int | None = None,
        num_replica_groups: int | None = None,
        lighthouse: str | None = None,
        token: str | None = None,
    ) -> JobEnv:
        """The job this worker belongs to: explicit values first, then the environment.

        Raises `ConfigurationError` naming what is missing or malformed and how to launch.
        """
        from ftlaunch.errors import ConfigurationError

        env = os.environ if environ is None else environ
        group = replica_group_id if replica_group_id is not None else get_int(REPLICA_GROUP_ID, environ=env)
        addr = lighthouse or lighthouse_address(env)
        missing = [
            name for name, value in ((REPLICA_GROUP_ID, group), (FTLAUNCH_LIGHTHOUSE, addr)) if value is None
        ]
        if missing:
            raise ConfigurationError(
                f"found no ftlaunch job: {' and '.join(missing)} not set. {HOW_TO_LAUNCH}"
            )
        num = (
            num_replica_groups if num_replica_groups is not None else get_int(NUM_REPLICA_GROUPS, environ=env)
        )
        if num is None:
            raise ConfigurationError(f"{NUM_REPLICA_GROUPS} is not set. {HOW_TO_LAUNCH}")
        assert group is not None and addr is not None  # narrowed by the checks above
        spares = get_int(FTLAUNCH_SPARES, 0, env) or 0
        token = token if token is not None else (env.get(FTLAUNCH_TOKEN) or None)
        return cls(group, num, addr, token, spares, lighthouse_reached(env), local_addr(env))

    def to_environ(self) -> dict[str, str]:
        """The variables a launcher sets in every worker of this replica group."""
        out = {
            REPLICA_GROUP_ID: str(self.replica_group_id),
            NUM_REPLICA_GROUPS: str(self.num_replica_groups),
            FTLAUNCH_LIGHTHOUSE: self.lighthouse,
        }
        if self.token:
            out[FTLAUNCH_TOKEN] = self.token
        if self.spares:
            out[FTLAUNCH_SPARES] = str(self.spares)
        if self.lighthouse_reached:
            out[FTLAUNCH_LIGHTHOUSE_REACHED] = "1"
        if self.local_addr:
            out[FTLAUNCH_LOCAL_ADDR] = self.local_addr
        return out


@dataclass(frozen=True)
class GroupEnv:
    """What torchelastic tells a worker about its own replica group (rank, size, the group's store)."""

    rank: int = 0
    world_size: int = 1
    #: The group's store (torchelastic's ``MASTER_ADDR``/``MASTER_PORT``), None outside torchelastic.
    master_addr: str | None = None
    master_port: int | None = None
    #: torchelastic's restart count: how often *this node's* agent restarted its workers.
    restart_count: int = 0
    #: The incarnation of the group's workers, the same on every node (`FTLAUNCH_GROUP_INCARNATION`,
    #: else the restart count: right for a group of one node).
    incarnation: int = 0

    def __post_init__(self) -> None:
        from ftlaunch.errors import ConfigurationError

        if not 0 <= self.rank < self.world_size:
            raise ConfigurationError(f"{RANK}={self.rank} is outside {WORLD_SIZE}={self.world_size}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> GroupEnv:
        env = os.environ if environ is None else environ
        restart = get_int(TORCHELASTIC_RESTART_COUNT, 0, env) or 0
        return cls(
            rank=get_int(RANK, 0, env) or 0,
            world_size=get_int(WORLD_SIZE, 1, env) or 1,
            master_addr=env.get(MASTER_ADDR) or None,
            master_port=get_int(MASTER_PORT, None, env),
            restart_count=restart,
            incarnation=get_int(FTLAUNCH_GROUP_INCARNATION, restart, env) or 0,
        )


def normalize_lighthouse(address: str, what: str = "lighthouse address") -> str:
    """``host:port`` or ``http://host:port`` -> ``http://host:port``; `ConfigurationError` otherwise."""
    from ftlaunch.addresses import parse_address
    from ftlaunch.errors import ConfigurationError

    try:
        return parse_address(address, allow_http=True).url
    except (ValueError, TypeError) as e:
        raise ConfigurationError(f"{what}={address!r} is not a lighthouse address: {e}") from None
