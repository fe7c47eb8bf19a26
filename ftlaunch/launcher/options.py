"""The launcher's settings (`LaunchOptions`) and the ``--chaos`` specification (`ChaosSpec`).

Both are plain data validated on construction, so the CLI, tests and the torchx components build
them the same way and every mistake is a one-line `ConfigurationError`.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from signal import Signals

from ftlaunch.errors import ConfigurationError

CHAOS_SIGNALS = ("KILL", "STOP", "TERM", "INT", "SEGV", "MIX")
#: What ``signal=MIX`` picks from at each injection: (signal, target).
CHAOS_MIX = (("KILL", "workers"), ("STOP", "workers"), ("KILL", "agent"))
CHAOS_TARGETS = ("workers", "agent")

CHAOS_HELP = """\
fault injection, a comma-separated list of key=value:
  every=SECONDS    inject every SECONDS of training (counted from the first step line)
  steps=A/B/C      inject when the job reaches step A, then B, then C
  group=G          always hit replica group G (default: a random live group)
  signal=KILL      KILL (default), STOP (SIGSTOP, then SIGCONT after stop_for), TERM, INT, SEGV
  target=workers   workers (default: the group's agent restarts them) or agent (the supervisor respawns it)
  count=N          at most N injections
  stop_for=SECONDS how long a SIGSTOP lasts (default 5)
  start=SECONDS    with every=: count from launch + SECONDS instead of from the first step line
  seed=S           seed of the random group choice
A bare number is every=NUMBER. Never hits the last healthy group, nor after a group has finished."""


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

    def __post_init__(self) -> None:
        if self.lighthouse is not None and not self.lighthouse_down > 0:
            raise ConfigurationError(f"--chaos lighthouse_down={self.lighthouse_down} must be > 0")
        if self.every is None and not self.steps and self.lighthouse is not None:
            return  # only the lighthouse crash
        if self.every is None and not self.steps:
            raise ConfigurationError("--chaos needs every=SECONDS or steps=A/B/...")
        if self.every is not None and not self.every > 0:
            raise ConfigurationError(f"--chaos every={self.every} must be > 0")
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
        if not self.stop_for > 0:
            raise ConfigurationError(f"--chaos stop_for={self.stop_for} must be > 0")
        if self.target == "agent" and self.signal == "STOP":
            raise ConfigurationError("--chaos signal=STOP applies to workers, not target=agent")

    @property
    def signum(self) -> Signals:  # not signal.Signals: the `signal` field shadows the module here
        return signal.Signals[f"SIG{self.signal}"]

    @property
    def kinds(self) -> tuple[tuple[str, str], ...]:
        """The (signal, target) pairs an injection picks from: one, or `CHAOS_MIX` for ``signal=MIX``."""
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
                return cls(every=_positive_float("every", text))
        kwargs: dict[str, object] = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key, value = key.strip().replace("-", "_"), value.strip()
            if not sep or not value:
                raise ConfigurationError(f"--chaos: {item!r} is not key=value")
            if key in kwargs:
                raise ConfigurationError(f"--chaos: {key} given twice")
            if key in ("every", "stop_for", "start", "lighthouse", "lighthouse_down"):
                kwargs[key] = _positive_float(key, value, allow_zero=key in ("start", "lighthouse"))
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
            elif key == "signal":
                kwargs[key] = value.upper().removeprefix("SIG")
            elif key == "target":
                kwargs[key] = value.lower()
            else:
                raise ConfigurationError(
                    f"--chaos: unknown key {key!r} (every, steps, group, signal, target, count, stop_for, start, seed, "
                    "lighthouse, lighthouse_down)"
                )
        return cls(**kwargs)  # type: ignore[arg-type]


def _positive_float(name: str, value: str, allow_zero: bool = False) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigurationError(f"--chaos {name}={value!r} is not a number") from None
    if number < 0 or (number == 0 and not allow_zero):
        raise ConfigurationError(f"--chaos {name}={value} must be > 0")
    return number


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
        checks = [
            (self.replicas >= 1, f"--replicas must be >= 1 (got {self.replicas})"),
            (self.spares >= 0, f"--spares must be >= 0 (got {self.spares})"),
            (self.nproc_per_node >= 1, f"--nproc-per-node must be >= 1 (got {self.nproc_per_node})"),
            (
                1 <= self.min_replicas <= self.replicas,
                f"--min-replicas must be in 1..{self.replicas} (got {self.min_replicas})",
            ),
            (self.join_timeout > 0, "--join-timeout must be > 0"),
            (self.heartbeat_timeout > 0, "--heartbeat-timeout must be > 0"),
            (self.max_restarts >= 0, f"--max-restarts must be >= 0 (got {self.max_restarts})"),
            (self.max_agent_restarts >= 0, "--max-agent-restarts must be >= 0"),
            (self.monitor_interval > 0, "--monitor-interval must be > 0"),
            (self.grace_period > 0, "--grace-period must be > 0"),
            (self.shutdown_timeout is None or self.shutdown_timeout >= 0, "--shutdown-timeout must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigurationError(message)
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
