"""Tie a process's lifetime to its parent's (Linux ``prctl``): the one home of that system call.

Two places need it: the launcher (an agent must die with the supervisor; the supervisor adopts its
agents' orphaned workers as a *child subreaper*) and the Baby process group's child (it must never
outlive the training process that owns it). Elsewhere than Linux the calls return False and callers
fall back on their own watchdogs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import signal
import threading
import time
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux only; False elsewhere)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(sig: int = signal.SIGTERM, expected_parent: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only).

    If the parent already died before the call (``getppid`` is no longer ``expected_parent``), the
    signal is sent at once: the race between fork and this call cannot leave an orphan.
    """
    ok = _prctl(_PR_SET_PDEATHSIG, int(sig))
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return ok


def on_exit(pid: int, callback: Callable[[], None], name: str = "ftlaunch-on-exit") -> threading.Thread:
    """Call ``callback`` on a daemon thread as soon as process ``pid`` has exited (at once if it is
    already gone).

    Linux: the thread blocks on a pidfd (``pidfd_open``), so the wait costs no wake-ups; elsewhere it
    polls every 0.2 s. This is for what ``PR_SET_PDEATHSIG`` cannot do alone: the signal only starts
    a graceful shutdown, which a stopped child cannot take part in.
    """

    def wait() -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            callback()
            return
        except (AttributeError, OSError):
            while _exists(pid):
                time.sleep(0.2)
            callback()
            return
        try:
            select.select([fd], [], [])
        finally:
            os.close(fd)
        callback()

    thread = threading.Thread(target=wait, name=name, daemon=True)
    thread.start()
    return thread


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
