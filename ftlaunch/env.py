"""Every environment variable ftlaunch reads or writes: the names, one grammar, one reader.

**Names.** Each variable ftlaunch reads -- its own ``FTLAUNCH_*``, torchelastic's, and the few of
other programs it honours (``LOGLEVEL``, ``CUDA_VISIBLE_DEVICES``, ...) -- is a constant here, and
each ``FTLAUNCH_*`` one has a row in README's table (``tests/processes/test_env.py`` checks both).

**One grammar.** A *flag* is ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any
case); a *duration* is seconds, optionally with an ``s`` or ``m`` (minutes) suffix (``30``,
``30s``, ``1.5m``); a *count* is an integer; an empty value is the same as an unset one. Each
setting also has bounds, and a value outside them is refused, not clamped. The command lines and
``--rdzv-conf`` keys use the same parsers and bounds (`Duration`, `Count`), so ``30s`` means the
same everywhere and ``1e-9`` is refused everywhere.

**One reader.** Nothing outside this module touches ``os.environ`` to read it (the test scans the
source): the worker's values are read once into typed objects -- `JobEnv` (the launcher->worker
contract: the launcher, the rendezvous handler and the torchx components *publish* it with
`JobEnv.to_environ`), `GroupEnv` (torchelastic's), `WorkerEnv` (what the user tunes) and
`SyncEnv` (defaults of ``ft.local_sgd()``/``ft.diloco()``) -- which ``ftlaunch.init`` hands down
as explicit values; the launcher's few knobs have one function each below. A malformed or
out-of-range value is one `ConfigurationError` line naming the variable and what it accepts.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from ftlaunch.errors import ConfigurationError

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
#: Where a worker writes why it failed (torchelastic's error file, JSON), which its agent reads.
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
#: Slurm's count of requeues of this job (set in every task of a requeued job).
SLURM_RESTART_COUNT = "SLURM_RESTART_COUNT"
#: Gloo's own choice of interface (torch reads it; ftlaunch then leaves Gloo's address to it).
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"

# --- other programs' variables ftlaunch honours --------------------------------------------------
#: Log level of the launcher's processes (torchrun's variable): DEBUG, INFO, WARNING, ERROR.
LOGLEVEL = "LOGLEVEL"
#: The interpreter ``ftlaunch`` runs a Python training script with (torchrun's variable).
PYTHON_EXEC = "PYTHON_EXEC"
#: ``""`` or ``-1`` hides every GPU: the worker then builds a Baby Gloo group (`ftlaunch.bootstrap.prestart`).
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
#: Threads per worker; torchrun sets ``1`` for several workers per node, so does ``ftlaunch``.
OMP_NUM_THREADS = "OMP_NUM_THREADS"
#: Written in every agent: the workers' output is not block-buffered in a pipe.
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"
#: Scheduler markers a torchx role tells its placement by (`ftlaunch.launcher.placement`).
SLURM_JOB_ID = "SLURM_JOB_ID"
KUBERNETES_SERVICE_HOST = "KUBERNETES_SERVICE_HOST"
#: torchrun's prefix of a flag's variable (``PET_NPROC_PER_NODE``): set, it overrides our default.
TORCHRUN_FLAG_PREFIX = "PET_"

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
#: What a lighthouse does with slow groups (``ftlaunch.lighthouse.stragglers``): ``report`` (default)
#: or ``replace``; read where no ``--stragglers`` (or rendezvous ``lighthouse_stragglers``) is given.
FTLAUNCH_STRAGGLERS = "FTLAUNCH_STRAGGLERS"
#: A command each group's agent runs before its workers start or restart (``--health-check``; the
#: rendezvous's ``health_check`` key wins): a nonzero exit keeps the group out, retried with backoff.
FTLAUNCH_HEALTH_CHECK = "FTLAUNCH_HEALTH_CHECK"
#: How long one run of the health check may take before it is killed and counted failed.
FTLAUNCH_HEALTH_CHECK_TIMEOUT = "FTLAUNCH_HEALTH_CHECK_TIMEOUT"
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
#: The one timeout knob (a duration); the others derive from it (``ftlaunch.timeouts``).
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
#: A flag set by a launcher that has reached the job's lighthouse (the ``ftlaunch`` supervisor, the
#: rendezvous once it found it): a worker's -- or a respawned agent's -- failed first contact is then
#: an outage to wait out for ``FTLAUNCH_LIGHTHOUSE_OUTAGE``, not a wrong address to report at once.
FTLAUNCH_LIGHTHOUSE_REACHED = "FTLAUNCH_LIGHTHOUSE_REACHED"
#: A flag, default on: off, the groups wait for an unreachable lighthouse (committing nothing)
#: instead of stepping on the last quorum. ``ftlaunch.worker.outage``.
FTLAUNCH_OUTAGE_STEPS = "FTLAUNCH_OUTAGE_STEPS"
#: A group leader whose training thread made no step call for this long (a duration, default 1.5x the
#: collective timeout; 0: off) leaves the lighthouse until it steps again. ``ftlaunch.worker.watchdog``.
FTLAUNCH_PROGRESS_TIMEOUT = "FTLAUNCH_PROGRESS_TIMEOUT"
#: A flag, default on: off, no heal claims (``ftlaunch.worker.plan``: a checksum of the state each
#: up-to-date group would offer, taken when a heal is due; healers copy only from groups whose
#: claims agree). Set it job-wide: while some groups claim, a group that does not serves nobody.
FTLAUNCH_HEAL_CLAIMS = "FTLAUNCH_HEAL_CLAIMS"
#: Defaults of ``ft.diloco()`` / ``ft.local_sgd()`` for what the script does not pass (set by the
#: torchx component ``ftlaunch:diloco``): inner steps per sync, fragments, overlap steps (tau),
#: mixing alpha, and pseudo-gradient bits (0: full precision, 8 or 4).
FTLAUNCH_SYNC_EVERY = "FTLAUNCH_SYNC_EVERY"
FTLAUNCH_FRAGMENTS = "FTLAUNCH_FRAGMENTS"
FTLAUNCH_FRAGMENT_SYNC_DELAY = "FTLAUNCH_FRAGMENT_SYNC_DELAY"
FTLAUNCH_FRAGMENT_UPDATE_ALPHA = "FTLAUNCH_FRAGMENT_UPDATE_ALPHA"
FTLAUNCH_QUANTIZE = "FTLAUNCH_QUANTIZE"
#: Durable checkpoints (`CheckpointEnv`): the directory (unset: none are written or read), the
#: interval in committed steps, and how many complete checkpoints to keep.
FTLAUNCH_CHECKPOINT_DIR = "FTLAUNCH_CHECKPOINT_DIR"
FTLAUNCH_CHECKPOINT_EVERY = "FTLAUNCH_CHECKPOINT_EVERY"
FTLAUNCH_CHECKPOINT_KEEP = "FTLAUNCH_CHECKPOINT_KEEP"
#: Opt-in start-up phase log (`ftlaunch.phases`): a file path every process of the job appends
#: timestamped JSON lines to (worker exit noticed, process start, init, Baby child ready, quorum,
#: configure, heal, first commit). Unset: nothing is recorded.
FTLAUNCH_PHASE_LOG = "FTLAUNCH_PHASE_LOG"
#: A flag, default on: off, no shared torch import in `ftlaunch.bootstrap.prestart` (the worker imports torch
#: before the script runs and forks its Baby child from there): the child is then its own
#: interpreter and imports torch itself, while the script does.
FTLAUNCH_PRESTART_FORK = "FTLAUNCH_PRESTART_FORK"
#: A flag, default on: off, no warm standby interpreter (`ftlaunch.bootstrap.zygote`) per group node
#: (the ``ftlaunch`` launcher's agent, or the ``ftlaunch`` rendezvous inside torchrun's agent for
#: workers run as ``-m ftlaunch.run``): a (re)started worker then imports torch itself instead of
#: being forked, torch imported, from the standby (which costs one idle torch interpreter).
FTLAUNCH_ZYGOTE = "FTLAUNCH_ZYGOTE"
#: Set by the agent (or the rendezvous) for its workers: the Unix socket its standby listens on (internal).
FTLAUNCH_ZYGOTE_SOCKET = "FTLAUNCH_ZYGOTE_SOCKET"
#: Set in a worker forked from the standby: the pid torchelastic started and knows it by (its
#: proxy, which every signal goes through). Absent in a worker started cold: that pid is its own.
FTLAUNCH_WORKER_PID = "FTLAUNCH_WORKER_PID"
#: Where a worker under torchrun's own agent records the configuration error it ends on (set by the
#: ``ftlaunch`` rendezvous, one file per node): the rendezvous reads it when the agent asks for a
#: restart's round, and closes the rendezvous instead of restarting into the same error.
FTLAUNCH_RENDEZVOUS_ERROR_FILE = "FTLAUNCH_RENDEZVOUS_ERROR_FILE"

#: The one timeout knob and its overrides (`ftlaunch.timeouts`).
TIMEOUT_VARS = (
    FTLAUNCH_TIMEOUT,
    FTLAUNCH_COLLECTIVE_TIMEOUT,
    FTLAUNCH_HEAL_TIMEOUT,
    FTLAUNCH_COMMIT_TIMEOUT,
    FTLAUNCH_QUORUM_TIMEOUT,
    FTLAUNCH_CONNECT_TIMEOUT,
)

ALL_FTLAUNCH_VARS = (
    REPLICA_GROUP_ID,
    NUM_REPLICA_GROUPS,
    FTLAUNCH_LIGHTHOUSE,
    TORCHFT_LIGHTHOUSE,
    FTLAUNCH_TOKEN,
    FTLAUNCH_SPARES,
    FTLAUNCH_LIGHTHOUSE_BIND,
    FTLAUNCH_STRAGGLERS,
    FTLAUNCH_HEALTH_CHECK,
    FTLAUNCH_HEALTH_CHECK_TIMEOUT,
    FTLAUNCH_LOCAL_ADDR,
    FTLAUNCH_GROUP_INCARNATION,
    FTLAUNCH_BACKEND,
    FTLAUNCH_TRANSPORT,
    *TIMEOUT_VARS,
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
    FTLAUNCH_CHECKPOINT_DIR,
    FTLAUNCH_CHECKPOINT_EVERY,
    FTLAUNCH_CHECKPOINT_KEEP,
    FTLAUNCH_PHASE_LOG,
    FTLAUNCH_PRESTART_FORK,
    FTLAUNCH_ZYGOTE,
    FTLAUNCH_ZYGOTE_SOCKET,
    FTLAUNCH_WORKER_PID,
    FTLAUNCH_RENDEZVOUS_ERROR_FILE,
)

T = TypeVar("T")
D = TypeVar("D")

# ================================================================================== the grammar
#: What a flag accepts (compared case-insensitively, surrounding blanks ignored).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

_DURATION = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([smSM]?)")
_DURATION_HELP = "use seconds, optionally with an 's' or 'm' (minutes) suffix, e.g. 30, 30s, 1.5m"

#: Longest duration any setting accepts: the lighthouse's longest quorum request, 24 h.
DAY = 24 * 3600.0


def format_seconds(seconds: float) -> str:
    """``10 ms``, ``0.5 s``, ``60 s``, ``24 h``: short and exact enough for a message or ``--help``."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if 0 < seconds < 0.1:
        return f"{seconds * 1000:g} ms"
    return f"{seconds:g} s"


