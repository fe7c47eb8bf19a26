"""Output that survives a full disk: a worker's or the supervisor's stream whose writes fail with
ENOSPC (or a quota / file-size limit) drops the text instead of raising.

Why: the launcher's workers write their stdout and stderr to files in the log directory
(torchelastic's redirects), so when that disk fills up every ``print`` of every worker raised
``OSError: [Errno 28]`` at the same moment: all groups crashed, restarted, and crashed again --
a full log disk ended the job. Training must not depend on its logs being written. A guarded
stream keeps training going, says once (on the stream itself, as soon as it can be written again)
how much output was lost, and stays out of the way otherwise: every other error still raises.

Torch-free: `ftlaunch.bootstrap.prestart` guards a worker's streams before the script runs.
"""

from __future__ import annotations

import errno
import sys
from typing import Any, TextIO

__all__ = ["FULL_DISK_ERRNOS", "FullDiskTolerantStream", "guard_std_streams", "is_full_disk"]

#: The errors of a write to a full disk, an exhausted quota, or past RLIMIT_FSIZE.
FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def is_full_disk(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in FULL_DISK_ERRNOS


class FullDiskTolerantStream:
    """A text stream that forwards to ``inner`` and drops what a full disk refuses.

    While writes fail it counts the characters dropped; the first write that succeeds afterwards
    is preceded by one line saying how many were lost and why, so the gap in the log is explained
    exactly once per episode. Attributes it does not define (``fileno``, ``isatty``, ``encoding``,
    ``buffer``...) are the inner stream's.
    """

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner
        self.dropped = 0
        self.episodes = 0
        self._reason = ""

    @property
    def inner(self) -> TextIO:
        return self._inner

    def write(self, text: str) -> int:
        if self.dropped:
            note = (
                f"[ftlaunch] {self.dropped} characters of output were dropped here: {self._reason}; "
                "training went on\n"
            )
            try:
                self._inner.write(note)
                self._inner.flush()
            except OSError as e:
                return self._drop(text, e)
            self.dropped = 0
        try:
            return self._inner.write(text)
        except OSError as e:
            return self._drop(text, e)

    def _drop(self, text: str, e: OSError) -> int:
        if not is_full_disk(e):
            raise e
        if not self.dropped:
            self.episodes += 1
            self._reason = f"{e.strerror or e} (errno {e.errno})"
        self.dropped += len(text)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._inner.flush()
        except OSError as e:
            if not is_full_disk(e):
                raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def guard_std_streams() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` full-disk tolerant (idempotent)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, FullDiskTolerantStream):
            setattr(sys, name, FullDiskTolerantStream(stream))
