"""Health checks before a group (re)joins, as the lighthouse sees them (docs/launcher.md, *Health
checks*): what each group's agent reported of its check, kept by `HealthBook`, which the membership
holds and shows in ``/status``, ``/metrics``, the dashboard's history and the launcher's summary.

Why here: a group whose node is sick before it starts fails again and again -- or worse, joins
and drags or corrupts the others. Its agent runs the check before the group's workers start or
restart and keeps it out while the check fails (ftlaunch/launcher/health_gate.py); the job trains
on without it. Nobody watching that agent's log would know, so the agent tells the lighthouse, and
everything that shows the job's state shows it: which check, the last line it printed, how often
it failed, when it runs again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Longest check name and output line kept (a command line, one line of its output).
MAX_TEXT = 500


@dataclass(frozen=True)
class HealthReport:
    """One run of a group's health check, as its agent sends it (``POST /health``)."""

    check: str
    ok: bool
    #: The last line of its output (stdout and stderr together), or what ended it (a timeout).
    last_line: str = ""
    #: Seconds until the agent runs it again (a failure); None once it passed.
    retry_in: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "ok": self.ok, "last_line": self.last_line, "retry_in": self.retry_in}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HealthReport:
        """The report in a request body; ValueError (the reason) for a malformed one."""
        check, ok, last, retry = d.get("check", ""), d.get("ok"), d.get("last_line", ""), d.get("retry_in")
        if not isinstance(check, str) or not isinstance(last, str):
            raise ValueError("check and last_line must be strings")
        if not isinstance(ok, bool):
            raise ValueError("ok must be true or false")
        if retry is not None and (
            isinstance(retry, bool) or not isinstance(retry, (int, float)) or retry < 0
        ):
            raise ValueError("retry_in must be a number of seconds >= 0 or null")
        return cls(check[:MAX_TEXT], ok, last[:MAX_TEXT], None if retry is None else float(retry))


@dataclass(frozen=True)
class HealthStatus:
    """A group's health check as its agent last reported it (lighthouse/health.py): which check,
    whether its last run passed, that run's last output line, and how often it failed."""

    replica_id: str
    check: str = ""
    ok: bool = True
    #: The last line the last run printed (its reason, for a failure), or what ended it (a timeout).
    last_line: str = ""
    #: Runs that failed, in all; and in a row up to the last report (0: it passed).
    failures: int = 0
    streak: int = 0
    #: Unix time of the last report, and of the first failure of the current streak (None: passing).
    time: float = 0.0
    failing_since: float | None = None
    #: Seconds until the agent runs it again (a failure), None once it passed.
    retry_in: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "check": self.check,
            "ok": self.ok,
            "last_line": self.last_line,
            "failures": self.failures,
            "streak": self.streak,
            "time": self.time,
            "failing_since": self.failing_since,
            "retry_in": self.retry_in,
        }

    @classmethod
    def from_json(cls, d: Any) -> HealthStatus:
        """ValueError (the reason) for a malformed entry."""
        if not isinstance(d, dict):
            raise ValueError(f"a health entry must be a JSON object, got {type(d).__name__}")

        def get(name: str, types: tuple[type, ...], default: Any = ...) -> Any:
            if name not in d:
                if default is ...:
                    raise ValueError(f"status field {name!r} is missing")
                return default
            value = d[name]
            if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
                raise ValueError(
                    f"status field {name!r} must be {types[0].__name__}, got {type(value).__name__}"
                )
            return value

        return cls(
            replica_id=get("replica_id", (str,)),
            check=get("check", (str,), ""),
            ok=get("ok", (bool,), True),
            last_line=get("last_line", (str,), ""),
            failures=get("failures", (int,), 0),
            streak=get("streak", (int,), 0),
            time=float(get("time", (float, int), 0.0)),
            failing_since=_opt_float(get("failing_since", (float, int, type(None)), None)),
            retry_in=_opt_float(get("retry_in", (float, int, type(None)), None)),
        )


def _opt_float(value: float | int | None) -> float | None:
    return None if value is None else float(value)


@dataclass
class _Entry:
    check: str = ""
    ok: bool = True
    last_line: str = ""
    failures: int = 0
    streak: int = 0
    time: float = 0.0
    failing_since: float | None = None
    retry_in: float | None = None


#: What a report changed, for the history: the group's check began failing, or passed after failures.
FAILING, RECOVERED = "health_failed", "health_passed"


class HealthBook:
    """Each group's last health report, and its failures (the only writer: the membership, under
    its lock). Entries outlive the groups: a group kept out never joins, and that is the news."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def report(self, replica_id: str, report: HealthReport, wall: float) -> str | None:
        """Record ``report``; `FAILING` when it starts a run of failures, `RECOVERED` when it
        passes after failures, else None (a failure more, or a pass as usual)."""
        e = self._entries.setdefault(replica_id, _Entry())
        was_failing = e.streak > 0
        e.check, e.ok, e.last_line, e.time, e.retry_in = (
            report.check,
            report.ok,
            report.last_line,
            wall,
            report.retry_in,
        )
        if report.ok:
            e.streak, e.failing_since, e.retry_in = 0, None, None
            return RECOVERED if was_failing else None
        e.failures += 1
        e.streak += 1
        if not was_failing:
            e.failing_since = wall
            return FAILING
        return None

    def entry(self, replica_id: str) -> HealthStatus | None:
        e = self._entries.get(replica_id)
        return None if e is None else _status(replica_id, e)

    def snapshot(self) -> tuple[HealthStatus, ...]:
        return tuple(_status(rid, e) for rid, e in sorted(self._entries.items()))


def _status(replica_id: str, e: _Entry) -> HealthStatus:
    return HealthStatus(
        replica_id, e.check, e.ok, e.last_line, e.failures, e.streak, e.time, e.failing_since, e.retry_in
    )
