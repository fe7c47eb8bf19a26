"""``--chaos``: when to inject a fault, whom to hit, and sending the signal.

`ChaosSchedule` says when an injection is due (every N seconds of training, or at given steps) and
`choose_target` whom it may hit; both are pure, so they are unit-tested without processes. `Chaos`
sends the signals, lets SIGSTOPped workers continue after ``stop_for`` and records each injection
for the summary. The spec itself is parsed in `ftlaunch.launcher.options` (`ChaosSpec`).

Safety rules: never the last healthy group (nobody could heal the others), never a group that is
still recovering, and nothing once a group has finished or failed for good (the job is ending).

``signal=MIX`` picks SIGKILL of the workers, SIGSTOP of the workers or SIGKILL of the agent at each
injection. ``slow=FACTOR`` slows the group's workers down instead, for ``slow_for`` seconds
(`ftlaunch.launcher.throttle`: a SIGSTOP/SIGCONT duty cycle in short periods); their stops are no
hang, so `Chaos.throttling` tells the supervisor which stopped workers to leave alone. ``lighthouse=SECONDS``
crashes the lighthouse the launcher hosts once, that long after training started, and keeps it down
``lighthouse_down`` seconds; the supervisor then restarts it on the same address (`LighthouseCrash`, reported
beside the injections).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from ftlaunch import phases
from ftlaunch.launcher import procs
from ftlaunch.launcher.group import FAILED, SUCCEEDED, Group
from ftlaunch.launcher.options import ChaosSpec
from ftlaunch.launcher.output import Console
from ftlaunch.launcher.throttle import RUN_CPU, Throttle

#: Seconds after a slowdown ended in which a report of one of its stops may still arrive (the
#: agent's pipe): such a stop is no hang either.
_STOP_REPORT_S = 2.0


@dataclass
class Injection:
    """One fault injected, and how its victim fared."""

    at: float
    group: int
    signal: str
    target: str
    step: int | None
    #: Seconds from the injection to the victim's next committed step (None: it never committed again).
    rejoined_after: float | None = None
    #: ``SLOW``: how many times slower, and for how long (the planned duration until it ended).
    factor: float | None = None
    lasted: float | None = None

    @property
    def until(self) -> float | None:
        """A slowdown's end: when it ended, else when it is planned to (None: not a slowdown)."""
        return self.at + self.lasted if self.lasted is not None else None


@dataclass
class LighthouseCrash:
    """The one lighthouse crash of ``--chaos lighthouse=``: when, how long it stayed down."""

    at: float
    step: int | None
    #: Seconds until the supervisor restarted it (None: not yet / never).
    down_for: float | None = None


class ChaosSchedule:
    """When the next injection is due: every ``spec.every`` seconds and/or at ``spec.steps``."""

    def __init__(self, spec: ChaosSpec, started: float) -> None:
        self.spec = spec
        self._started = started
        self._next_at: float | None = None
        self._steps = list(spec.steps)

    def due(self, now: float, training_started: float | None, step: int | None) -> bool:
        """Whether to inject now. The clock of ``every`` starts at the first step line (or at
        launch + ``start``); ``steps`` compare against the furthest step of any group."""
        every = self.spec.every
        if every is not None and self._next_at is None:
            origin = self._started + self.spec.start if self.spec.start is not None else training_started
            if origin is not None:
                self._next_at = origin + every
        if self._next_at is not None and now >= self._next_at:
            return True
        return self._step_due(step)

    def injected(self, now: float, step: int | None) -> None:
        """An injection happened: consume the step it was due for and restart the ``every`` clock."""
        if self._step_due(step):
            self._steps.pop(0)
        if self.spec.every is not None and self._next_at is not None and now >= self._next_at:
            self._next_at = now + self.spec.every

    def _step_due(self, step: int | None) -> bool:
        return bool(self._steps) and step is not None and step >= self._steps[0]


def choose_target(
    spec: ChaosSpec,
    groups: Sequence[Group],
    training_started: float | None,
    rng: random.Random,
    busy: Collection[int] = (),
) -> Group | None:
    """The group to hit now, or None when no group can safely be hit (``busy``: groups slowed down
    now, not hit again until that ends)."""
    # Only groups that are training: a group still starting up is not a meaningful target (unless
    # the script prints no step lines at all).
    healthy = [
        g
        for g in groups
        if g.healthy and g.worker_pids and (g.stepped or training_started is None) and g.gid not in busy
    ]
    if spec.group is not None:
        target = groups[spec.group]
        others = [g for g in healthy if g is not target]
        return target if target in healthy and (others or len(groups) == 1) else None
    if len(healthy) < 2 and len(groups) > 1:
        return None  # never take down the last healthy group: nobody could heal the others
    return rng.choice(healthy) if healthy else None


