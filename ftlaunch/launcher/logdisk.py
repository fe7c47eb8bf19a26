"""The log directory can fill up: the supervisor says so once, and never depends on writing there.

Why: everything of a job's bookkeeping lands in ``--log-dir`` (the workers' stdout/stderr files,
each agent's config and result). Written as if disks never fill, a full log disk would kill the
supervisor with a traceback when it respawns an agent (its config file) and make every worker's
next ``print`` raise (workers' streams are guarded: `ftlaunch.streams`). Here:

* `LogDiskWatch` checks the free space of the log directory every few seconds and reports once
  when it runs out ("output is being dropped, training goes on") and once when space is back;
* `write_or_none` writes a small file there, or returns None on a full disk so the caller can
  hand the contents over another way (the agent's config then travels through its stdin).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ftlaunch.streams import is_full_disk

__all__ = ["LogDiskWatch", "write_or_none"]

#: Free bytes below which the log directory counts as full, and above which it has space again.
FULL_BELOW = 64 << 10
FREE_ABOVE = 1 << 20


class LogDiskWatch:
    """Reports, through ``say``, a log directory that ran out of space (once per episode)."""

    def __init__(self, path: str, say: Callable[[str], None], every: float = 2.0) -> None:
        self.path = path
        self._say = say
        self._every = every
        self._next = 0.0
        self.full = False

    def free_bytes(self) -> int | None:
        try:
            st = os.statvfs(self.path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def poll(self, now: float | None = None, *, force: bool = False) -> None:
        now = time.monotonic() if now is None else now
        if now < self._next and not force:
            return
        self._next = now + self._every
        free = self.free_bytes()
        if free is None:
            return
        if not self.full and free < FULL_BELOW:
            self.full = True
            self._say(
                f"[ftlaunch] WARNING: the log directory {self.path} is full ({free} bytes free): the "
                "workers' "
                "output written there is being dropped; training goes on"
            )
        elif self.full and free > FREE_ABOVE:
            self.full = False
            self._say(f"[ftlaunch] the log directory {self.path} has space again ({free} bytes free)")


def write_or_none(path: str, text: str) -> str | None:
    """Write ``text`` to ``path`` (creating its directory); None when the disk is full."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        if not is_full_disk(e):
            raise
        return None
    return path
