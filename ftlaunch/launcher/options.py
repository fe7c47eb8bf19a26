"""The launcher's settings (`LaunchOptions`) and the ``--chaos`` specification (`ChaosSpec`).

Both are plain data validated on construction, so the CLI, tests and the torchx components build
them the same way and every mistake is a one-line `ConfigurationError`.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from signal import Signals

from ftlaunch.env import DAY, STRAGGLER_POLICIES, Count, Duration
from ftlaunch.errors import ConfigurationError
from ftlaunch.launcher.throttle import MAX_FACTOR
from ftlaunch.lighthouse.quorum import HEARTBEAT_TIMEOUT, JOIN_TIMEOUT

CHAOS_SIGNALS = ("KILL", "STOP", "TERM", "INT", "SEGV", "MIX")
#: What ``signal=MIX`` picks from at each injection: (signal, target).
CHAOS_MIX = (("KILL", "workers"), ("STOP", "workers"), ("KILL", "agent"))
CHAOS_TARGETS = ("workers", "agent")
#: The largest ``slow=`` factor (its stops stay far from a hang: `ftlaunch.launcher.throttle`).
MAX_SLOW = MAX_FACTOR

#: Replica groups (with the hot spares) one ``ftlaunch`` starts on this machine: each is an agent,
#: its workers and their Baby children, so a mistyped ``--replicas 100000`` would fork the machine
#: to a standstill before the first error.
MAX_GROUPS = 1024
GROUPS = Count(1, MAX_GROUPS)
SPARES = Count(0, MAX_GROUPS)
#: Workers per replica group on this machine.
NPROC_PER_NODE = Count(1, 1024)
#: How often an agent looks at its workers (torchrun's ``--monitor-interval``): below 10 ms the
#: agents mostly poll.
MONITOR_INTERVAL = Duration(0.01, 60.0)
#: ``--grace-period``: the groups' time to stop after SIGTERM/SIGINT before SIGKILL (the agents get
#: a second less each); an hour is already more than any checkpoint-on-exit needs.
GRACE_PERIOD = Duration(1.0, 3600.0)
#: ``--shutdown-timeout`` (whole seconds, torchrun's type).
SHUTDOWN_TIMEOUT = Count(0, 3600)
#: ``--chaos``: the pauses (``every``, ``stop_for``, ``lighthouse_down``) and the offsets from the
#: start (``start``, ``lighthouse``, which may be 0).
CHAOS_PAUSE = Duration(0.01, DAY)
CHAOS_OFFSET = Duration(0.0, DAY)

CHAOS_HELP = """\
fault injection, a comma-separated list of key=value:
  every=SECONDS    inject every SECONDS of training (counted from the first step line; 30, 30s, 1.5m)
  steps=A/B/C      inject when the job reaches step A, then B, then C
  group=G          always hit replica group G (default: a random live group)
  signal=KILL      KILL (default), STOP (SIGSTOP, then SIGCONT after stop_for), TERM, INT, SEGV
  target=workers   workers (default: the group's agent restarts them) or agent (the supervisor respawns it)
  count=N          at most N injections
  stop_for=SECONDS how long a SIGSTOP lasts (default 5)
  start=SECONDS    with every=: count from launch + SECONDS instead of from the first step line
  seed=S           seed of the random group choice
  slow=FACTOR      slow the group's workers down FACTOR x (1 < FACTOR <= 4) instead of a signal: a
                   SIGSTOP/SIGCONT duty cycle landing in their work, stopped (FACTOR-1) x as long
                   as each step's work or 20 ms of CPU time took (on a busy CPU the periods
                   lengthen: up to 200 ms stopped); their waits are not slowed
  slow_for=SECONDS how long a slowdown lasts (default 30), then the workers run free again
