"""``--chaos slow=FACTOR``: a replica group's workers made FACTOR x slower, for a while, by a
SIGSTOP/SIGCONT duty cycle.

Why a duty cycle: stopped part of the time, a process is slower at everything it does -- its
compute, its data loading, its own threads -- by the same factor, as behind a throttled GPU or a
noisy neighbour, and the training script needs no hook. The periods are short: `RUN_SLICE` running,
then (FACTOR - 1) x `RUN_SLICE` stopped (20 ms / 20 ms for a factor 2; at most `MAX_FACTOR`, 60 ms
stopped), so that it reads as slowness, not as a hang.

The hung rule. The lighthouse declares a member hung when its heartbeats (sent every 100 ms by a
thread of their own) stopped for half a second or more while a peer waits for it
(lighthouse/hung.py, `QUICK_SILENCE`). One stop delays a heartbeat by 60 ms at most; but the
heartbeat thread is slowed too, and a heartbeat takes it a few turns (the GIL, a request, the
answer), each of which may wait out a stop: slowed 2x or 3x, its gaps stay around 100-300 ms even
on a loaded machine. The harder a group is slowed and the busier its CPU (a stopped process's
running slices are contended as well), the later its heartbeats: past half a second, while a peer
waits for it in a collective, it is declared hung, and handled as such (its peers go on, it
rejoins or a spare takes its slot). Hence the `MAX_FACTOR`; the lighthouse's straggler rule
(lighthouse/stragglers.py) is what is meant to see a slowed group.

Under CPU contention the slowdown reads smaller than FACTOR: a process continued after a stop is
favoured by the scheduler for a while (it slept), taking back part of what the stop cost it.

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
#: The largest slowdown: 60 ms stopped per 20 ms running (see the module docstring: the hung rule).
MAX_FACTOR = 4.0


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
