"""One timeout knob, the hierarchy derived from it, and checked overrides.

A fault-tolerant step is bounded by five timeouts. They only bound *hangs*: a dead peer is normally
noticed within milliseconds because its connections close. You set one number, ``timeout`` (``T``,
seconds; argument or ``FTLAUNCH_TIMEOUT``; default 60 s), and the others follow from it:

=============  ===============================  ===========================  ===============================
value          bounds                           derived                      env override
=============  ===============================  ===========================  ===============================
collective     one collective of the cross-     ``T``                        ``FTLAUNCH_COLLECTIVE_TIMEOUT``
               group process group
heal           receiving the full state from a  ``T``                        ``FTLAUNCH_HEAL_TIMEOUT``
               peer (live recovery)
commit         ``should_commit()``: pending     ``T``                        ``FTLAUNCH_COMMIT_TIMEOUT``
               allreduces + the commit vote
quorum         one quorum request to the        ``min(2 T, 24 h)``           ``FTLAUNCH_QUORUM_TIMEOUT``
               lighthouse
connect        reaching the lighthouse or a     ``min(10 s, T / 2)``         ``FTLAUNCH_CONNECT_TIMEOUT``
               store (with retries)
=============  ===============================  ===========================  ===============================

Precedence per value: an argument, else its environment variable, else the derivation. Whatever the
source, the resulting set must obey these rules (`RULES`; the name in front is what error messages
quote):

``finite and > 0``      every value is finite and > 0.
``connect <= quorum``   reaching the lighthouse is part of a quorum request; one connect attempt
                        must fit into it.
``connect <= collective``  reconfiguring the cross-group process group connects to a peer's store
                        inside the step; that must fit into the collective timeout peers wait with.
``heal <= collective``  peers wait in the step's first collective while a healing group receives
                        its state; a longer heal makes them time out and discard the step.
``collective <= quorum``  a group stuck in a collective until it times out must still reach the next
                        quorum before its peers' quorum request gives up.
``commit <= quorum``    peers already waiting for the next quorum must outlast a group's commit.
``quorum <= 24 h``      the lighthouse refuses longer quorum requests.

The derived values obey every rule for every accepted ``T`` (1 ms to 24 h): heal = collective = commit
= T <= min(2T, 24 h) = quorum, and connect = min(10 s, T/2) < T. So only explicit overrides can break a
rule, and `Timeouts.derive` then raises one `ConfigurationError` listing every broken rule, the
values involved and where each came from. A `Timeouts` is checked when it is built, so an instance
that exists is consistent.

The client heartbeat interval is not part of this set: the value it must stay under is the
lighthouse's ``--heartbeat-timeout``, a server option the workers do not know.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import NamedTuple

from ftlaunch import env as _env
from ftlaunch.env import parse_duration
from ftlaunch.errors import ConfigurationError

__all__ = [
    "CONNECT_CAP",
    "DEFAULT_TIMEOUT",
    "ENV_VARS",
    "FORMULAS",
    "FTLAUNCH_TIMEOUT",
    "MAX_QUORUM_TIMEOUT",
    "MIN_TIMEOUT",
    "POSITIVE",
    "RULES",
    "Rule",
    "Timeouts",
    "as_timedelta",
    "parse_duration",
    "to_seconds",
]

#: Environment variable of the one knob ``T`` (a duration, see `ftlaunch.env.parse_duration`).
FTLAUNCH_TIMEOUT = _env.FTLAUNCH_TIMEOUT
#: Per-value overrides, by field name (names owned by `ftlaunch.env`).
ENV_VARS: Mapping[str, str] = {
    "collective": _env.FTLAUNCH_COLLECTIVE_TIMEOUT,
    "heal": _env.FTLAUNCH_HEAL_TIMEOUT,
    "commit": _env.FTLAUNCH_COMMIT_TIMEOUT,
    "quorum": _env.FTLAUNCH_QUORUM_TIMEOUT,
    "connect": _env.FTLAUNCH_CONNECT_TIMEOUT,
}

#: ``T`` when neither the argument nor ``FTLAUNCH_TIMEOUT`` gives one (seconds).
DEFAULT_TIMEOUT = 60.0
#: Smallest accepted ``T``: torch counts its timeouts in milliseconds.
MIN_TIMEOUT = 0.001
#: Largest quorum request the lighthouse accepts (its ``MAX_QUORUM_TIMEOUT``), hence also the largest ``T``.
MAX_QUORUM_TIMEOUT = _env.DAY
#: Upper bound of the derived connect timeout: a reachable host answers a connect in well under that.
CONNECT_CAP = 10.0

#: How each value is derived from ``T`` (shown in messages; `Timeouts.derive` implements it).
FORMULAS: Mapping[str, str] = {
    "collective": "timeout",
    "heal": "timeout",
    "commit": "timeout",
    "quorum": "min(2 x timeout, 24 h)",
    "connect": f"min({CONNECT_CAP:g} s, timeout / 2)",
}


class Rule(NamedTuple):
    """``small <= large`` must hold; ``large`` is a field name or a constant in seconds."""

    small: str
    large: str | float
    why: str

    @property
    def name(self) -> str:
        return f"{self.small} <= {_fmt(self.large) if isinstance(self.large, float) else self.large}"


#: The ordering rules, checked in this order (`POSITIVE` is checked before them, per value).
RULES: tuple[Rule, ...] = (
    Rule(
        "connect",
        "quorum",
        "reaching the lighthouse is part of the quorum request, so one connect attempt must fit into it",
    ),
    Rule(
        "connect",
        "collective",
        "reconfiguring the cross-group process group connects to a peer's store inside the step, "
        "so one connect attempt must fit into the collective timeout the peers wait with",
    ),
    Rule(
        "heal",
        "collective",
        "peers wait in the step's first collective while a healing group receives its state; "
        "a longer heal makes them time out and discard the step",
    ),
    Rule(
        "collective",
        "quorum",
        "a group stuck in a collective until it times out must still reach the next quorum "
        "before its peers' quorum request gives up",
    ),
    Rule(
        "commit",
        "quorum",
        "peers already waiting for the next quorum must outlast a group's commit",
    ),
    Rule("quorum", MAX_QUORUM_TIMEOUT, "the lighthouse refuses longer quorum requests"),
)

#: Name of the first rule, checked per value before the ordering rules.
POSITIVE = "finite and > 0"

_FIELD_ORDER = ("collective", "heal", "commit", "quorum", "connect")


def _fmt(seconds: float) -> str:
    """``60 s``, ``0.5 s``, ``24 h`` -- short and exact enough for a message."""
    if seconds == MAX_QUORUM_TIMEOUT:
        return "24 h"
    return f"{seconds:g} s"


def to_seconds(value: object, what: str = "timeout") -> float:
    """Seconds from a number or a `timedelta`; anything else is misuse (TypeError).

    The one conversion between the two ways torch and torchft spell a duration."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{what} must be seconds (int or float) or a datetime.timedelta, got {value!r}")


