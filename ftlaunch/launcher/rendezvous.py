"""The ``ftlaunch`` torchelastic rendezvous backend.

``torchrun --rdzv-backend ftlaunch --rdzv-endpoint HOST:PORT --rdzv-conf
replica_group_id=0,num_replica_groups=2`` needs no import in user code: the backend is registered through the
``torchrun.handlers`` entry point.

Two levels of membership, kept apart on purpose:

* **Inside a replica group** the nodes meet in an ordinary torchelastic dynamic (c10d) rendezvous of
  their own (run id ``<rdzv-id>-rg<group>``). A node joining or dying restarts that group only -- the
  usual torchelastic behaviour, scoped to one group.
* **Across replica groups** membership is decided step by step by the lighthouse at ``HOST:PORT``.
  This handler never consults it to decide a restart (`num_nodes_waiting` only counts the group's
  own nodes), so a group coming or going never restarts a healthy one.

The handler also publishes the job environment (`env.JobEnv`: ``REPLICA_GROUP_ID``,
``NUM_REPLICA_GROUPS``, ``FTLAUNCH_LIGHTHOUSE``, ``FTLAUNCH_LOCAL_ADDR`` and, when known,
``FTLAUNCH_TOKEN``; and each round's ``FTLAUNCH_GROUP_INCARNATION``) by setting it in the agent's
``os.environ`` before torchelastic starts the workers, which inherit the agent's environment. It
does so under all three launch paths (``ftlaunch``, ``torchrun``, torchx).

**Addresses other hosts can reach.** The group's store (``MASTER_ADDR``, which the quorum hands to
the other groups) is published under this node's address for the job's other hosts: ``--local-addr``
(or ``FTLAUNCH_LOCAL_ADDR``) when given, else the local address of the route to the lighthouse
(`ftlaunch.addresses.reachable_address`), which is loopback only when the lighthouse is addressed as
loopback -- the whole job on one host.

**One incarnation per round, on every node.** Each round, the group's rank 0 counts the round in the
group's own rendezvous store (which outlives rounds) and hands the count to the round's other nodes;
the workers key their group-store traffic by it. torchelastic's restart count cannot serve: it
counts only the restarts of the node whose worker failed.

**A warm standby interpreter per node** (`ftlaunch.launcher.standby`): before the first workers
start, the handler starts the node's standby and announces it to them (``FTLAUNCH_ZYGOTE_SOCKET``).
It imports torch only once a worker asks for it -- one run as ``-m ftlaunch.run SCRIPT`` (the torchx
components run every worker so) -- and forks that worker and every restarted one with torch
imported. It ends with the agent (`shutdown`, its exit, or its death). ``FTLAUNCH_ZYGOTE=0`` or
``FTLAUNCH_PRESTART_FORK=0``: none.

**A configuration error stops the node instead of a restart** (under torchrun's own agent, not the
``ftlaunch`` supervisor, which stops the whole job itself): a worker ending on a `ConfigurationError`
records it in a file the handler gave the node's workers (``FTLAUNCH_RENDEZVOUS_ERROR_FILE``), and the
handler answers the agent's request for the restart's round by closing the group's rendezvous and
raising `RendezvousClosedError` with the worker's line (`_stop_if_misconfigured`). A restart would
only read the same setting again.

If no lighthouse answers at the endpoint and the endpoint names this machine, the handler hosts one
inside this agent process (`HostedLighthouse`, as the c10d backend hosts its store). That lighthouse
lives exactly as long as this agent: a single point of failure for the whole job (see docs/launcher.md).
"""

from __future__ import annotations


# The entry point is loaded while torch's rendezvous package is still initializing, possibly in the
# middle of importing this very module (when ftlaunch imports torch's package first). So the entry
# point and the creator it returns are bound before any torch import below.
def _creator(params):  # type: ignore[no-untyped-def]
    return create_rdzv_handler(params)


def create_handler():  # type: ignore[no-untyped-def]
    """Entry point (group ``torchrun.handlers``): torch calls it with no argument for the creator."""
    return _creator


import dataclasses  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import secrets  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402
from collections.abc import Callable, Mapping  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from datetime import timedelta  # noqa: E402

