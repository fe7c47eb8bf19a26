"""What both command lines (``ftlaunch`` and ``ftlaunch-lighthouse``) parse the same way.

The launcher logs a hosted lighthouse's errors verbatim and users read errors on small terminals, so
a bad flag is one line that names the program and points at ``--help`` - not argparse's usage block,
which pushes the message off screen. The typed value parsers raise `argparse.ArgumentTypeError`, so
argparse puts the flag's name in front of the message.
"""

from __future__ import annotations

import argparse
import math
from typing import NoReturn


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


def positive_integer(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def number(text: str) -> float:
    """Any float; range checks belong to the option's own validation."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def nonnegative_number(text: str, unit: str = "") -> float:
    """A finite float >= 0; ``unit`` names what it counts in the error (``seconds``)."""
    try:
        value = float(text)
    except ValueError:
        what = f" of {unit}" if unit else ""
        raise argparse.ArgumentTypeError(f"{text!r} is not a number{what}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value