def as_timedelta(value: object, what: str = "timeout") -> timedelta:
    """A positive `timedelta` from seconds or a `timedelta` (torchft's Baby groups take floats, the
    others timedeltas); zero or less is a ValueError: torch reads ``timedelta(0)`` as "no timeout"."""
    seconds = to_seconds(value, what)
    if not seconds > 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return timedelta(seconds=seconds)


@dataclass(frozen=True)
class Timeouts:
    """The effective timeouts of one worker, in seconds; consistent by construction.

    Build it with `Timeouts.derive` (one knob, overrides, environment). Constructing it directly
    also validates, so every instance obeys `RULES`. ``sources`` says where each value came from
    (``argument heal=``, ``env FTLAUNCH_HEAL_TIMEOUT``, ``derived: ...``); it does not take part in
    equality.
    """

    collective: float
    heal: float
    commit: float
    quorum: float
    connect: float
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in _FIELD_ORDER:
            object.__setattr__(self, name, to_seconds(getattr(self, name), f"{name} timeout"))
        object.__setattr__(self, "sources", {n: self.sources.get(n, "given") for n in _FIELD_ORDER})
        self.validate()

    # ------------------------------------------------------------------------------- building
    @classmethod
    def derive(
        cls,
        timeout: float | timedelta | None = None,
        *,
        collective: float | timedelta | None = None,
        heal: float | timedelta | None = None,
        commit: float | timedelta | None = None,
        quorum: float | timedelta | None = None,
        connect: float | timedelta | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Timeouts:
        """The hierarchy for one knob ``timeout`` (seconds or `timedelta`), with overrides.

        ``timeout`` comes from the argument, else ``FTLAUNCH_TIMEOUT``, else `DEFAULT_TIMEOUT`; it must
        lie in [1 ms, 24 h]. Each value comes from its argument, else its variable in `ENV_VARS`, else
        `FORMULAS`. ``environ`` replaces ``os.environ`` (tests); an empty variable counts as unset.

        Raises `ConfigurationError` listing every problem at once: unparsable variables, a base
        timeout out of range, and every broken rule with the values and their sources. Passing
        something that is not a number or a `timedelta` is a TypeError.
        """
        env = _env.timeout_settings(environ)  # the ones that are set, as text
        problems: list[str] = []
        args = {
            "collective": collective,
            "heal": heal,
            "commit": commit,
            "quorum": quorum,
            "connect": connect,
        }
        values: dict[str, float | None] = {}
        sources: dict[str, str] = {}

        base, base_src = _base_timeout(timeout, env, problems)
        for name in _FIELD_ORDER:
            var = ENV_VARS[name]
            if args[name] is not None:
                values[name] = to_seconds(args[name], f"{name} timeout")
                sources[name] = f"argument {name}="
            elif env.get(var):
                sources[name] = f"env {var}"
                try:
                    values[name] = parse_duration(env[var], var)
                except ConfigurationError as e:
                    problems.append(str(e))
                    values[name] = None
            else:
                values[name] = None if base is None else _derived(name, base)
                t = f"timeout={'?' if base is None else _fmt(base)}, {base_src}"
                formula = FORMULAS[name]
                sources[name] = f"derived from {t}" if formula == "timeout" else f"derived: {formula}, {t}"

        problems.extend(_check(values, sources))
        if problems:
            raise ConfigurationError(_report(problems, values, sources))
        final = {n: v for n, v in values.items() if v is not None}  # all set when nothing was wrong
        return cls(
            collective=final["collective"],
            heal=final["heal"],
            commit=final["commit"],
            quorum=final["quorum"],
            connect=final["connect"],
            sources=sources,
        )

    # ------------------------------------------------------------------------------- checking
    def validate(self) -> None:
        """Raise `ConfigurationError` naming every broken rule (see `RULES`); no-op when consistent."""
        values: dict[str, float | None] = {n: getattr(self, n) for n in _FIELD_ORDER}
        problems = _check(values, self.sources)
        if problems:
            raise ConfigurationError(_report(problems, values, self.sources))

    # ------------------------------------------------------------------------------- reporting
    def describe(self) -> str:
        """One line with every effective value and its source, for the start-up log."""
        parts = [f"{n}={_fmt(getattr(self, n))} [{self.sources[n]}]" for n in _FIELD_ORDER]
        return "ftlaunch timeouts: " + "; ".join(parts)

    def log(self, logger: logging.Logger | logging.LoggerAdapter, level: int = logging.INFO) -> None:
        """Log `describe` once (the Manager calls this at start-up)."""
        logger.log(level, "%s", self.describe())

    # ------------------------------------------------------------------------------- conversion
    def as_timedelta(self, name: str) -> timedelta:
        """One value as a `timedelta`, e.g. ``t.as_timedelta("collective")`` for a process group."""
        if name not in _FIELD_ORDER:
            raise ValueError(f"unknown timeout {name!r}; one of {', '.join(_FIELD_ORDER)}")
        return timedelta(seconds=getattr(self, name))

    def timedeltas(self) -> dict[str, timedelta]:
        """Every value as a `timedelta`, keyed by field name."""
        return {n: self.as_timedelta(n) for n in _FIELD_ORDER}

    def as_dict(self) -> dict[str, float]:
        """Every value in seconds, keyed by field name (e.g. for a JSON status report)."""
        return {n: getattr(self, n) for n in _FIELD_ORDER}


# ----------------------------------------------------------------------------------- internals
def _base_timeout(
    timeout: float | timedelta | None, env: Mapping[str, str], problems: list[str]
) -> tuple[float | None, str]:
    """``T`` and where it came from; None (with a problem recorded) when unusable."""
    if timeout is not None:
        value, src = to_seconds(timeout, "timeout"), "set by argument timeout="
    elif env.get(FTLAUNCH_TIMEOUT):
        src = f"set by env {FTLAUNCH_TIMEOUT}"
        try:
            value = parse_duration(env[FTLAUNCH_TIMEOUT], FTLAUNCH_TIMEOUT)
        except ConfigurationError as e:
            problems.append(str(e))
            return None, src
    else:
        return DEFAULT_TIMEOUT, "the default"
    if not (math.isfinite(value) and MIN_TIMEOUT <= value <= MAX_QUORUM_TIMEOUT):
        problems.append(
            f"timeout {value:g} s ({src.removeprefix('set by ')}) is out of range: it must be a "
            "finite number of seconds "
            f"between {MIN_TIMEOUT:g} s (torch counts timeouts in milliseconds) and 24 h (the "
            "lighthouse's longest quorum request)"
        )
        return None, src
    return value, src


def _derived(name: str, base: float) -> float:
    if name == "quorum":
        return min(2.0 * base, MAX_QUORUM_TIMEOUT)
    if name == "connect":
        return min(CONNECT_CAP, base / 2.0)
    return base  # collective, heal, commit


def _how_to_change(name: str, source: str) -> str:
    if source.startswith("derived"):
        return f"via `timeout`, or set it with {name}= or {ENV_VARS[name]}"
    if source.startswith("env"):
        return f"{ENV_VARS[name]}"
    if source.startswith("argument"):
        return f"the {name}= argument"
    return f"{name}="


def _check(values: Mapping[str, float | None], sources: Mapping[str, str]) -> list[str]:
    """Every broken rule as one message; values that are None (unparsable) are skipped."""
    problems = []
    ok: dict[str, float] = {}
    for name in _FIELD_ORDER:
        v = values[name]
        if v is None:
            continue
        if not (math.isfinite(v) and v > 0):
            problems.append(
                f"{name} timeout {v:g} s ({sources[name]}) (rule: {POSITIVE}): every timeout must be "
                f"a finite number of seconds. Fix: set {_how_to_change(name, sources[name])} to a "
                "positive duration"
            )
        else:
            ok[name] = v
    for rule in RULES:
        small = ok.get(rule.small)
        large = rule.large if isinstance(rule.large, float) else ok.get(rule.large)
        if small is None or large is None or small <= large:
            continue
        if isinstance(rule.large, float):
            large_desc, large_fix = _fmt(rule.large), ""
        else:
            large_desc = f"{rule.large} timeout {_fmt(large)} ({sources[rule.large]})"
            large_fix = (
                f" or raise the {rule.large} timeout ({_how_to_change(rule.large, sources[rule.large])})"
            )
        problems.append(
            f"{rule.small} timeout {_fmt(small)} ({sources[rule.small]}) > {large_desc} "
            f"(rule: {rule.name}): {rule.why}. Fix: lower the {rule.small} timeout "
            f"({_how_to_change(rule.small, sources[rule.small])}){large_fix}"
        )
    return problems


def _report(problems: list[str], values: Mapping[str, float | None], sources: Mapping[str, str]) -> str:
    """One line for one problem (a worker's error should fit a terminal line); a list for several."""
    known = all(values[n] is not None for n in _FIELD_ORDER)
    effective = "; ".join(
        f"{n}={'?' if values[n] is None else _fmt(values[n])} [{sources.get(n, 'given')}]"  # type: ignore[arg-type]
        for n in _FIELD_ORDER
    )
    if len(problems) == 1:
        return f"invalid ftlaunch timeouts (see docs/timeouts.md): {problems[0]}" + (
            f"; effective: {effective}" if known else ""
        )
    lines = [f"invalid ftlaunch timeouts ({len(problems)} problems) (see docs/timeouts.md):"]
    lines += [f"  - {p}" for p in problems]
    lines.append(f"  effective: {effective}")
    return "\n".join(lines)


# Keep the dataclass field list and the internal order in sync (checked once at import).
assert tuple(f.name for f in fields(Timeouts) if f.name != "sources") == _FIELD_ORDER