class Chaos:
    """Injects the faults of ``spec`` into ``groups`` on the supervisor's main thread."""

    def __init__(
        self,
        spec: ChaosSpec,
        groups: Sequence[Group],
        console: Console,
        started: float,
        kill: Callable[[int, int], None] = os.kill,
        crash_lighthouse: Callable[[float], bool] | None = None,
        slow: Callable[[Group, int | None], Throttle | None] | None = None,
    ) -> None:
        """``slow(group, agent pid)``: starts the `Throttle` of a ``slow=`` injection (None: no
        process to slow); by default over `procs.worker_processes`."""
        self.spec = spec
        self.injections: list[Injection] = []
        #: ``lighthouse=``: the crash, once it happened.
        self.lighthouse_crash: LighthouseCrash | None = None
        #: Crashes the hosted lighthouse for the given seconds; False if there is none to crash.
        self._crash_lighthouse = crash_lighthouse
        self._groups = groups
        self._console = console
        self._schedule = ChaosSchedule(spec, started)
        self._rng = random.Random(spec.seed)
        self._kill = kill
        self._stopped: dict[int, tuple[list[int], float]] = {}  # group -> (SIGSTOPped pids, resume at)
        self._slow = slow or self._throttle
        #: ``slow=``: the throttle of each group slowed now, and its injection.
        self._throttles: dict[int, tuple[Throttle, Injection]] = {}
        #: Pids a throttle stopped, and until when their stop reports may still arrive (monotonic).
        self._throttled_pids: dict[int, float] = {}

    def tick(self, now: float, training_started: float | None, agent_pids: dict[int, int]) -> None:
        """Resume stopped workers that are due, then inject if an injection is due and safe."""
        self._resume_due(now)
        self._throttles_ended(now)
        spec = self.spec
        if any(g.finishing or g.state in (SUCCEEDED, FAILED) for g in self._groups):
            return  # the job is ending (or degraded): do not pile on
        self._maybe_crash_lighthouse(now, training_started)
        if spec.every is None and not spec.steps:
            return  # only the lighthouse crash
        if spec.count is not None and len(self.injections) >= spec.count:
            return
        step = max((g.last_step for g in self._groups if g.last_step is not None), default=None)
        if not self._schedule.due(now, training_started, step):
            return
        target = choose_target(spec, self._groups, training_started, self._rng, self._throttles)
        if target is None:
            return  # not safe right now (a group is still recovering); try again on the next tick
        if self._inject(target, now, step, agent_pids.get(target.gid)):
            self._schedule.injected(now, step)

    def _maybe_crash_lighthouse(self, now: float, training_started: float | None) -> None:
        spec = self.spec
        if spec.lighthouse is None or self.lighthouse_crash is not None or training_started is None:
            return
        if now < training_started + spec.lighthouse:
            return
        step = max((g.last_step for g in self._groups if g.last_step is not None), default=None)
        self.lighthouse_crash = LighthouseCrash(now, step)
        if self._crash_lighthouse is None or not self._crash_lighthouse(spec.lighthouse_down):
            self._console.err(
                "[ftlaunch] chaos: lighthouse= needs the lighthouse the launcher hosts; not injected"
            )
            return
        self._console.err(
            "[ftlaunch] chaos: lighthouse crashed"
            + (f" at step {step}" if step is not None else "")
            + f"; the launcher restarts it in {spec.lighthouse_down:g}s"
        )

    def lighthouse_restarted(self, now: float) -> None:
        """The supervisor brought the crashed lighthouse back."""
        if self.lighthouse_crash is not None and self.lighthouse_crash.down_for is None:
            self.lighthouse_crash.down_for = now - self.lighthouse_crash.at

    def rejoined(self, gid: int, now: float) -> None:
        """Group ``gid`` committed again after a failure: its pending injections are over."""
        for inj in self.injections:
            if inj.group == gid and inj.rejoined_after is None:
                inj.rejoined_after = now - inj.at

    def forget(self, gid: int) -> None:
        """Group ``gid``'s workers are gone (its agent died): nothing of it is stopped any more."""
        self._stopped.pop(gid, None)
        self._end_throttle(gid, time.monotonic())

    def resume_all(self) -> None:
        """SIGCONT every stopped worker, end every slowdown (before teardown, so they can handle SIGTERM)."""
        for gid in list(self._stopped):
            self._resume(gid)
        for gid in list(self._throttles):
            self._end_throttle(gid, time.monotonic())

    def throttling(self, pid: int, now: float) -> bool:
        """Whether a stop of process ``pid`` reported now is a slowdown's (``slow=``), not a hang:
        a throttle stops it, or did until a moment ago (its last stop's report may still be on its way)."""
        until = self._throttled_pids.get(pid)
        return until is not None and now <= until

    def _throttle(self, group: Group, agent_pid: int | None) -> Throttle | None:
        processes = procs.worker_processes(group.worker_pids.values(), agent_pid)
        if not processes:
            return None
        return Throttle(processes, self.spec.slow or 2.0, self.spec.slow_for).start()

    def _throttles_ended(self, now: float) -> None:
        for gid, (throttle, _) in list(self._throttles.items()):
            if not throttle.running:
                self._end_throttle(gid, now)
        for pid in [pid for pid, until in self._throttled_pids.items() if until < now]:
            del self._throttled_pids[pid]

    def _end_throttle(self, gid: int, now: float) -> None:
        entry = self._throttles.pop(gid, None)
        if entry is None:
            return
        throttle, injection = entry
        throttle.stop()
        ended = throttle.ended if throttle.ended is not None else now
        injection.lasted = max(0.0, ended - injection.at)
        for pid in self._throttled_pids:
            self._throttled_pids[pid] = min(self._throttled_pids[pid], ended + _STOP_REPORT_S)
        self._console.err(
            f"[ftlaunch] chaos: replica group {gid} runs at full speed again after {injection.lasted:.1f}s"
        )

    def _inject(self, group: Group, now: float, step: int | None, agent_pid: int | None) -> bool:
        kinds = self.spec.kinds
        sig, target = kinds[0] if len(kinds) == 1 else self._rng.choice(kinds)
        if sig == "SLOW":
            return self._inject_slow(group, now, step, agent_pid)
        if target == "agent" and agent_pid is None:
            sig, target = "KILL", "workers"
        if target == "agent":
            if agent_pid is None:
                return False
            pids = [agent_pid]
        else:
            pids = list(group.worker_pids.values())
        sent = []
        for pid in pids:
            try:
                self._kill(pid, signal.Signals[f"SIG{sig}"])
                sent.append(pid)
            except ProcessLookupError:
                continue
        if not sent:
            return False
        if sig == "STOP":
            self._stopped[group.gid] = (sent, now + self.spec.stop_for)
            group.hung(now)  # a hung group: rejoin is measured from here too
        phases.mark("chaos_kill", group=group.gid, signal=sig, pids=sent)
        self.injections.append(Injection(now, group.gid, f"SIG{sig}", target, step))
        self._console.err(
            f"[ftlaunch] chaos: SIG{sig} -> replica group {group.gid} {target} "
            f"(pids {','.join(map(str, sent))})" + (f" at step {step}" if step is not None else "")
        )
        return True

    def _inject_slow(self, group: Group, now: float, step: int | None, agent_pid: int | None) -> bool:
        throttle = self._slow(group, agent_pid)
        if throttle is None:
            return False
        factor, lasts = throttle.factor, throttle.duration
        injection = Injection(now, group.gid, "SLOW", "workers", step, factor=factor, lasted=lasts)
        self._throttles[group.gid] = (throttle, injection)
        for pid in (*throttle.pids, *group.worker_pids.values()):  # the proxies mirror their forks' stops
            self._throttled_pids[pid] = float("inf")
        phases.mark("chaos_slow", group=group.gid, factor=factor, pids=list(throttle.pids))
        self.injections.append(injection)
        self._console.err(
            f"[ftlaunch] chaos: replica group {group.gid} workers slowed down {factor:g}x for {lasts:g}s "
            f"(pids {','.join(map(str, throttle.pids))}; stopped while they work, {factor - 1:g}x as long as "
            f"each step's work or {RUN_CPU * 1e3:.0f} ms of CPU time took)"
            + (f" at step {step}" if step is not None else "")
        )
        return True

    def _resume_due(self, now: float) -> None:
        for gid, (_, resume_at) in list(self._stopped.items()):
            if now >= resume_at:
                self._resume(gid)

    def _resume(self, gid: int) -> None:
        pids, _ = self._stopped.pop(gid)
        for pid in pids:
            try:
                self._kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                continue
        self._groups[gid].resumed()