def parse_flag(text: str) -> bool:
    """True for `TRUE_WORDS`, False for `FALSE_WORDS`; ValueError (the reason) for anything else."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"is not a flag: use {', '.join(TRUE_WORDS)} or {', '.join(FALSE_WORDS)}")


def duration_seconds(text: str) -> float:
    """Seconds from ``"30"``, ``"30s"``, ``"2.5"``, ``"1.5m"`` (``s`` = seconds, ``m`` = minutes).

    Surrounding whitespace is ignored; anything else (``"30 sec"``, ``"1h"``, ``"inf"``, ``"nan"``)
    is a ValueError whose message is the reason. Range checks are the caller's (`Duration`)."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"is not a duration: {_DURATION_HELP}")
    value = float(m.group(1))
    value = value * 60.0 if m.group(2).lower() == "m" else value
    if not math.isfinite(value):  # 1e999
        raise ValueError(f"is not a finite duration: {_DURATION_HELP}")
    return value


def parse_duration(text: str, name: str) -> float:
    """`duration_seconds` of environment variable ``name``'s value, or one `ConfigurationError` line."""
    try:
        return duration_seconds(text)
    except ValueError as e:
        raise ConfigurationError(f"environment variable {name}={text!r} {e}") from None


@dataclass(frozen=True)
class Duration:
    """The bounds of one duration setting: ``minimum`` .. ``maximum`` seconds, and exactly 0 for
    "off" when ``off`` is set. Why bounds: a heartbeat timeout of 1 ns expires every group before it
    could beat, a timer tick of 100 ns keeps a core busy, ``inf`` waits forever; each setting states
    the range where it still does what its name says, and refuses the rest."""

    minimum: float
    maximum: float = DAY
    off: bool = False

    def describe(self) -> str:
        """``0.5 s to 24 h`` (``, or 0: off``) -- for ``--help`` and messages."""
        text = f"{format_seconds(self.minimum)} to {format_seconds(self.maximum)}"
        return f"{text}, or 0 (off)" if self.off else text

    def check(self, seconds: object) -> float:
        """``seconds`` as a float if in range; ValueError (the reason) otherwise."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise ValueError(f"is not a number of seconds ({type(seconds).__name__})")
        value = float(seconds)
        if self.off and value == 0:
            return 0.0
        if not (math.isfinite(value) and self.minimum <= value <= self.maximum):
            raise ValueError(f"is out of range: use a duration of {self.describe()}")
        return value

    def parse(self, text: str) -> float:
        """The grammar (`duration_seconds`), then `check`; ValueError (the reason) otherwise."""
        return self.check(duration_seconds(text))

    def checked(self, seconds: object, what: str) -> float:
        """`check` for a value passed in code: `ConfigurationError` ``what=value is out of range``."""
        try:
            return self.check(seconds)
        except ValueError as e:
            raise ConfigurationError(f"{what}={seconds!r} {e}") from None


@dataclass(frozen=True)
class Count:
    """The bounds of one integer setting: ``minimum`` .. ``maximum`` (None: no upper bound)."""

    minimum: int
    maximum: int | None = None

    def describe(self) -> str:
        return f"{self.minimum} or more" if self.maximum is None else f"{self.minimum} to {self.maximum}"

    def check(self, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"is not an integer ({type(value).__name__})")
        if value < self.minimum or (self.maximum is not None and value > self.maximum):
            raise ValueError(f"is out of range: use an integer {self.describe()}")
        return value

    def parse(self, text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError("is not an integer") from None
        return self.check(value)

    def checked(self, value: object, what: str) -> int:
        try:
            return self.check(value)
        except ValueError as e:
            raise ConfigurationError(f"{what}={value!r} {e}") from None


#: Any integer >= 0 / >= 1 (ids, sizes, restart counts: the checks that relate them come later).
NONNEGATIVE = Count(0)
POSITIVE = Count(1)
#: A TCP port.
PORT = Count(0, 65535)

# ================================================================================== the readers
# Every read of the process environment in ftlaunch goes through `_get` (``environ`` replaces
# ``os.environ``: tests, or another process's environment).


def _get(name: str, environ: Mapping[str, str] | None) -> str | None:
    """The value of ``name`` exactly as set; None when unset."""
    return (os.environ if environ is None else environ).get(name)


def _raw(name: str, environ: Mapping[str, str] | None) -> str | None:
    """The value of ``name``, surrounding blanks removed; None when unset or empty."""
    value = _get(name, environ)
    return (value.strip() or None) if value is not None else None


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``name`` has a non-empty value."""
    return _raw(name, environ) is not None


