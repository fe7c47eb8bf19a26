"""A process's lifetime: tied to its parent's (Linux ``prctl``: the one home of that system call),
and ended by a stop signal its main loop waits for (`StopSignals`).

Two places need ``prctl``: the launcher (an agent must die with the supervisor; the supervisor
adopts its agents' orphaned workers as a *child subreaper*) and the Baby process group's child (it
must never outlive the training process that owns it). Elsewhere than Linux the calls return False
and callers fall back on their own watchdogs. `StopSignals` serves the processes that run until
SIGTERM or SIGINT (``ftlaunch-lighthouse``, the torchx roles).
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


class StopSignals:
    """SIGTERM and SIGINT as a stop request that a main loop waits for (main thread only).

    Why not the usual ``signal.signal(sig, lambda *_: event.set())`` with ``event.wait(t)`` in a
    loop: a Python signal handler runs on the main thread between two of its bytecodes, and
    `threading.Event.set` takes the event's lock, which the main thread itself holds for a moment
    in every `Event.wait` call (`Condition._acquire_restore`). A signal landing in that moment
    hangs the process for good: once in 300-1,000 signals with a 10 µs wait
    (tests/processes/test_lifetime.py), rarely with a 1 s wait but more often on a loaded host -- a lighthouse
    or a torchx role that a scheduler can no longer stop. The handler here stores the signal number and writes
    a byte to a
    pipe: nothing that can block, so `wait` wakes at once.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        #: The first stop signal received (None: none yet).
        self.received: int | None = None
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._old = {sig: signal.signal(sig, self._on_signal) for sig in signals}

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.received is None:
            self.received = signum
        try:
            os.write(self._w, b"\0")
        except OSError:  # the pipe is full (a signal storm) or closed: the number above is enough
            pass

    def wait(self, timeout: float | None = None) -> bool:
        """Whether a stop signal has arrived, waiting for one up to ``timeout`` seconds (None: for ever)."""
        if self.received is None:
            select.select([self._r], [], [], timeout)
        return self.received is not None

    def close(self) -> None:
        """Put the previous handlers back (idempotent)."""
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._r = self._w = -1

    def __enter__(self) -> StopSignals:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
