"""Console output of the supervisor: prefixed lines, a live status line, the summary table.

All writes go through one `Console` owned by the supervisor's main thread, so the one-line status
(drawn only on a terminal) can be erased before a log line and redrawn after it.
"""

from __future__ import annotations

import re
import sys
from typing import TextIO

from ftlaunch.streams import FullDiskTolerantStream

#: ``[rg1/r0] `` -- torchelastic's tee prefix, set by the agent (``log_line_prefix_template``).
WORKER_LINE = re.compile(r"^\[rg(?P<group>\d+)/r(?P<rank>\d+)\] ?")


def without_repeated_tag(line: str) -> str:
    """Drop the worker's own ``[rgG/rR]`` tag from the text after torchelastic's prefix.

    Worker logs often carry the tag themselves (the Manager logs ``[rg1/r0 step 42]`` so lines stay
    readable under torchx or by hand); behind ``[rg1/r0] `` it only repeats itself, so
    ``[rg1/r0] ... [rg1/r0] [rg1/r0 step 42] msg`` is shown as ``[rg1/r0] ... [step 42] msg``.
    A tag of another group or rank is left alone.
    """
    m = WORKER_LINE.match(line)
    if m is None:
        return line
    tag = re.escape(f"rg{m.group('group')}/r{m.group('rank')}")
    rest = re.sub(
        rf"\[{tag}(?: (step \d+))?\] ?", lambda t: f"[{t.group(1)}] " if t.group(1) else "", line[m.end() :]
    )
    return line[: m.end()] + rest


class Console:
    """Line output with an optional status line kept at the bottom of a terminal."""

    def __init__(
        self, out: TextIO | None = None, err: TextIO | None = None, status: bool | None = None
    ) -> None:
        # A full disk under a redirected console drops lines instead of ending the job (streams.py).
        self._out = FullDiskTolerantStream(out or sys.stdout)
        self._err = FullDiskTolerantStream(err or sys.stderr)
        if status is None:
            status = bool(getattr(self._out, "isatty", lambda: False)())
        self.status_enabled = status
        self._status = ""

    def out(self, line: str) -> None:
        self._write(self._out, line)

    def err(self, line: str) -> None:
        self._write(self._err, line)

    def status(self, text: str) -> None:
        if not self.status_enabled:
            return
        self._status = text
        self._out.write("\r\x1b[K" + text)
        self._out.flush()

    def clear_status(self) -> None:
        if self.status_enabled and self._status:
            self._out.write("\r\x1b[K")
            self._out.flush()
            self._status = ""

    def _write(self, stream: FullDiskTolerantStream, line: str) -> None:
        if self.status_enabled and self._status:
            self._out.write("\r\x1b[K")
            self._out.flush()
        try:
            stream.write(line + "\n")
            stream.flush()
        except (BrokenPipeError, ValueError):
            return
        if self.status_enabled and self._status:
            self._out.write(self._status)
            self._out.flush()


def format_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return lines
