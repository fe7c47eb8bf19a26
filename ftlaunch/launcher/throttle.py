"""``--chaos slow=FACTOR``: a replica group's workers made FACTOR x slower, for a while, by a
SIGSTOP/SIGCONT duty cycle.

Why a duty cycle: stopped part of the time, a process is slower at everything it does -- its
compute, its data loading, its own threads -- by the same factor, as behind a throttled GPU or a
noisy neighbour, and the training script needs no hook.

Why the running phase is counted in CPU time. Each period lets the processes run until the busiest
has used `RUN_CPU` of CPU time (or for `max_run` of wall time, when they wait or the CPU is
contended), then stops them (FACTOR - 1) x as long as that running phase took. On an idle CPU that
is 20 ms running, 20 ms stopped for a factor 2. On a CPU shared with other runnable processes, a
short stop costs a process nothing: the kernel's scheduler (EEVDF) keeps what it owes a process
across a stop and serves it first when it continues, so 20 ms stops made a group slowed 2x barely
slower than its peers (~1.1x on a loaded 2-core host). Counted in CPU time, the periods lengthen as
the CPU gets busier -- up to `MAX_STOP` stopped -- and a stop then outweighs what the scheduler gives
back. The stops actually slept and the running phases actually run are summed, and each stop makes
up the difference: a late throttle thread (a busy supervisor) shifts the periods, not the factor.

The hung rule. The lighthouse declares a member hung when its heartbeats (sent every 100 ms by a
thread of their own) stopped for half a second or more while a peer waits for it
(lighthouse/hung.py, `QUICK_SILENCE`). One stop delays a heartbeat by `MAX_STOP` (200 ms) at most,
and a slowed group's heartbeats stay under ~300 ms apart; past half a second (a machine so busy
that the heartbeat thread itself waits out several stops), while a peer waits for it in a
collective, it is declared hung and handled as such (its peers go on, it rejoins or a spare takes
its slot). Hence the `MAX_FACTOR`; the lighthouse's straggler rule (lighthouse/stragglers.py) is
what is meant to see a slowed group.

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

#: CPU seconds the busiest throttled process may use in each running phase.
RUN_CPU = 0.02
#: The longest stop (seconds): far under the hung rule's half second of silence.
MAX_STOP = 0.2
#: The largest slowdown.
MAX_FACTOR = 4.0
#: Seconds between two looks at the processes' CPU time in a running phase.
_POLL = 0.005


def max_run(factor: float) -> float:
    """The longest running phase (seconds) of a process slowed ``factor`` x: 100 ms, less for
    factors over 2, so that its stop stays within `MAX_STOP`."""
    return min(0.1, MAX_STOP / (factor - 1.0))


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
        longest = max_run(self.factor)
        ran = slept = 0.0  # the running phases' and the stops' wall time so far
        try:
            while not self._stop.is_set() and time.monotonic() < end:
                began = time.monotonic()
                self._run_phase(min(longest, end - began))
                stopped_at = time.monotonic()
                ran += stopped_at - began
                owed = min((self.factor - 1.0) * ran - slept, MAX_STOP, end - stopped_at)
                if owed <= 0:
                    continue
                if not self._signal(psutil.Process.suspend):
                    break
                self._stop.wait(owed)
                self._signal(psutil.Process.resume)
                slept += time.monotonic() - stopped_at
                self.periods += 1
        finally:
            self._signal(psutil.Process.resume)
            self.ended = time.monotonic()

    def _run_phase(self, longest: float) -> None:
        """Let the processes run until the busiest used `RUN_CPU` of CPU time, or ``longest`` seconds."""
        until = time.monotonic() + longest
        start = self._cpu()
        while not self._stop.wait(_POLL) and time.monotonic() < until:
            now = self._cpu()
            if max((now.get(pid, t) - t for pid, t in start.items()), default=0.0) >= RUN_CPU:
                return

    def _cpu(self) -> dict[int, float]:
        """Each process's CPU time (user + system, all its threads), by pid."""
        out = {}
        for p in self._processes:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.Error:
                continue
        return out

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
