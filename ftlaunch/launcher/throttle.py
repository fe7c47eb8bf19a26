"""``--chaos slow=FACTOR``: a replica group's workers made FACTOR x slower, for a while, by a
SIGSTOP/SIGCONT duty cycle.

Why a duty cycle: stopped part of the time, a process is slower at everything it does -- its
compute, its data loading, its own threads -- by the same factor, as behind a throttled GPU or a
noisy neighbour, and the training script needs no hook.

Why the stops land in the work. A slow GPU makes a group's compute slow, not its waits: it
arrives late at the step's collectives and commit vote, and its peers wait for it. A stop that lands
while the group itself waits (for a collective its Baby process-group child runs, for the quorum,
for the commit vote) only lengthens that wait: the job is slower, but the group's own work -- what
the lighthouse's straggler rule scores (lighthouse/stragglers.py) -- is not. So the cycle follows the
process's training thread (its main thread, as in any torchrun worker): time counts as work only
while that thread is running or runnable (``R``) or the process uses CPU, the stops owed grow with
that time only, and a stop starts only at a look (every 5 ms) that finds the process working. A
process that waits long (a heal, a quorum) is not stopped meanwhile. And a running phase also ends
where the process starts working again after a wait -- at the start of a step's work: the stop owed
for the work before the wait lands there. Every step's work is then stretched, as behind a slow
GPU, even where it is shorter than `RUN_CPU`; otherwise the stops would gather on one step in a
few, and the median the straggler rule takes would miss them.

Why the running phase is counted in CPU time. Each period lets the processes work until the busiest
has used `RUN_CPU` of CPU time (or for `max_run` of busy wall time, when the CPU is contended),
then stops them (FACTOR - 1) x as long as their busy time in that phase. On an idle CPU that is 20
ms working, 20 ms stopped for a factor 2. On a CPU shared with other runnable processes, a short
stop costs a process nothing: the kernel's scheduler (EEVDF) keeps what it owes a process across a
stop and serves it first when it continues, so 20 ms stops made a group slowed 2x barely slower than
its peers (~1.1x on a loaded 2-core host). Counted in CPU time, the periods lengthen as the CPU
gets busier -- up to `MAX_STOP` stopped -- and a stop then outweighs what the scheduler gives back.
The stops actually slept and the busy time actually run are summed, and each stop makes up the
difference: a late throttle thread (a busy supervisor) shifts the periods, not the factor.

The hung rule. The lighthouse declares a member hung when its heartbeats (sent every 100 ms by a
thread of their own) stopped for half a second or more while a peer waits for it
(lighthouse/hung.py, `QUICK_SILENCE`). One stop delays a heartbeat by `MAX_STOP` (200 ms) at most,
and a slowed group's heartbeats stay under ~300 ms apart; past half a second (a machine so busy
that the heartbeat thread itself waits out several stops), while a peer waits for it in a
collective, it is declared hung and handled as such (its peers go on, it rejoins or a spare takes
its slot). Hence the `MAX_FACTOR`; the lighthouse's straggler rule (lighthouse/stragglers.py) is
what is meant to see a slowed group.

The slowed processes are the workers' own: for a worker forked from the agent's warm standby, the
fork behind the pid torchelastic knows (`procs.worker_processes`), not that pid -- its proxy, which
only waits: counted on the proxy, the cycle would see no work, every running phase would last
`max_run` and every stop the longest (100 ms for a factor 2, 200 ms for 3), mirrored to the fork
up to 50 ms late wherever the fork is -- with steps of ~50 ms (a quiet host) most of them then run
at full speed between two stops, and the median the straggler rule takes sees little slowdown. Their Baby
process-group children keep running, as a slow GPU's network card would. A worker that exits
meanwhile is skipped (psutil checks that a pid still names the same process before it signals it);
when none is left, or the duration is over, or `Throttle.stop` is called, the processes are
continued (always: the last signal is a SIGCONT) and the thread ends.
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
#: Seconds between two looks at the processes' CPU time and state in a running phase.
_POLL = 0.005
#: A look counts the time since the previous one as work when the process is running then, or
#: used this share of that time in CPU.
_BUSY_CPU_SHARE = 0.5


def max_run(factor: float) -> float:
    """The longest running phase (seconds of work) of a process slowed ``factor`` x: 100 ms, less
    for factors over 2, so that its stop stays within `MAX_STOP`."""
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
        worked = slept = 0.0  # the running phases' busy time and the stops' wall time so far
        try:
            while self._processes and not self._stop.is_set() and time.monotonic() < end:
                worked += self._run_phase(longest, end)
                stopped_at = time.monotonic()
                owed = min((self.factor - 1.0) * worked - slept, MAX_STOP, end - stopped_at)
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

    def _run_phase(self, longest: float, end: float) -> float:
        """Let the processes work until the busiest used `RUN_CPU` of CPU time, or they were busy
        ``longest`` seconds, or they start working again after a wait, and one of them is working
        at that look (or until ``end``); returns the seconds they were busy meanwhile."""
        start = last = self._look()
        then = time.monotonic()
        busy = 0.0
        waited = False  # a look found them all waiting after some work
        while not self._stop.wait(_POLL):
            now = time.monotonic()
            looked = self._look()
            working = any(
                running or cpu - last.get(pid, (cpu, False))[0] >= _BUSY_CPU_SHARE * (now - then)
                for pid, (cpu, running) in looked.items()
            )
            resumed = working and waited
            if working:
                busy += now - then
            else:
                waited = busy > 0
            then, last = now, looked
            if now >= end or not looked:
                break
            used = max((cpu - start[pid][0] for pid, (cpu, _) in looked.items() if pid in start), default=0.0)
            if working and (used >= RUN_CPU or busy >= longest or resumed):
                break
        return busy

    def _look(self) -> dict[int, tuple[float, bool]]:
        """Each process's CPU time (user + system, all its threads) and whether its main thread is
        running or runnable, by pid; a process gone (a zombie too) is dropped."""
        out = {}
        alive = []
        for p in self._processes:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    out[p.pid] = (t.user + t.system, p.status() == psutil.STATUS_RUNNING)
                alive.append(p)
            except psutil.Error:  # gone: not looked at again
                continue
        self._processes = alive
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
