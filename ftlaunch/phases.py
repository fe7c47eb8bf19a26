"""An opt-in log of where a (re)starting group's seconds go, from the failure to its first commit.

Why: "kill -> first committed step" is the sum of many short phases in several processes (the
agent notices the death, restarts the worker, the interpreter imports torch, ``ftlaunch.init``
builds the Manager, the Baby child starts, the quorum, the configure, the heal, the first step).
Guessing which one to cut is how time gets wasted; `scripts/bench_recovery.py` reads this log and
prints the breakdown.

Set ``FTLAUNCH_PHASE_LOG=/path/file.jsonl`` (inherited by agents, workers and Baby children) and
every process of the job appends one JSON line per phase: ``{"t": wall seconds, "phase": name,
"pid": ..., "replica": REPLICA_GROUP_ID, "rank": RANK, ...}``. Lines are written with one
``O_APPEND`` write each (atomic for lines this short), so processes need no coordination. Unset,
`mark` returns at once: nothing is recorded on the training path.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ftlaunch import env

__all__ = ["enabled", "mark", "process_start_time", "read"]


def enabled() -> bool:
    return env.phase_log() is not None


def mark(phase: str, t: float | None = None, **data: Any) -> None:
    """Record that ``phase`` happened now (or at wall time ``t``); no-op unless the log is on.
    Never raises: a diagnostic must not break training."""
    path = env.phase_log()
    if path is None:
        return
    record = {
        "t": time.time() if t is None else t,
        "phase": phase,
        "pid": os.getpid(),
        **env.phase_tags(),
        **data,
    }
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def process_start_time(pid: int | None = None) -> float | None:
    """Wall time the process ``pid`` (default: this one) was created (Linux: from its start in
    clock ticks since boot, 10 ms resolution; psutil's ``create_time`` rounds the boot time to
    whole seconds, too coarse here); None where it cannot be read."""
    try:
        with open(f"/proc/{pid or 'self'}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - (since_boot - started_after_boot)


def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a phase log, in file order (a torn last line is skipped)."""
    out: list[dict[str, Any]] = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except FileNotFoundError:
        return []
    return out