def text(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of ``name`` as is (blanks stripped); None when unset or empty."""
    return _raw(name, environ)


def _read(name: str, parse: Callable[[str], T], default: D, environ: Mapping[str, str] | None) -> T | D:
    """``parse`` of the value of ``name`` (its ValueError the reason in one `ConfigurationError`
    line naming the variable); ``default`` when unset or empty."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError as e:
        raise ConfigurationError(f"environment variable {name}={raw!r} {e}") from None


def flag(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """A flag (`parse_flag`); ``default`` when unset or empty."""
    return _read(name, parse_flag, default, environ)


def duration(
    name: str, bounds: Duration, default: float | None, environ: Mapping[str, str] | None = None
) -> float | None:
    """A duration (`duration_seconds`) within ``bounds``; ``default`` when unset or empty."""
    return _read(name, bounds.parse, default, environ)


def count(
    name: str,
    default: int | None = None,
    bounds: Count = NONNEGATIVE,
    environ: Mapping[str, str] | None = None,
) -> int | None:
    """An integer within ``bounds``; ``default`` when unset or empty."""
    return _read(name, bounds.parse, default, environ)


def number(
    name: str, low: float, high: float, default: float, environ: Mapping[str, str] | None = None
) -> float:
    """A finite decimal number in ``low`` .. ``high``; ``default`` when unset or empty."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError("is not a number") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise ValueError(f"is out of range: use a number from {low:g} to {high:g}")
        return value

    return _read(name, parse, default, environ)


def choice(name: str, allowed: tuple[str, ...], environ: Mapping[str, str] | None = None) -> str | None:
    """One of ``allowed`` (lower case, ``_`` read as ``-``); None when unset or empty."""

    def parse(text: str) -> str:
        value = text.lower().replace("_", "-")
        if value not in allowed:
            raise ValueError(f"is not one of {', '.join(allowed)}")
        return value

    return _read(name, parse, None, environ)


def path(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """A file system path (``~`` expanded); None when unset or empty."""
    raw = _raw(name, environ)
    return None if raw is None else os.path.expanduser(raw)


# --- writers: what a process publishes to the children it starts --------------------------------
def publish(values: Mapping[str, str]) -> None:
    """Set ``values`` in this process's environment, which the children it starts inherit."""
    os.environ.update(values)


def unpublish(name: str) -> None:
    """Remove ``name`` from this process's environment (its later children do not see it)."""
    os.environ.pop(name, None)


def inherited() -> dict[str, str]:
    """A copy of this process's whole environment, to hand to a child as the base of its own."""
    return dict(os.environ)


def mirror(environ: Mapping[str, str]) -> None:
    """Make this process's environment exactly ``environ`` (a Baby child takes its worker's, which
    the script may have changed after the child was forked: ``NCCL_*``, ``GLOO_*``)."""
    for key in [k for k in os.environ if k not in environ]:
        del os.environ[key]
    for key, value in environ.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


# ================================================================ the launcher's and a process's
#: Log levels ``LOGLEVEL`` accepts.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(default: str, environ: Mapping[str, str] | None = None, *, lenient: bool = False) -> str:
    """``LOGLEVEL`` (any case) or ``default``; `ConfigurationError` for a level logging lacks, or
    ``default`` with ``lenient`` (a process the user does not start: its launcher refused it already)."""
    try:
        level = choice(LOGLEVEL, tuple(x.lower() for x in LOG_LEVELS), environ)
    except ConfigurationError:
        if lenient:
            return default
        raise
    return default if level is None else level.upper()


def python_exec() -> str:
    """The interpreter a Python training script runs under: ``PYTHON_EXEC``, else this one."""
    return path(PYTHON_EXEC) or sys.executable


def gpus_hidden(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``CUDA_VISIBLE_DEVICES`` hides every GPU (set to ``""`` or ``-1``)."""
    value = _get(CUDA_VISIBLE_DEVICES, environ)  # set but empty counts here
    return value is not None and value.strip() in ("", "-1")


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The devices ``CUDA_VISIBLE_DEVICES`` lists (indices or UUIDs, in its order); ``[]`` when it
    hides every GPU; None when it is unset (every GPU of the machine is visible)."""
    value = _get(CUDA_VISIBLE_DEVICES, environ)
    if value is None:
        return None
    if value.strip() in ("", "-1"):
        return []
    return [d.strip() for d in value.split(",") if d.strip()]


def omp_num_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """``OMP_NUM_THREADS`` as a positive integer; None when unset, empty or not one (torch then
    keeps its own choice, as OpenMP itself ignores a value it cannot read)."""
    raw = _raw(OMP_NUM_THREADS, environ)
    return int(raw) if raw is not None and raw.isdigit() and int(raw) > 0 else None


def job_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The job token (``FTLAUNCH_TOKEN``); None when unset or empty."""
    return text(FTLAUNCH_TOKEN, environ)


def lighthouse_bind(environ: Mapping[str, str] | None = None) -> str | None:
    """Where a lighthouse the launcher or the rendezvous starts binds (``FTLAUNCH_LIGHTHOUSE_BIND``)."""
    return text(FTLAUNCH_LIGHTHOUSE_BIND, environ)


#: The straggler policies (``--stragglers``; ``ftlaunch.lighthouse.stragglers``).
STRAGGLER_POLICIES = ("report", "replace")


def stragglers(environ: Mapping[str, str] | None = None) -> str | None:
    """``FTLAUNCH_STRAGGLERS``: a straggler policy, None when unset (`ConfigurationError` for others)."""
    return choice(FTLAUNCH_STRAGGLERS, STRAGGLER_POLICIES, environ)


#: ``FTLAUNCH_HEALTH_CHECK_TIMEOUT`` (and ``--health-check-timeout``): 0.1 s .. 1 h.
HEALTH_CHECK_TIMEOUT = Duration(0.1, 3600.0)
#: Seconds one run of the health check may take by default (a small CUDA op, a file write, a request).
DEFAULT_HEALTH_CHECK_TIMEOUT = 60.0


def health_check(environ: Mapping[str, str] | None = None) -> str | None:
    """``FTLAUNCH_HEALTH_CHECK``: the command a group's agent runs before its workers (re)start."""
    return text(FTLAUNCH_HEALTH_CHECK, environ)


def health_check_timeout(environ: Mapping[str, str] | None = None) -> float:
    """``FTLAUNCH_HEALTH_CHECK_TIMEOUT`` (`HEALTH_CHECK_TIMEOUT`), else `DEFAULT_HEALTH_CHECK_TIMEOUT`."""
    value = duration(
        FTLAUNCH_HEALTH_CHECK_TIMEOUT, HEALTH_CHECK_TIMEOUT, DEFAULT_HEALTH_CHECK_TIMEOUT, environ
    )
    assert value is not None  # noqa: S101 - has a default
    return value


def health_check_environ(command: str | None, timeout: float | None) -> dict[str, str]:
    """What the launcher writes in each agent's environment for ``--health-check`` (and its timeout)."""
    out = {FTLAUNCH_HEALTH_CHECK: command} if command else {}
    if command and timeout is not None:
        out[FTLAUNCH_HEALTH_CHECK_TIMEOUT] = f"{timeout:g}"
    return out


def zygote_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """``FTLAUNCH_ZYGOTE`` (a flag, default on): whether the agent keeps a standby interpreter."""
    return flag(FTLAUNCH_ZYGOTE, True, environ)


def error_file(environ: Mapping[str, str] | None = None) -> str | None:
    """The file torchelastic asks this worker to record its failure in (``TORCHELASTIC_ERROR_FILE``;
    None outside torchelastic)."""
    return path(TORCHELASTIC_ERROR_FILE, environ)


def rendezvous_error_file(environ: Mapping[str, str] | None = None) -> str | None:
    """The file the ``ftlaunch`` rendezvous asks this worker to record a configuration error in
    (``FTLAUNCH_RENDEZVOUS_ERROR_FILE``; None: not under torchrun's own agent)."""
    return path(FTLAUNCH_RENDEZVOUS_ERROR_FILE, environ)


def zygote_socket(environ: Mapping[str, str] | None = None) -> str | None:
    """The standby interpreter's socket the agent announced (``FTLAUNCH_ZYGOTE_SOCKET``)."""
    return path(FTLAUNCH_ZYGOTE_SOCKET, environ)


def prestart_fork(environ: Mapping[str, str] | None = None) -> bool:
    """``FTLAUNCH_PRESTART_FORK`` (a flag, default on): import torch once and fork the Baby child."""
    return flag(FTLAUNCH_PRESTART_FORK, True, environ)


def phase_log(environ: Mapping[str, str] | None = None) -> str | None:
    """The opt-in phase log's path (``FTLAUNCH_PHASE_LOG``); None: off."""
    return path(FTLAUNCH_PHASE_LOG, environ)


def phase_tags(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Who writes a phase record: the replica group, rank and restart as this process's environment
    spells them (raw text: a diagnostic records what it finds, it does not validate)."""
    return {
        "replica": text(REPLICA_GROUP_ID, environ),
        "rank": text(RANK, environ),
        "restart": text(TORCHELASTIC_RESTART_COUNT, environ),
    }


#: How long a group leader waits out an unreachable lighthouse by default (seconds): a scheduler
#: restarting the lighthouse's container can take minutes, and waiting costs nothing but the wait.
DEFAULT_LIGHTHOUSE_OUTAGE = 300.0
#: ``FTLAUNCH_LIGHTHOUSE_OUTAGE``: 0 (give up after the connect timeout) .. 24 h.
LIGHTHOUSE_OUTAGE = Duration(0.0, DAY)
#: ``FTLAUNCH_PROGRESS_TIMEOUT``: 0 (off), else 1 s .. 24 h -- shorter than a step would make a
#: healthy leader leave the lighthouse at every step.
PROGRESS_TIMEOUT = Duration(1.0, DAY, off=True)


def lighthouse_outage(environ: Mapping[str, str] | None = None) -> float:
    """``FTLAUNCH_LIGHTHOUSE_OUTAGE`` (`LIGHTHOUSE_OUTAGE`), else `DEFAULT_LIGHTHOUSE_OUTAGE`."""
    value = duration(FTLAUNCH_LIGHTHOUSE_OUTAGE, LIGHTHOUSE_OUTAGE, DEFAULT_LIGHTHOUSE_OUTAGE, environ)
    assert value is not None  # has a default
    return value


def local_addr(environ: Mapping[str, str] | None = None) -> str | None:
    """This node's address for the job's other hosts, when set (`FTLAUNCH_LOCAL_ADDR`)."""
    return text(FTLAUNCH_LOCAL_ADDR, environ)


def slurm_restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How often Slurm requeued this job (0 outside Slurm or on its first run)."""
    return count(SLURM_RESTART_COUNT, 0, environ=environ) or 0


def gloo_interface_chosen(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``GLOO_SOCKET_IFNAME`` picks Gloo's interface (then torch's choice stands)."""
    return is_set(GLOO_SOCKET_IFNAME, environ)


def incarnation_environ(incarnation: int) -> dict[str, str]:
    """What the rendezvous sets for the workers of one round (`FTLAUNCH_GROUP_INCARNATION`)."""
    return {FTLAUNCH_GROUP_INCARNATION: str(incarnation)}


def lighthouse_reached(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher reached the job's lighthouse before (``FTLAUNCH_LIGHTHOUSE_REACHED``)."""
    return flag(FTLAUNCH_LIGHTHOUSE_REACHED, False, environ)


def lighthouse_address(environ: Mapping[str, str] | None = None) -> str | None:
    """The lighthouse address from the environment (ours first, torchft's as fallback)."""
    return text(FTLAUNCH_LIGHTHOUSE, environ) or text(TORCHFT_LIGHTHOUSE, environ)


def timeout_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The timeout variables that are set (``FTLAUNCH_TIMEOUT`` and the five overrides), as text:
    `ftlaunch.timeouts.Timeouts.derive` parses them (`parse_duration`) and reports every problem
    of the set at once, with where each value came from."""
    return {name: value for name in TIMEOUT_VARS if (value := text(name, environ)) is not None}


def replica_id(replica_group_id: int) -> str:
    """The lighthouse's name for replica group ``replica_group_id`` (the one place it is spelled)."""
    return f"rg{replica_group_id}"


#: The fix named when a worker finds no job: one line, the three ways in (README, *Three ways in*).
HOW_TO_LAUNCH = (
    "Launch the script with `ftlaunch --replicas 2 train.py`, `torchrun --rdzv-backend ftlaunch "
    "--rdzv-endpoint HOST:PORT --rdzv-conf replica_group_id=G,num_replica_groups=N train.py` or "
    "`torchx run -s local_cwd ftlaunch:hsdp --replicas 2 --script train.py`; "
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
        if self.num_replica_groups < 1:
            raise ConfigurationError(f"{NUM_REPLICA_GROUPS}={self.num_replica_groups} must be >= 1")
        if self.spares < 0:
            raise ConfigurationError(f"{FTLAUNCH_SPARES}={self.spares} must be >= 0")
        if not 0 <= self.replica_group_id < self.num_replica_groups + self.spares:
            spares = f", {FTLAUNCH_SPARES}={self.spares}" if self.spares else ""
            raise ConfigurationError(
                f"replica group id {self.replica_group_id} is outside "
                f"0..{self.num_replica_groups + self.spares - 1} "
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
        group = replica_group_id if replica_group_id is not None else count(REPLICA_GROUP_ID, environ=environ)
        addr = lighthouse or lighthouse_address(environ)
        missing = [
            name for name, value in ((REPLICA_GROUP_ID, group), (FTLAUNCH_LIGHTHOUSE, addr)) if value is None
        ]
        if missing:
            raise ConfigurationError(
                f"found no ftlaunch job: {' and '.join(missing)} not set. {HOW_TO_LAUNCH}"
            )
        num = num_replica_groups
        if num is None:
            num = count(NUM_REPLICA_GROUPS, bounds=POSITIVE, environ=environ)
        if num is None:
            raise ConfigurationError(f"{NUM_REPLICA_GROUPS} is not set. {HOW_TO_LAUNCH}")
        assert group is not None and addr is not None  # narrowed by the checks above
        spares = count(FTLAUNCH_SPARES, 0, environ=environ) or 0
        token = token if token is not None else job_token(environ)
        return cls(group, num, addr, token, spares, lighthouse_reached(environ), local_addr(environ))

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
        if not 0 <= self.rank < self.world_size:
            raise ConfigurationError(f"{RANK}={self.rank} is outside {WORLD_SIZE}={self.world_size}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> GroupEnv:
        restart = count(TORCHELASTIC_RESTART_COUNT, 0, environ=environ) or 0
        return cls(
            rank=count(RANK, 0, environ=environ) or 0,
            world_size=count(WORLD_SIZE, 1, POSITIVE, environ) or 1,
            master_addr=text(MASTER_ADDR, environ),
            master_port=count(MASTER_PORT, None, PORT, environ),
            restart_count=restart,
            incarnation=count(FTLAUNCH_GROUP_INCARNATION, restart, environ=environ) or 0,
        )


#: Cross-group process-group backends ``ftlaunch.init`` builds (``backend=`` or ``FTLAUNCH_BACKEND``).
BACKENDS = ("baby-gloo", "baby-nccl", "gloo", "nccl")
#: Live-recovery transports (``transport=`` or ``FTLAUNCH_TRANSPORT``).
TRANSPORTS = ("pg", "http")


def backend(environ: Mapping[str, str] | None = None) -> str | None:
    """``FTLAUNCH_BACKEND``, one of `BACKENDS`; None when unset."""
    return choice(FTLAUNCH_BACKEND, BACKENDS, environ)


@dataclass(frozen=True)
class WorkerEnv:
    """What the user tunes in every worker through the environment; the defaults when unset.

    ``ftlaunch.init`` reads it once and hands it to the Manager (a Manager built without it, torchft's
    long form, reads it then: `ftlaunch.worker.defaults`).
    """

    #: ``FTLAUNCH_BACKEND`` / ``FTLAUNCH_TRANSPORT``; None: ``ftlaunch.init`` picks.
    backend: str | None = None
    transport: str | None = None
    #: ``FTLAUNCH_OUTAGE_STEPS``: step on the last quorum while the lighthouse is unreachable.
    outage_steps: bool = True
    #: ``FTLAUNCH_HEAL_CLAIMS``: make heal claims (`ftlaunch.worker.plan`).
    heal_claims: bool = True
    #: ``FTLAUNCH_LIGHTHOUSE_OUTAGE``: seconds a leader waits out an unreachable lighthouse (0: none).
    lighthouse_outage: float = DEFAULT_LIGHTHOUSE_OUTAGE
    #: ``FTLAUNCH_PROGRESS_TIMEOUT``: seconds without a step call before the leader leaves (0: off;
    #: None: 1.5x the collective timeout, `ftlaunch.worker.watchdog`).
    progress_timeout: float | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        return cls(
            backend=backend(environ),
            transport=choice(FTLAUNCH_TRANSPORT, TRANSPORTS, environ),
            outage_steps=flag(FTLAUNCH_OUTAGE_STEPS, True, environ),
            heal_claims=flag(FTLAUNCH_HEAL_CLAIMS, True, environ),
            lighthouse_outage=lighthouse_outage(environ),
            progress_timeout=duration(FTLAUNCH_PROGRESS_TIMEOUT, PROGRESS_TIMEOUT, None, environ),
        )


#: Pseudo-gradient bits ``FTLAUNCH_QUANTIZE`` accepts (0: full precision).
QUANTIZE_BITS = ("0", "4", "8")


@dataclass(frozen=True)
class SyncEnv:
    """Defaults of ``ft.local_sgd()`` / ``ft.diloco()`` for what the script does not pass (the torchx
    component ``ftlaunch:diloco`` sets them); the relations between them are the algorithm's checks."""

    sync_every: int = 100
    fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    #: Pseudo-gradient bits: 0 (full precision), 8 or 4.
    quantize: int = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SyncEnv:
        d = cls()
        bits = choice(FTLAUNCH_QUANTIZE, QUANTIZE_BITS, environ)
        return cls(
            sync_every=count(FTLAUNCH_SYNC_EVERY, d.sync_every, POSITIVE, environ) or d.sync_every,
            fragments=count(FTLAUNCH_FRAGMENTS, d.fragments, POSITIVE, environ) or d.fragments,
            fragment_sync_delay=count(FTLAUNCH_FRAGMENT_SYNC_DELAY, d.fragment_sync_delay, environ=environ)
            or 0,
            fragment_update_alpha=number(
                FTLAUNCH_FRAGMENT_UPDATE_ALPHA, 0.0, 1.0, d.fragment_update_alpha, environ
            ),
            quantize=int(bits) if bits is not None else d.quantize,
        )


@dataclass(frozen=True)
class CheckpointEnv:
    """Durable checkpoints of the job (``ftlaunch --checkpoint-dir``, the rendezvous conf and the
    torchx components publish them; ``ftlaunch.init(checkpoint_dir=...)`` overrides them).

    ``directory`` None: no durable checkpoints. ``every``: committed steps between two saves (0:
    none written, the newest is still resumed from). ``keep_last``: complete checkpoints kept (0: all).
    """

    directory: str | None = None
    every: int = 100
    keep_last: int = 3

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> CheckpointEnv:
        d = cls()
        every = count(FTLAUNCH_CHECKPOINT_EVERY, d.every, environ=environ)
        keep = count(FTLAUNCH_CHECKPOINT_KEEP, d.keep_last, environ=environ)
        return cls(
            directory=path(FTLAUNCH_CHECKPOINT_DIR, environ),
            every=d.every if every is None else every,
            keep_last=d.keep_last if keep is None else keep,
        )

    def to_environ(self) -> dict[str, str]:
        """The variables a launcher sets in every worker (nothing without a directory)."""
        if not self.directory:
            return {}
        return {
            FTLAUNCH_CHECKPOINT_DIR: self.directory,
            FTLAUNCH_CHECKPOINT_EVERY: str(self.every),
            FTLAUNCH_CHECKPOINT_KEEP: str(self.keep_last),
        }


@dataclass(frozen=True)
class ProcessMarks:
    """What a launcher reads in *another* process's environment (psutil's snapshot of it) to tell its
    workers apart: lenient, since it is not ours to validate -- a value that does not read is None."""

    replica_group_id: int | None
    rank: int | None
    local_rank: int | None
    restart_count: int
    #: torchelastic started it (``TORCHELASTIC_RUN_ID`` is set): a worker, not a helper process.
    torchelastic: bool
    #: Forked from the warm standby: the pid torchelastic knows it by (its proxy; None: not forked).
    worker_pid: int | None = None
    #: Its torchelastic error file (``TORCHELASTIC_ERROR_FILE``), where it records why it failed.
    error_file: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ProcessMarks:
        """From ``environ`` (another process's, psutil's ``environ()``), else this process's."""

        def integer(name: str) -> int | None:
            raw = _raw(name, environ)
            return int(raw) if raw is not None and raw.lstrip("-").isdigit() else None

        return cls(
            replica_group_id=integer(REPLICA_GROUP_ID),
            rank=integer(RANK),
            local_rank=integer(LOCAL_RANK),
            restart_count=integer(TORCHELASTIC_RESTART_COUNT) or 0,
            torchelastic=is_set(TORCHELASTIC_RUN_ID, environ),
            worker_pid=integer(FTLAUNCH_WORKER_PID),
            error_file=_raw(TORCHELASTIC_ERROR_FILE, environ),
        )


def normalize_lighthouse(address: str, what: str = "lighthouse address") -> str:
    """``host:port`` or ``http://host:port`` -> ``http://host:port``; `ConfigurationError` otherwise."""
    from ftlaunch.addresses import parse_address

    try:
        return parse_address(address, allow_http=True).url
    except (ValueError, TypeError) as e:
        raise ConfigurationError(f"{what}={address!r} is not a lighthouse address: {e}") from None