from torch.distributed import PrefixStore, Store, TCPStore  # noqa: E402
from torch.distributed.elastic.rendezvous.api import (  # noqa: E402
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from ftlaunch import env, phases  # noqa: E402
from ftlaunch.addresses import format_host_port, is_local_host, parse_host_port, reachable_address  # noqa: E402
from ftlaunch.env import Duration  # noqa: E402
from ftlaunch.errors import ConfigurationError, configuration_error_in  # noqa: E402
from ftlaunch.launcher.health_gate import HealthGate  # noqa: E402
from ftlaunch.launcher.lighthouse_host import HostedLighthouse, LighthouseSettings, RemoteLighthouse  # noqa: E402
from ftlaunch.launcher.standby import Standby  # noqa: E402
from ftlaunch.lighthouse.client import LighthouseClient  # noqa: E402
from ftlaunch.lighthouse.health import HealthReport  # noqa: E402
from ftlaunch.lighthouse.quorum import HEARTBEAT_TIMEOUT, JOIN_TIMEOUT  # noqa: E402

logger = logging.getLogger(__name__)

BACKEND_NAME = "ftlaunch"
#: Timeout of the workers' store server (torch's default for TCPStore).
_STORE_TIMEOUT_S = 300
#: Key of the group's round count in its rendezvous store (it outlives rounds).
_ROUNDS_KEY = "ftlaunch/rounds"
#: Key of the configuration error that stopped the group, in its rendezvous store (the node whose
#: worker ended on it writes it; the group's other nodes read it when their agent restarts).
_STOP_KEY = "ftlaunch/configuration_error"
#: Key of the round's incarnation and workers' store in the round's own store (rank 0 writes it,
#: the other nodes read it).
_ROUND_KEY = "ftlaunch/round"

#: Keys this handler reads from ``--rdzv-conf``; everything else must be a key of torchelastic's
#: dynamic rendezvous (passed on to the group's own rendezvous).
_OUR_KEYS = {
    "replica_group_id": "id of this replica group, 0..num_replica_groups-1 (or env REPLICA_GROUP_ID)",
    "num_replica_groups": "number of replica groups in the job (or env NUM_REPLICA_GROUPS)",
    "spares": "hot spares of the job (or env FTLAUNCH_SPARES); groups num_replica_groups.. start as spares",
    "group_endpoint": "HOST:PORT (or file:/shared/path) where the nodes of a multi-node group meet",
    "lighthouse_file": "read the lighthouse address from this file (written by a lighthouse role)",
    "lighthouse_timeout": "how long to wait for a lighthouse to answer (a duration, 0.1 s to 24 h; "
    "default 60)",
    "start_lighthouse": "host a lighthouse here if none answers and the endpoint is this machine "
    "(default true)",
    "lighthouse_bind": "address a lighthouse started here binds (default: the endpoint)",
    "lighthouse_min_replicas": "min_replicas of a lighthouse started here (default 1)",
    "lighthouse_join_timeout": "join timeout of a lighthouse started here (a duration, 0 s to 24 h; "
    "default 60)",
    "lighthouse_heartbeat_timeout": "heartbeat timeout of a lighthouse started here (0.5 s to 24 h; "
    "default 5)",
    "lighthouse_stragglers": "slow groups, for a lighthouse started here: report or replace (or env "
    "FTLAUNCH_STRAGGLERS; default report)",
    "lighthouse_linger": "how long a lighthouse started here outlives its group while others use it "
    "(a duration, 0 s to 24 h; default 60)",
    "health_check": "a command run before this group's workers start or restart; a failure keeps the group "
    "out, retried with backoff (or env FTLAUNCH_HEALTH_CHECK; e.g. 'python -m ftlaunch.health')",
    "health_check_timeout": "how long one run of the health check may take before it is killed "
    "(a duration, 0.1 s to 1 h; or env FTLAUNCH_HEALTH_CHECK_TIMEOUT; default 60)",
    "token": "job token every lighthouse request carries (or env FTLAUNCH_TOKEN); required to host one "
    "off loopback",
    "checkpoint_dir": "durable checkpoints: the directory (or env FTLAUNCH_CHECKPOINT_DIR); the job "
    "resumes from its newest",
    "checkpoint_every": "durable checkpoints: committed steps between saves (or env "
    "FTLAUNCH_CHECKPOINT_EVERY; default 100)",
    "checkpoint_keep": "durable checkpoints: complete ones kept (or env FTLAUNCH_CHECKPOINT_KEEP; "
    "default 3, 0: all)",
}
_INNER_KEYS = {
    "timeout",
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "read_timeout",
    "is_host",
    "store_type",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "rank",
}

_EXAMPLE = "--rdzv-conf replica_group_id=0,num_replica_groups=2"
#: Bounds of ``lighthouse_timeout`` and ``lighthouse_linger`` (the lighthouse_* options of the
#: lighthouse itself have the lighthouse's bounds).
_LIGHTHOUSE_WAIT = Duration(0.1)
_LINGER = Duration(0.0)


@dataclass(frozen=True)
class FtRendezvousConfig:
    """The validated ftlaunch part of ``--rdzv-conf``."""

    replica_group_id: int
    num_replica_groups: int
    spares: int = 0
    group_endpoint: str = ""
    lighthouse_file: str = ""
    lighthouse_timeout: float = 60.0
    start_lighthouse: bool = True
    lighthouse_bind: str = ""
    lighthouse_min_replicas: int = 1
    lighthouse_join_timeout: float = 60.0
    lighthouse_heartbeat_timeout: float = 5.0
    lighthouse_stragglers: str = "report"
    lighthouse_linger: float = 60.0
    token: str | None = None
    #: The command run before every start and restart of the group's workers ("": none).
    health_check: str = ""
    health_check_timeout: float = env.DEFAULT_HEALTH_CHECK_TIMEOUT
    #: Durable checkpoints the workers write and resume from (published as `env.CheckpointEnv`).
    checkpoint: env.CheckpointEnv = env.CheckpointEnv()

    @classmethod
    def from_params(
        cls, params: RendezvousParameters, environ: Mapping[str, str] | None = None
    ) -> FtRendezvousConfig:
        """Validate ``params.config``; every problem is a `ConfigurationError` naming the key."""
        unknown = sorted(k for k in params.config if k not in _OUR_KEYS and k not in _INNER_KEYS)
        if unknown:
            raise ConfigurationError(
                f"ftlaunch rendezvous: unknown --rdzv-conf key(s) {', '.join(unknown)}; "
                f"ftlaunch keys: {', '.join(_OUR_KEYS)}; torchelastic keys: {', '.join(sorted(_INNER_KEYS))}"
            )

        def as_int(key: str, env_name: str | None = None, default: int | None = None) -> int | None:
            try:
                value = params.get_as_int(key)
            except ValueError:
                raise ConfigurationError(
                    f"ftlaunch rendezvous: {key}={params.get(key)!r} is not an integer"
                ) from None
            if value is None and env_name is not None:
                value = env.count(env_name, environ=environ)
            return default if value is None else value

        def required(key: str, env_name: str) -> int:
            value = as_int(key, env_name)
            if value is None:
                raise ConfigurationError(
                    f"ftlaunch rendezvous: --rdzv-conf is missing {key} (or set {env_name}), e.g. {_EXAMPLE}"
                )
            return value

        def as_seconds(key: str, default: float, bounds: Duration) -> float:
            value = params.get(key)
            if value is None:
                return default
            try:
                return bounds.parse(str(value))
            except ValueError as e:
                raise ConfigurationError(f"ftlaunch rendezvous: {key}={value!r} {e}") from None

        def as_bool(key: str, default: bool) -> bool:
            try:
                value = params.get_as_bool(key, default)
            except ValueError:
                raise ConfigurationError(
                    f"ftlaunch rendezvous: {key}={params.get(key)!r} is not a boolean"
                ) from None
            return default if value is None else value

        def as_str(key: str, env_name: str | None = None) -> str:
            value = params.get(key)
            if value is None and env_name is not None:
                value = env.text(env_name, environ)
            return str(value).strip() if value is not None else ""

        group = required("replica_group_id", env.REPLICA_GROUP_ID)
        num = required("num_replica_groups", env.NUM_REPLICA_GROUPS)
        spares = as_int("spares", env.FTLAUNCH_SPARES, default=0)
        assert spares is not None  # noqa: S101 - has a default
        if num < 1:
            raise ConfigurationError(f"ftlaunch rendezvous: num_replica_groups={num} must be >= 1")
        if spares < 0:
            raise ConfigurationError(f"ftlaunch rendezvous: spares={spares} must be >= 0")
        if not 0 <= group < num + spares:
            with_spares = f", spares={spares}" if spares else ""
            raise ConfigurationError(
                f"ftlaunch rendezvous: replica_group_id={group} must be in 0..{num + spares - 1} "
                f"(num_replica_groups={num}{with_spares})"
            )
        min_replicas = as_int("lighthouse_min_replicas", default=1)
        assert min_replicas is not None  # noqa: S101 - has a default
        if min_replicas < 1:
            raise ConfigurationError(
                f"ftlaunch rendezvous: lighthouse_min_replicas={min_replicas} must be >= 1"
            )
        stragglers = as_str("lighthouse_stragglers").lower()
        if stragglers and stragglers not in env.STRAGGLER_POLICIES:
            raise ConfigurationError(
                f"ftlaunch rendezvous: lighthouse_stragglers={stragglers!r} must be one of "
                f"{', '.join(env.STRAGGLER_POLICIES)}"
            )
        return cls(
            replica_group_id=group,
            num_replica_groups=num,
            spares=spares,
            group_endpoint=as_str("group_endpoint"),
            lighthouse_file=as_str("lighthouse_file"),
            lighthouse_timeout=as_seconds("lighthouse_timeout", 60.0, _LIGHTHOUSE_WAIT),
            start_lighthouse=as_bool("start_lighthouse", True),
            lighthouse_bind=as_str("lighthouse_bind", env.FTLAUNCH_LIGHTHOUSE_BIND),
            lighthouse_min_replicas=min_replicas,
            lighthouse_join_timeout=as_seconds("lighthouse_join_timeout", 60.0, JOIN_TIMEOUT),
            lighthouse_heartbeat_timeout=as_seconds("lighthouse_heartbeat_timeout", 5.0, HEARTBEAT_TIMEOUT),
            lighthouse_stragglers=stragglers or env.stragglers(environ) or "report",
            lighthouse_linger=as_seconds("lighthouse_linger", 60.0, _LINGER),
            token=as_str("token", env.FTLAUNCH_TOKEN) or None,
            health_check=as_str("health_check", env.FTLAUNCH_HEALTH_CHECK),
            health_check_timeout=(
                as_seconds("health_check_timeout", 0.0, env.HEALTH_CHECK_TIMEOUT)
                if params.get("health_check_timeout") is not None
                else env.health_check_timeout(environ)
            ),
            checkpoint=_checkpoint_conf(as_str, as_int, environ),
        )

    @property
    def lighthouse_settings(self) -> LighthouseSettings:
        """How to host a lighthouse here (``bind`` filled in by the caller when not configured)."""
        return LighthouseSettings(
            bind=self.lighthouse_bind,
            min_replicas=self.lighthouse_min_replicas,
            expected_replicas=self.num_replica_groups,
            join_timeout=self.lighthouse_join_timeout,
            heartbeat_timeout=self.lighthouse_heartbeat_timeout,
            token=self.token,
            stragglers=self.lighthouse_stragglers,
        )


def _checkpoint_conf(
    as_str: Callable[[str, str | None], str],
    as_int: Callable[[str, str | None, int | None], int | None],
    environ: Mapping[str, str] | None,
) -> env.CheckpointEnv:
    """The ``checkpoint_*`` keys of ``--rdzv-conf``, over the environment's values."""
    from_env = env.CheckpointEnv.from_environ(environ)
    directory = as_str("checkpoint_dir", env.FTLAUNCH_CHECKPOINT_DIR) or None
    every = as_int("checkpoint_every", None, from_env.every)
    keep = as_int("checkpoint_keep", None, from_env.keep_last)
    assert every is not None and keep is not None  # noqa: S101 - have defaults
    for key, value in (("checkpoint_every", every), ("checkpoint_keep", keep)):
        if value < 0:
            raise ConfigurationError(f"ftlaunch rendezvous: {key}={value} must be >= 0")
    if directory is None and (every != from_env.every or keep != from_env.keep_last):
        raise ConfigurationError("ftlaunch rendezvous: checkpoint_every/checkpoint_keep need checkpoint_dir")
    return env.CheckpointEnv(directory, every, keep)


def _lighthouse_url(addr: str, what: str) -> str:
    """``host:port`` or ``http://host:port`` -> ``http://host:port``; `ConfigurationError` naming ``what``."""
    return env.normalize_lighthouse(addr, f"ftlaunch rendezvous: {what}")


# --- the handler ---------------------------------------------------------------------------------


class FtlaunchRendezvousHandler(RendezvousHandler):
    """One replica group's rendezvous: its own c10d rendezvous inside, the lighthouse across groups."""

    def __init__(
        self,
        config: FtRendezvousConfig,
        inner: RendezvousHandler,
        endpoint: str,
        run_id: str,
        local_addr: str | None = None,
        rounds_store: Store | None = None,
    ) -> None:
        self.config = config
        #: The address given with --local-addr / FTLAUNCH_LOCAL_ADDR (None: decide from the route).
        self._local_addr = local_addr
        self._advertised: str | None = None
        #: The group's rendezvous store, which outlives rounds: it counts them (`_round`).
        self._rounds_store = rounds_store
        self._worker_store: TCPStore | None = None
        self._inner = inner
        self._endpoint = endpoint.strip()
        self._run_id = run_id
        self._lighthouse_addr: str | None = None
        self._hosted: HostedLighthouse | None = None
        self._rounds = 0
        self._health: HealthGate | None = None
        #: Started by the `ftlaunch` supervisor (which stops a group its check keeps out once the
        #: training finished); under plain torchrun the gate itself gives up then.
        self._supervised = env.lighthouse_reached()
        self._standby: Standby | None = None
        #: Where this node's workers record a configuration error they end on (`_stop_if_misconfigured`);
        #: None under the `ftlaunch` supervisor, which reads their torchelastic error files itself.
        self._error_file: str | None = None
        #: Removes ``_error_file`` at `shutdown`, or at the agent's exit where torch skips it (an agent
        #: a signal ends does not shut its rendezvous down).
        self._error_file_removal: weakref.finalize | None = None

    # torchelastic API
    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        # The agent (of group rank 0) hosts the workers' store: a fresh one every round.
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self._rounds > 0:
            self._stop_if_misconfigured()
        addr = self._ensure_lighthouse()
        advertised = self._advertised_address(addr)
        self._publish_env(addr, advertised)
        self._check_health(addr)
        if self._rounds == 0:
            self._start_standby()
            self._ask_for_configuration_errors()
        self._rounds += 1
        if self._rounds > 1:
            logger.info(
                "ftlaunch rendezvous: replica group %d re-rendezvous (round %d)",
                self.config.replica_group_id,
                self._rounds,
            )
        phases.mark("rendezvous_start", round=self._rounds)
        info = self._inner.next_rendezvous()
        phases.mark("rendezvous_done", round=self._rounds)
        incarnation, bootstrap = self._round(info, advertised)
        env.publish(env.incarnation_environ(incarnation))
        return RendezvousInfo(info.store, info.rank, info.world_size, bootstrap)

    def _ask_for_configuration_errors(self) -> None:
        """Give this node's workers a file to record a configuration error they end on in
        (``FTLAUNCH_RENDEZVOUS_ERROR_FILE``, `ftlaunch.errors.install_brief_errors`).

        Why a file of its own: torchelastic's error files, where a worker records why it failed,
        lie in a directory torchelastic names at random per run (or wherever a ``--logs-specs``
        plugin puts them, or nowhere with ``--log-dir /dev/null``), and nothing of the agent hands
        them to the rendezvous. The environment the workers inherit from the agent does reach them.
        Not under the `ftlaunch` supervisor: it reads the torchelastic error files and stops the job.
        """
        if self._supervised:
            return
        # A name nobody can guess, and no directory: only a worker that ends on an error creates it.
        name = f"ftlaunch-rdzv-{os.getpid()}-{secrets.token_hex(16)}.json"
        self._error_file = os.path.join(tempfile.gettempdir(), name)
        self._error_file_removal = weakref.finalize(self, _remove_file, self._error_file)
        env.publish({env.FTLAUNCH_RENDEZVOUS_ERROR_FILE: self._error_file})

    def _stop_if_misconfigured(self) -> None:
        """Before a restart's round: when a worker of the last round ended on a configuration error
        (this node's, or another node's of the group), close the group's rendezvous and raise
        `RendezvousClosedError` naming the error, instead of restarting into it.

        torchelastic's agent restarts its workers by asking for the next round; an exception from
        `next_rendezvous` ends its run -- no restart, torchrun exits non-zero -- and a closed
        rendezvous ends the rounds of the group's other nodes too. A configuration error is the
        same at every attempt, so the ``--max-restarts`` attempts would only repeat it.
        """
        message = self._local_configuration_error()
        if message is not None:
            self._share_stop(message)
            self._inner.set_closed()
        else:
            message = self._shared_configuration_error()
            if message is None:
                return
        raise RendezvousClosedError(
            f"ftlaunch rendezvous: replica group {self.config.replica_group_id} stops instead of restarting: "
            f"a worker ended on a configuration error, which a restart cannot fix: {message}"
        )

    def _local_configuration_error(self) -> str | None:
        """The configuration error one of this node's workers recorded (None: none did)."""
        if self._error_file is None:
            return None
        try:
            with open(self._error_file, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            return None
        return configuration_error_in(record)

    def _share_stop(self, message: str) -> None:
        """Tell the group's other nodes why it stops (best effort: its store may be gone)."""
        if self._rounds_store is None:
            return
        try:
            self._rounds_store.set(_STOP_KEY, message)
        except Exception as e:  # noqa: BLE001 - a store that failed: the closed rendezvous still stops them
            logger.info("ftlaunch rendezvous: could not tell the group's other nodes why it stops: %s", e)

    def _shared_configuration_error(self) -> str | None:
        """The configuration error another node of the group stopped on (None: none)."""
        if self._rounds_store is None:
            return None
        try:
            if not self._rounds_store.check([_STOP_KEY]):
                return None
            return self._rounds_store.get(_STOP_KEY).decode("utf-8", "replace")
        except Exception:  # noqa: BLE001 - no store to ask: the inner rendezvous decides as before
            return None

    def _check_health(self, lighthouse: str) -> None:
        """Run the group's health check until it passes, before this round (launcher/health_gate.py):
        while it fails the group stays out of the job, which trains on without it."""
        cfg = self.config
        if not cfg.health_check:
            return
        if self._health is None:

            def report(replica_id: str, health: HealthReport) -> None:
                with LighthouseClient(lighthouse, connect_timeout=5.0, token=cfg.token) as client:
                    client.report_health(replica_id, health)

            def finished() -> bool:
                with LighthouseClient(lighthouse, connect_timeout=5.0, token=cfg.token) as client:
                    return any(p.finished for p in client.snapshot().progress)

            rid = env.replica_id(cfg.replica_group_id)
            self._health = HealthGate(
                cfg.health_check,
                cfg.health_check_timeout,
                rid,
                report,
                finished=None if self._supervised else finished,
            )
        phases.mark("health_check_start", round=self._rounds + 1)
        failed = self._health.wait_until_healthy()
        phases.mark("health_check_done", round=self._rounds + 1, failures=failed)

    def _advertised_address(self, lighthouse: str) -> str:
        """This node's address for the job's other hosts (see the module docstring)."""
        if self._advertised is None:
            self._advertised = self._local_addr or reachable_address(parse_host_port(lighthouse)[0])
            logger.info(
                "ftlaunch rendezvous: replica group %d publishes its addresses as %s",
                self.config.replica_group_id,
                self._advertised,
            )
        return self._advertised

    def _round(self, info: RendezvousInfo, advertised: str) -> tuple[int, RendezvousStoreInfo]:
        """This round's incarnation and workers' store, the same on every node of the group.

        Rank 0's agent hosts a fresh workers' store (``MASTER_ADDR:MASTER_PORT``) every round. torch's
        dynamic rendezvous keeps one agent store across rounds, and workers do not prefix their keys
        per attempt: after a restart a fast worker could read the address the *dead* rank 0 of the
        previous attempt published and fail with "Connection refused" in gloo's connectFullMesh.
        It also counts the round in the group's rendezvous store, which outlives rounds. Both go
        to the other nodes in one key of the round's own store (``info.store``, fresh every round)
        -- not under torch's ``MASTER_ADDR``/``MASTER_PORT`` keys there, which the inner rendezvous
        has already set to its own store: a node reading them before rank 0 overwrote them would
        join another store than its peers.
        """
        if info.rank != 0:
            got = json.loads(info.store.get(_ROUND_KEY))
            return int(got["incarnation"]), RendezvousStoreInfo(str(got["addr"]), int(got["port"]))
        if self._rounds_store is not None:
            incarnation = self._rounds_store.add(_ROUNDS_KEY, 1) - 1
        else:  # no store across rounds (a test double): this node's count
            incarnation = self._rounds - 1
        self._worker_store = None  # the previous round's server closes
        self._worker_store = TCPStore(  # listens on every interface; published as ``advertised``
            advertised,
            0,
            is_master=True,
            multi_tenant=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=_STORE_TIMEOUT_S),
        )
        port = self._worker_store.port
        info.store.set(_ROUND_KEY, json.dumps({"incarnation": incarnation, "addr": advertised, "port": port}))
        return incarnation, RendezvousStoreInfo(advertised, port)

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        # Only this group's own late nodes trigger a restart -- never other groups.
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        try:
            return self._inner.shutdown()
        finally:
            self._worker_store = None
            self._stop_standby()
            self._forget_configuration_errors()
            self._stop_hosted_lighthouse()

    def _forget_configuration_errors(self) -> None:
        removal, self._error_file_removal, self._error_file = self._error_file_removal, None, None
        if removal is not None:
            env.unpublish(env.FTLAUNCH_RENDEZVOUS_ERROR_FILE)
            removal()

    # the node's warm standby interpreter
    def _start_standby(self) -> None:
        """Start the node's standby, on demand (see `ftlaunch.launcher.standby`), once per agent and
        before its first workers. Not where one is announced already: the ``ftlaunch`` launcher's
        agent keeps its own (warming up from its start)."""
        if env.zygote_socket() is None:
            self._standby = Standby.start(on_demand=True)

    def _stop_standby(self) -> None:
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.stop()

    # lighthouse
    def _ensure_lighthouse(self) -> str:
        if self._lighthouse_addr is not None:
            return self._lighthouse_addr
        cfg = self.config
        wait = cfg.lighthouse_timeout
        if env.lighthouse_reached():
            # An agent the `ftlaunch` supervisor (re)started: the job's lighthouse answered before,
            # so an unreachable one is an outage to wait out like the running groups do.
            wait = max(wait, env.lighthouse_outage())
        deadline = time.monotonic() + wait
        if cfg.lighthouse_file:
            addr = self._read_lighthouse_file(cfg.lighthouse_file, deadline)
        elif self._endpoint:
            addr = _lighthouse_url(self._endpoint, "--rdzv-endpoint")
        else:
            raise ConfigurationError(
                "ftlaunch rendezvous: no lighthouse: pass --rdzv-endpoint HOST:PORT (or lighthouse_file= "
                "in --rdzv-conf)"
            )
        host, port = parse_host_port(addr)
        attempted_start = False
        while True:
            if RemoteLighthouse.answers(addr, timeout=min(2.0, cfg.lighthouse_timeout)):
                break
            if (
                not attempted_start
                and cfg.start_lighthouse
                and not cfg.lighthouse_file
                and is_local_host(host)
            ):
                attempted_start = True
                if port == 0 and cfg.num_replica_groups > 1:
                    raise ConfigurationError(
                        "ftlaunch rendezvous: --rdzv-endpoint with port 0 cannot be shared by "
                        f"{cfg.num_replica_groups} replica groups; give a fixed port or start a lighthouse"
                    )
                self._hosted = self._host_lighthouse(host, port)
                if self._hosted is not None:
                    addr = self._hosted.address
                    break
                continue  # someone else on this machine bound it first: connect to theirs
            if time.monotonic() > deadline:
                raise RendezvousConnectionError(
                    f"ftlaunch rendezvous: no lighthouse answered at {addr} within "
                    f"{wait:g}s (start one with `ftlaunch-lighthouse`, or run this node on "
                    "the endpoint host so it starts one)"
                )
            time.sleep(0.2)
        self._lighthouse_addr = addr
        logger.info("ftlaunch rendezvous: replica group %d uses lighthouse %s", cfg.replica_group_id, addr)
        return addr

    @staticmethod
    def _read_lighthouse_file(path: str, deadline: float) -> str:
        while True:
            try:
                with open(path) as f:
                    text = f.read().strip()
                if text:
                    return _lighthouse_url(text, f"the address in {path}")
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise RendezvousConnectionError(
                    f"ftlaunch rendezvous: the lighthouse address file {path} did not appear in time"
                )
            time.sleep(0.1)

    def _host_lighthouse(self, host: str, port: int) -> HostedLighthouse | None:
        settings = self.config.lighthouse_settings
        if not settings.bind:
            settings = dataclasses.replace(settings, bind=format_host_port(host, port))
        from ftlaunch.lighthouse.server import UnauthenticatedBindError

        try:
            hosted = HostedLighthouse.start(settings)
        except UnauthenticatedBindError as e:  # not a lost race: every agent would be refused the same
            raise ConfigurationError(
                f"ftlaunch rendezvous: {e}. Give every node the same token: token=... in --rdzv-conf or "
                f"${env.FTLAUNCH_TOKEN}"
            ) from None
        except (OSError, ConfigurationError) as e:
            # Typically "address in use": another node on this machine won the race; use theirs.
            logger.info(
                "ftlaunch rendezvous: could not host the lighthouse on %s (%s); connecting", settings.bind, e
            )
            return None
        logger.warning(
            "ftlaunch rendezvous: no lighthouse answered at %s:%d, so this agent (pid %d) hosts one at %s. "
            "It is a single point of failure: if this agent dies, every replica group loses its lighthouse.",
            host,
            port,
            os.getpid(),
            hosted.address,
        )
        return hosted

    def _stop_hosted_lighthouse(self) -> None:
        hosted, self._hosted = self._hosted, None
        if hosted is not None:
            hosted.stop(linger=self.config.lighthouse_linger)

    def _publish_env(self, addr: str, advertised: str) -> None:
        cfg = self.config
        # Published once `_ensure_lighthouse` found it answering: the workers wait out an outage.
        job = env.JobEnv(
            cfg.replica_group_id,
            cfg.num_replica_groups,
            addr,
            cfg.token,
            cfg.spares,
            lighthouse_reached=True,
            local_addr=advertised,
        )
        env.publish(job.to_environ())
        env.publish(cfg.checkpoint.to_environ())


def _remove_file(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _inner_params(params: RendezvousParameters, cfg: FtRendezvousConfig, run_id: str) -> RendezvousParameters:
    conf = {k: v for k, v in params.config.items() if k in _INNER_KEYS and k != "rank"}
    local_addr = params.local_addr
    if cfg.group_endpoint.startswith("file:"):
        endpoint = cfg.group_endpoint[len("file:") :]
        conf["store_type"] = "file"
    elif cfg.group_endpoint:
        endpoint = cfg.group_endpoint
    elif params.max_nodes == 1:
        # A one-node group needs nobody to find it: its rendezvous store binds a free loopback port.
        # (The workers' store, which other groups reach, is published under the node's address.)
        endpoint = "127.0.0.1:0"
        conf["is_host"] = "true"
        local_addr = local_addr or "127.0.0.1"
    else:
        raise ConfigurationError(
            f"ftlaunch rendezvous: replica group {cfg.replica_group_id} spans up to "
            f"{params.max_nodes} nodes, "
            "so its nodes need a meeting point: add group_endpoint=HOST:PORT (or "
            "group_endpoint=file:/shared/path) "
            "to --rdzv-conf"
        )
    return RendezvousParameters(
        backend="c10d",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=local_addr,
        **conf,
    )


def create_rdzv_handler(params: RendezvousParameters) -> FtlaunchRendezvousHandler:
    """torchelastic's creator signature: ``RendezvousParameters -> RendezvousHandler``."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    cfg = FtRendezvousConfig.from_params(params)
    run_id = params.run_id if params.run_id not in ("", "none") else "ftlaunch"
    group_run_id = f"{run_id}-{env.replica_id(cfg.replica_group_id)}"
    inner_params = _inner_params(params, cfg, group_run_id)
    backend, store = create_backend(inner_params)
    inner = dynamic_rendezvous.create_handler(store, backend, inner_params)
    local_addr = params.local_addr or env.local_addr()  # --local-addr, else FTLAUNCH_LOCAL_ADDR
    return FtlaunchRendezvousHandler(
        cfg, inner, params.endpoint, group_run_id, local_addr, PrefixStore("ftlaunch-rounds/", store)
    )


def register() -> None:
    """Register the backend in-process (for when the package's entry points are not installed)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    try:
        rendezvous_handler_registry.register(BACKEND_NAME, _creator)
    except ValueError:
        pass  # already registered (by the entry point) -- with the same creator or a newer one