A bare number is every=NUMBER. Durations: 10 ms to 24 h (start, lighthouse: from 0).
Never hits the last healthy group, nor after a group has finished.
e.g. steps=20,group=1,slow=2,slow_for=60: group 1 runs at half speed from step 20 for a minute."""


@dataclass(frozen=True)
class ChaosSpec:
    every: float | None = None
    steps: tuple[int, ...] = ()
    group: int | None = None
    signal: str = "KILL"
    target: str = "workers"
    count: int | None = None
    stop_for: float = 5.0
    start: float | None = None
    seed: int | None = None
    #: Crash the lighthouse the launcher hosts once, this many seconds after training started...
    lighthouse: float | None = None
    #: ... and keep it down this long before the launcher restarts it on the same address.
    lighthouse_down: float = 12.0
    #: Instead of a signal, slow the group's workers down this many times (`launcher.throttle`)...
    slow: float | None = None
    #: ... for this long.
    slow_for: float = 30.0

    def __post_init__(self) -> None:
        for name, bounds in (
            ("every", CHAOS_PAUSE),
            ("stop_for", CHAOS_PAUSE),
            ("lighthouse_down", CHAOS_PAUSE),
            ("slow_for", CHAOS_PAUSE),
            ("start", CHAOS_OFFSET),
            ("lighthouse", CHAOS_OFFSET),
        ):
            value = getattr(self, name)
            if value is not None:
                bounds.checked(value, f"--chaos {name}")
        if self.every is None and not self.steps and self.lighthouse is not None:
            return  # only the lighthouse crash
        if self.every is None and not self.steps:
            raise ConfigurationError("--chaos needs every=SECONDS or steps=A/B/...")
        if any(s < 0 for s in self.steps):
            raise ConfigurationError("--chaos steps must be >= 0")
        if self.signal not in CHAOS_SIGNALS:
            raise ConfigurationError(
                f"--chaos signal={self.signal} must be one of {', '.join(CHAOS_SIGNALS)}"
            )
        if self.target not in CHAOS_TARGETS:
            raise ConfigurationError(
                f"--chaos target={self.target} must be one of {', '.join(CHAOS_TARGETS)}"
            )
        if self.count is not None and self.count < 1:
            raise ConfigurationError(f"--chaos count={self.count} must be >= 1")
        if self.group is not None and self.group < 0:
            raise ConfigurationError(f"--chaos group={self.group} must be >= 0")
        if self.target == "agent" and self.signal == "STOP":
            raise ConfigurationError("--chaos signal=STOP applies to workers, not target=agent")
        if self.slow is not None:
            if not 1.0 < self.slow <= MAX_SLOW:
                raise ConfigurationError(
                    f"--chaos slow={self.slow:g} must be > 1 and <= {MAX_SLOW:g} (times slower)"
                )
            if self.signal != "KILL" or self.target != "workers":
                raise ConfigurationError(
                    "--chaos slow= slows the group's workers down: it takes no signal= or target="
                )

    @property
    def signum(self) -> Signals:  # not signal.Signals: the `signal` field shadows the module here
        return signal.Signals[f"SIG{self.signal}"]

    @property
    def kinds(self) -> tuple[tuple[str, str], ...]:
        """The (signal, target) pairs an injection picks from: one, or `CHAOS_MIX` for ``signal=MIX``
        (``SLOW``: the workers slowed down, ``slow=``)."""
        if self.slow is not None:
            return (("SLOW", "workers"),)
        return CHAOS_MIX if self.signal == "MIX" else ((self.signal, self.target),)

    @classmethod
    def parse(cls, text: str) -> ChaosSpec:
        text = text.strip()
        if not text:
            raise ConfigurationError("--chaos is empty; e.g. --chaos every=10 or --chaos steps=20/40,group=1")
        if "=" not in text and "," not in text:
            try:
                float(text)
            except ValueError:
                pass
            else:
                return cls(every=_seconds("every", text, CHAOS_PAUSE))
        kwargs: dict[str, object] = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key, value = key.strip().replace("-", "_"), value.strip()
            if not sep or not value:
                raise ConfigurationError(f"--chaos: {item!r} is not key=value")
            if key in kwargs:
                raise ConfigurationError(f"--chaos: {key} given twice")
            if key in ("every", "stop_for", "start", "lighthouse", "lighthouse_down", "slow_for"):
                kwargs[key] = _seconds(
                    key, value, CHAOS_OFFSET if key in ("start", "lighthouse") else CHAOS_PAUSE
                )
            elif key == "steps":
                try:
                    kwargs[key] = tuple(sorted(int(s) for s in value.replace(":", "/").split("/") if s))
                except ValueError:
                    raise ConfigurationError(
                        f"--chaos steps={value!r}: expected integers like 20/40/60"
                    ) from None
            elif key in ("group", "count", "seed"):
                try:
                    kwargs[key] = int(value)
                except ValueError:
                    raise ConfigurationError(f"--chaos {key}={value!r} is not an integer") from None
            elif key == "slow":
                try:
                    kwargs[key] = float(value.lower().removesuffix("x"))
                except ValueError:
                    raise ConfigurationError(
                        f"--chaos slow={value!r} is not a number (times slower, e.g. 2)"
                    ) from None
            elif key == "signal":
                kwargs[key] = value.upper().removeprefix("SIG")
            elif key == "target":
                kwargs[key] = value.lower()
            else:
                raise ConfigurationError(
                    f"--chaos: unknown key {key!r} (every, steps, group, signal, target, count, "
                    "stop_for, start, seed, "
                    "slow, slow_for, lighthouse, lighthouse_down)"
                )
        if "slow" in kwargs and ("signal" in kwargs or "target" in kwargs):
            raise ConfigurationError(
                "--chaos slow= slows the group's workers down: it takes no signal= or target="
            )
        return cls(**kwargs)  # type: ignore[arg-type]


def _seconds(name: str, value: str, bounds: Duration) -> float:
    try:
        return bounds.parse(value)
    except ValueError as e:
        raise ConfigurationError(f"--chaos {name}={value!r} {e}") from None


@dataclass
class LaunchOptions:
    """What ``ftlaunch`` runs: N replica groups of ``nproc_per_node`` workers each, on this machine."""

    entrypoint: str
    args: list[str] = field(default_factory=list)
    run_path: bool = False
    replicas: int = 2
    #: Hot spares: extra groups that start, build their process groups and wait to replace a failed one.
    spares: int = 0
    nproc_per_node: int = 1
    min_replicas: int = 1
    join_timeout: float = 60.0
    heartbeat_timeout: float = 5.0
    #: A worker stopped by a signal is killed at once (its group restarts) instead of waited for.
    kill_stopped: bool = False
    #: The hosted lighthouse's straggler policy, ``report`` or ``replace`` (None: not given, then
    #: ``FTLAUNCH_STRAGGLERS``, else ``report``).
    stragglers: str | None = None
    #: The command each group's agent runs before its workers (re)start (launcher/health_gate.py),
    #: and how long one run may take (None: ``FTLAUNCH_HEALTH_CHECK_TIMEOUT``, else 60 s).
    health_check: str | None = None
    health_check_timeout: float | None = None
    lighthouse: str | None = None
    lighthouse_bind: str = "127.0.0.1:0"
    token: str | None = None
    max_restarts: int = 3
    max_agent_restarts: int = 3
    monitor_interval: float = 0.02
    role: str = "default"
    start_method: str = "spawn"
    log_dir: str | None = None
    redirects: str = "0"
    tee: str = "3"
    local_ranks_filter: str = ""
    #: torchrun's flags that ftlaunch passes to every group's agent unchanged (see `torchrun_flags`).
    event_log_handler: str = "null"
    duplicate_stdout_filters: list[str] = field(default_factory=list)
    duplicate_stderr_filters: list[str] = field(default_factory=list)
    local_addr: str | None = None
    logs_specs: str | None = None
    numa_binding: str | None = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    virtual_local_rank: bool = False
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    run_id: str = ""
    shutdown_timeout: int | None = None
    grace_period: float = 15.0
    chaos: ChaosSpec | None = None
    status_line: bool | None = None  # None: only when stdout is a terminal
    summary: bool = True

    def __post_init__(self) -> None:
        for flag, value, bounds in (
            ("--replicas", self.replicas, GROUPS),
            ("--spares", self.spares, SPARES),
            ("--nproc-per-node", self.nproc_per_node, NPROC_PER_NODE),
            ("--max-restarts", self.max_restarts, Count(0)),
            ("--max-agent-restarts", self.max_agent_restarts, Count(0)),
            ("--shutdown-timeout", self.shutdown_timeout, SHUTDOWN_TIMEOUT),
            ("--join-timeout", self.join_timeout, JOIN_TIMEOUT),
            ("--heartbeat-timeout", self.heartbeat_timeout, HEARTBEAT_TIMEOUT),
            ("--monitor-interval", self.monitor_interval, MONITOR_INTERVAL),
            ("--grace-period", self.grace_period, GRACE_PERIOD),
        ):
            if value is not None:
                bounds.checked(value, flag)
        if self.replicas + self.spares > MAX_GROUPS:
            raise ConfigurationError(
                f"--replicas {self.replicas} + --spares {self.spares} is more than the {MAX_GROUPS} "
                "replica groups one ftlaunch starts on a machine"
            )
        if not 1 <= self.min_replicas <= self.replicas:
            raise ConfigurationError(
                f"--min-replicas must be in 1..{self.replicas} (got {self.min_replicas})"
            )
        if self.stragglers is not None and self.stragglers not in STRAGGLER_POLICIES:
            raise ConfigurationError(
                f"--stragglers {self.stragglers!r} must be one of {', '.join(STRAGGLER_POLICIES)}"
            )
        if self.stragglers is not None and self.lighthouse:
            raise ConfigurationError(
                "--stragglers sets the policy of the lighthouse ftlaunch starts; the one at --lighthouse "
                "has its own (ftlaunch-lighthouse --stragglers)"
            )
        if self.local_ranks_filter and not all(
            r.strip().isdigit() for r in self.local_ranks_filter.split(",")
        ):
            raise ConfigurationError(
                f"--local-ranks-filter {self.local_ranks_filter!r}: expected local ranks like 0 or 0,1"
            )
        if (
            self.chaos is not None
            and self.chaos.group is not None
            and self.chaos.group >= self.replicas + self.spares
        ):
            raise ConfigurationError(
                f"--chaos group={self.chaos.group} but there are only {self.replicas + self.spares} groups"
            )

    @property
    def agent_shutdown_timeout(self) -> int:
        """Seconds an agent gives its workers between SIGTERM and SIGKILL: ``--shutdown-timeout``, by
        default a little less than ``--grace-period`` so the agent finishes before the supervisor kills it."""
        if self.shutdown_timeout is not None:
            return self.shutdown_timeout
        return max(1, int(self.grace_period) - 2)
