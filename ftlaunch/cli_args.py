"""What both command lines (``ftlaunch`` and ``ftlaunch-lighthouse``) parse the same way.

The launcher logs a hosted lighthouse's errors verbatim and users read errors on small terminals, so
a bad flag is one line that names the program and points at ``--help`` - not argparse's usage block,
which pushes the message off screen. The typed value parsers raise `argparse.ArgumentTypeError`, so
argparse puts the flag's name in front of the message. Durations and counts are read with the
environment's grammar and bounds (`ftlaunch.env.Duration`, `ftlaunch.env.Count`): ``--heartbeat-timeout
30s`` reads as ``FTLAUNCH_TIMEOUT=30s`` does, and what a setting refuses it refuses on every path.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn, TypeVar

from ftlaunch.env import Count, Duration

T = TypeVar("T")

#: How ``--help`` names the duration grammar.
DURATION_GRAMMAR = "a duration in seconds, or with an s/m suffix: 30, 30s, 1.5m"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line: ``PROG: error: MESSAGE (see PROG --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def integer(text: str) -> int:
    """Any integer; range checks belong to the option's own validation."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _argument(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type`` from a parser whose ValueError message is the reason."""

    def argument(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r} {e}") from None

    return argument


def duration(bounds: Duration) -> Callable[[str], float]:
    """An argparse ``type``: a duration (`ftlaunch.env.duration_seconds`) within ``bounds``."""
    return _argument(bounds.parse)


def count(bounds: Count) -> Callable[[str], int]:
    """An argparse ``type``: an integer within ``bounds``."""
    return _argument(bounds.parse)


def milliseconds(bounds: Duration) -> Callable[[str], float]:
    """An argparse ``type`` for torchft's ``*_ms`` flags: a number of milliseconds, returned in
    seconds, within ``bounds`` (given in seconds)."""

    def parse(text: str) -> float:
        try:
            ms = float(text)
        except ValueError:
            raise ValueError("is not a number of milliseconds") from None
        try:
            return bounds.check(ms / 1000.0)
        except ValueError as e:
            raise ValueError(f"ms {e}") from None

    return _argument(parse)


def duration_help(what: str, bounds: Duration, default: str = "%(default)s") -> str:
    """``what (a duration: seconds, or ...; 0.5 s to 24 h; default 5)`` for ``--help``."""
    return f"{what} ({DURATION_GRAMMAR}; {bounds.describe()}; default {default})"
