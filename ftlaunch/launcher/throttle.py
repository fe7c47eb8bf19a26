"""``--chaos slow=FACTOR``: a replica group's workers made FACTOR x slower, for a while, by a
SIGSTOP/SIGCONT duty cycle.

Why a duty cycle: stopped part of the time, a process is slower at everything it does -- its
compute, its data loading, its own threads -- by the same factor, as behind a throttled GPU or a
noisy neighbour, and the training script needs no hook. The periods are short: `RUN_SLICE` running,
then (FACTOR - 1) x `RUN_SLICE` stopped (20 ms / 20 ms for a factor 2; at most `MAX_FACTOR`, 80 ms
stopped), so that it reads as slowness, not as a hang. The lighthouse declares a member hung only
when its heartbeats (sent every 100 ms by a thread of their own) stopped for half a second or more
while a peer waits for it (lighthouse/hung.py, `QUICK_SILENCE`); a stop of 80 ms at most delays a
heartbeat by that much, so the hung rule never fires on a slowed group. The lighthouse's straggler
rule (lighthouse/stragglers.py) is what sees it.

The slowed processes are the workers' own (for a worker forked from the agent's warm standby, the
fork behind the pid torchelastic knows: `procs.worker_processes`); their Baby process-group children
keep running, as a slow host's network card would. A worker that exits meanwhile is skipped (psutil
checks that a pid still names the same process before it signals it); when none is left, or the
duration is over, or `Throttle.stop` is called, the processes are continued (always: the last
signal is a SIGCONT) and the thread ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import psutil

#: Seconds a throttled process runs in each period.
RUN_SLICE = 0.02
#: The largest slowdown (80 ms stopped per 20 ms running: well under the hung rule's half second).
MAX_FACTOR = 5.0


def stop_slice(factor: float) -> float:
    """Seconds a process slowed ``factor`` x is stopped in each period."""
    return (factor - 1.0) * RUN_SLICE


class Throttle:
    """Slows ``processes`` ``factor`` x for ``duration`` seconds, on a thread of its own, from `start`."""

    def __init__(self, processes: Sequence[psutil.Process], factor: float, duration: float) -> None:
        if not 1.0 < factor <= MAX_FACTOR:
            raise ValueError(f"factor must be > 1 and <= {MAX_FACTOR:g}, got {factor}")
        self.pids = tuple(p.pid for p in processes)
        self.factor = factor
        self.duration = duration
        self._processes = list(processes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ftlaunch-chaos-slow")
        #: Monotonic time it started / ended (None: not yet).
        self.started: float | None = None
        self.ended: float | None = None
        #: Stop/continue periods done.
        self.periods = 0

    def start(self) -> Throttle:
        self.started = time.monotonic()
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """End it now (the processes are continued before this returns)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        assert self.started is not None
        end = self.started + self.duration
        stopped = stop_slice(self.factor)
        try:
            while not self._stop.is_set():
                left = end - time.monotonic()
                if left <= 0 or not self._signal(psutil.Process.suspend):
                    break
                self._stop.wait(min(stopped, left))
                self._signal(psutil.Process.resume)
                self.periods += 1
                self._stop.wait(RUN_SLICE)
        finally:
            self._signal(psutil.Process.resume)
            self.ended = time.monotonic()

    def _signal(self, how: object) -> bool:
        """SIGSTOP (``psutil.Process.suspend``) or SIGCONT every process still there; False when
        none is left."""
        alive = []
        for p in self._processes:
            try:
                how(p)  # type: ignore[operator]
                alive.append(p)
            except psutil.Error:  # gone (or its pid reused: psutil refuses to signal another process)
                continue
        self._processes = alive
        return bool(alive)
