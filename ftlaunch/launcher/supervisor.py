"""The supervisor behind ``ftlaunch``: one lighthouse, one torchelastic agent process per replica group.

Layers, from the bottom:

* each replica group is a torchelastic agent in its own process (`ftlaunch.launcher.agent`), which
  restarts the group's workers on failure exactly as ``torchrun`` would (``--max-restarts``);
* the supervisor (this module) hosts the lighthouse or uses ``--lighthouse``
  (`ftlaunch.launcher.lighthouse_host`; what it does with it, restarts and failure reports
  included: `ftlaunch.launcher.lighthouse_keeper`), starts the agents, relays their output, and tells the
  lighthouse *at once* when a group's worker dies (the agent reports the death on its event pipe
  within milliseconds);
* an agent that itself dies is respawned (``--max-agent-restarts``), after its orphaned workers are
  killed -- the supervisor is a child subreaper, so orphans stay in its tree (`ftlaunch.launcher.procs`).

This module is the agents' lifecycle loop (starting one agent process and reading its pipes:
`ftlaunch.launcher.agent_process`); what it learns goes to each group's accounting
(`ftlaunch.launcher.group`), ``--chaos`` is `ftlaunch.launcher.chaos`, the status line and the summary
are `ftlaunch.launcher.report`, the picture of the run written at exit is recorded by
`ftlaunch.launcher.timeline`. All state changes happen on the main thread: reader threads only turn
pipe lines into queue items.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import shutil
import signal
import tempfile
import threading
import time
import uuid
from typing import Any

import psutil

from ftlaunch import env, phases
from ftlaunch.launcher import devices, procs
from ftlaunch.launcher.agent_process import AgentProcess, News, start_agent
from ftlaunch.launcher.chaos import Chaos
from ftlaunch.launcher.group import FAILED, STARTING, SUCCEEDED, Group, configuration_stop
from ftlaunch.launcher.lighthouse_host import HostedLighthouse, JobLighthouse, LaunchError
from ftlaunch.launcher.lighthouse_keeper import LighthouseKeeper
from ftlaunch.launcher.logdisk import LogDiskWatch
from ftlaunch.launcher.options import LaunchOptions
from ftlaunch.launcher.output import WORKER_LINE, Console, without_repeated_tag
from ftlaunch.launcher.report import StatusLine, lost, summary_lines
from ftlaunch.launcher.spares import Takeovers
from ftlaunch.launcher.timeline import TIMELINE_FILE, JobTimeline, keep_timeline
from ftlaunch.launcher.torchrun_flags import parse_signals
from ftlaunch.lifetime import become_subreaper
from ftlaunch.lighthouse import timeline_svg
from ftlaunch.lighthouse.progress import Rewind
from ftlaunch.lighthouse.timeline import AGENT, GAVE_UP, HANG, REJOIN, TAKEOVER

logger = logging.getLogger(__name__)

#: Exit codes of ``ftlaunch`` (besides 128+N: stopped by signal N). A bad setting is `EXIT_USAGE`
#: whether the launcher refused it or a worker ended on it (`group.configuration_stop`).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

#: How long the main loop waits for news before its periodic checks.
_TICK_S = 0.05
#: How soon a hosted lighthouse that stopped serving is restarted: at the main loop's next check.
LIGHTHOUSE_CHECK_S = _TICK_S
#: How long a finished job waits for the last output lines of its agents.
_DRAIN_S = 2.0
#: Seconds between two reads of the groups' progress from a lighthouse in this process / elsewhere.
_PROGRESS_HOSTED_S = 0.1
_PROGRESS_REMOTE_S = 0.5


class Supervisor:
    def __init__(self, opts: LaunchOptions, console: Console | None = None) -> None:
        self.opts = opts
        self.console = console or Console(status=opts.status_line)
        # Groups 0..N-1 start for the N replica-group slots, N..N+K-1 as hot spares (worker/spare.py).
        self.groups = [Group(g) for g in range(opts.replicas + opts.spares)]
        self._agents: dict[int, AgentProcess] = {}
        self._events: queue.Queue[News] = queue.Queue()
        self._stop_signal: int | None = None
        self._signals_received = 0
        self._token = opts.token or env.job_token() or secrets.token_hex(16)
        self._keeper = LighthouseKeeper(opts, self._token, self.console)
        self._run_id = opts.run_id or uuid.uuid4().hex[:8]
        self._own_log_dir = opts.log_dir is None
        self._log_dir = opts.log_dir or tempfile.mkdtemp(prefix="ftlaunch_")
        self._log_disk = LogDiskWatch(self._log_dir, self.console.err)
        self._started = time.monotonic()
        self._wall_started = time.time()
        self._training_started: float | None = None
        self._timeline = JobTimeline(self._started)
        self._chaos = (
            Chaos(opts.chaos, self.groups, self.console, self._started, crash_lighthouse=self._keeper.crash)
            if opts.chaos
            else None
        )
        #: The lighthouse formed a quorum of two groups or more: the groups train together and heal
        #: from each other (fault-tolerant training, not independent scripts), see `_stop_stragglers`.
        self._trained_together = False
        #: Groups whose workers failed with no restarts left: their agent ends them as failed.
        self._out_of_restarts: set[int] = set()
        self._takeovers = Takeovers(opts.replicas) if opts.spares else None
        #: Each group's own GPUs when the machine has one per worker of every group (`devices`).
        self._gpus = _machine_gpus()
        self._devices = devices.group_devices(self._gpus, opts.nproc_per_node, len(self.groups))
        self._status: StatusLine | None = None
        self._exit_root_cause: str | None = None
        self._progress_read_at = 0.0
        self._kept_out_read_at = 0.0
        #: Lighthouse name -> the group that trained under it (with spares a slot's names change hands).
        self._names: dict[str, int] = {g.replica_id: g.gid for g in self.groups}
        #: Stragglers already told (until they are no more), replacements already told.
        self._slow_seen: set[str] = set()
        self._replaced_seen: set[tuple[str, float]] = set()
        #: Health-check failures marked on the timeline: (replica id, when it began failing).
        self._health_seen: set[tuple[str, float]] = set()
        #: The times the job went back to an earlier step (the lighthouse's `Rewind`s), kept across
        #: lighthouse restarts, keyed by when and where.
        self._rewinds: dict[tuple[float, int, int], Rewind] = {}

    @property
    def _lighthouse(self) -> JobLighthouse | None:
        """The job's lighthouse once opened (`LighthouseKeeper`)."""
        return self._keeper.lighthouse

    def run(self) -> int:
        """Run the job to the end; returns the process exit code."""
        become_subreaper()
        old_handlers = self._install_signal_handlers()
        try:
            try:
                lighthouse = self._keeper.open()
            except LaunchError:
                if self._own_log_dir:  # nothing ran: leave nothing behind
                    shutil.rmtree(self._log_dir, ignore_errors=True)
                raise
            self._status = StatusLine(self.console, lighthouse, self._started)
            spares = f" + {self.opts.spares} hot spare(s)" if self.opts.spares else ""
            self.console.err(
                f"[ftlaunch] {self.opts.replicas} replica group(s){spares} "
                f"x {self.opts.nproc_per_node} worker(s), "
                f"lighthouse {lighthouse.address}, logs {self._log_dir}"
            )
            sharing = devices.sharing_warning(len(self._gpus), self.opts.nproc_per_node, len(self.groups))
            if sharing is not None:
                self.console.err(f"[ftlaunch] warning: {sharing}")
            for group in self.groups:
                self._spawn(group)
            code = self._loop()
            self._read_progress(time.monotonic(), force=True)
            quorum_id = self._status.last_quorum_id()
            final_status = self._keeper.final_status()
        finally:
            self._stop_all()
            self._keeper.close()
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
        self.console.clear_status()
        timeline = self._write_timeline(code)
        if self.opts.summary:
            injections = self._chaos.injections if self._chaos is not None else None
            for line in summary_lines(
                code,
                time.monotonic() - self._started,
                self.groups,
                quorum_id,
                injections,
                self._started,
                self._log_dir,
                final_status,
                rewinds=list(self._rewinds.values()),
                started_wall=time.time() - (time.monotonic() - self._started),
                timeline=timeline,
            ):
                self.console.out(line)
            crash = self._chaos.lighthouse_crash if self._chaos is not None else None
            if crash is not None:
                back = (
                    f"restarted {crash.down_for:.1f}s later"
                    if crash.down_for is not None
                    else "never restarted"
                )
                self.console.out(
                    f"[ftlaunch] chaos: lighthouse crashed at t={crash.at - self._started:.1f}s: {back}"
                )
        if code != EXIT_OK and self._exit_root_cause:
            self.console.err(f"ftlaunch: error: {self._exit_root_cause}")
        if code == EXIT_OK and self._own_log_dir and not lost(list(self._rewinds.values()), self.groups):
            if timeline is None:
                shutil.rmtree(self._log_dir, ignore_errors=True)
            else:  # the picture stays where the summary said; the worker logs go
                for entry in os.scandir(self._log_dir):
                    if entry.name != TIMELINE_FILE:
                        _remove(entry.path)
        return code

    def _write_timeline(self, code: int) -> str | None:
        """Write the run's picture into the log directory (`keep_timeline` says when); its path, or
        None. A failure to write is one line: it never changes the job's outcome."""
        failures = sum(g.failures for g in self.groups)
        eventful = failures or self._timeline.failures or self._timeline.health_failures
        if not keep_timeline(self._own_log_dir, code, self._chaos is not None, eventful):
            return None
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self._wall_started))
        data = self._timeline.timeline(
            time.monotonic(),
            "ftlaunch: steps per replica group",
            f"run {self._run_id}, {self.opts.replicas} replica group(s)"
            + (f" + {self.opts.spares} spare(s)" if self.opts.spares else "")
            + f", {failures} failure(s), exit {code}; t = 0 at launch, {started}",
        )
        path = os.path.join(self._log_dir, TIMELINE_FILE)
        try:  # whole or not at all (a full log disk)
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(timeline_svg.render(data))
            os.replace(path + ".tmp", path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(path + ".tmp")
            self.console.err(f"[ftlaunch] could not write the timeline {path}: {e.strerror or e}")
            return None
        return path

    # --- agents --------------------------------------------------------------------------------

    def _spawn(self, group: Group) -> None:
        assert self._lighthouse is not None  # noqa: S101 - opened before any agent starts
        group.agent_started()
        # The lighthouse answered (we host it, or connected to it): a group (re)started while it is
        # down waits for it like the running ones (FTLAUNCH_LIGHTHOUSE_OUTAGE), not 10 s.
        job = env.JobEnv(
            group.gid,
            self.opts.replicas,
            self._lighthouse.address,
            self._token,
            self.opts.spares,
            lighthouse_reached=True,
        )
        self._agents[group.gid], config_written = start_agent(
            self.opts,
            job,
            run_id=self._run_id,
            group_dir=os.path.join(self._log_dir, group.replica_id),
            incarnation=group.incarnation,
            news=self._events,
            extra_env={
                **(
                    {env.CUDA_VISIBLE_DEVICES: ",".join(self._devices[group.gid])}
                    if self._devices is not None
                    else {}
                ),
                **env.health_check_environ(self.opts.health_check, self.opts.health_check_timeout),
            },
        )
        if not config_written:
            self._log_disk.poll(force=True)
        phases.mark("agent_spawned", replica=str(group.gid), incarnation=group.incarnation)

    # --- main loop -----------------------------------------------------------------------------

    def _loop(self) -> int:
        assert self._status is not None  # noqa: S101 - set by run()
        while True:
            try:
                item = self._events.get(timeout=_TICK_S)
            except queue.Empty:
                item = None
            while item is not None:
                self._handle(*item)
                try:
                    item = self._events.get_nowait()
                except queue.Empty:
                    item = None
            if self._stop_signal is not None:
                self._exit_root_cause = f"stopped by {signal.Signals(self._stop_signal).name}"
                return 128 + self._stop_signal
            now = time.monotonic()
            self._log_disk.poll(now)
            for group in self.groups:
                self._check_agent(group, now)
            self._stop_kept_out(now)  # first: a group its check keeps out is not "recovering"
            self._stop_stragglers()
            procs.reap_zombies({a.proc.pid for a in self._agents.values()})
            self._read_progress(now)
            if self._chaos is not None:
                self._tick_chaos(self._chaos, now)
            if self._keeper.watch(now):  # restarts a hosted one that stopped
                self._timeline.lighthouse_back(now)
                if self._chaos is not None:
                    self._chaos.lighthouse_restarted(now)
            self._keeper.resend_missed(self.groups, now)  # failures a down lighthouse missed
            code = self._finished()
            if code is not None:
                return code
            self._status.tick(now, self.groups, list(self._rewinds.values()))

    def _tick_chaos(self, chaos: Chaos, now: float) -> None:
        injected, crashed = len(chaos.injections), chaos.lighthouse_crash
        chaos.tick(now, self._training_started, {g: a.proc.pid for g, a in self._agents.items()})
        for injection in chaos.injections[injected:]:
            self._timeline.injected(injection)
        if crashed is None and chaos.lighthouse_crash is not None:
            self._timeline.lighthouse_down(chaos.lighthouse_crash.at)

    def _handle(self, kind: str, gid: int, inc: int, payload: Any) -> None:
        group, agent = self.groups[gid], self._agents.get(gid)
        current = inc == group.incarnation  # not a line of an agent that was replaced
        if kind == "eof":
            if current and agent is not None:
                agent.open_streams -= 1
            return
        if kind == "event":
            if current:
                self._on_event(group, payload)
            return
        line: str = payload
        if WORKER_LINE.match(line) is not None:
            text = without_repeated_tag(line)
        else:
            # Agent output (or worker output when --tee is off).
            text = f"[{group.replica_id}/agent] {line}" if kind == "err" else f"[{group.replica_id}] {line}"
        if kind == "err":
            self.console.err(text)
        else:
            self.console.out(text)

    def _read_progress(self, now: float, force: bool = False) -> None:
        """Progress comes from the lighthouse (what the group leaders report), never from the
        workers' stdout: it is right for a script that prints nothing."""
        lighthouse = self._lighthouse
        interval = _PROGRESS_HOSTED_S if isinstance(lighthouse, HostedLighthouse) else _PROGRESS_REMOTE_S
        if lighthouse is None or (not force and now - self._progress_read_at < interval):
            return
        self._progress_read_at = now
        for r in lighthouse.rewinds() or ():
            self._rewinds[(r.wall, r.reached, r.restarted_at)] = r
        progress = lighthouse.progress()
        if progress is None:
            return
        if not self._trained_together:
            try:
                quorum = lighthouse.snapshot().quorum
            except Exception:  # noqa: BLE001 - read again at the next tick
                quorum = None
            self._trained_together = quorum is not None and len(quorum.participants) >= 2
        groups = {g.replica_id: g for g in self.groups}
        if self._takeovers is not None:  # hot spares: a slot's name belongs to the group holding it now
            try:
                spares = lighthouse.snapshot().spares
            except Exception:  # noqa: BLE001 - informational: read again at the next interval
                return
            groups = {name: self.groups[gid] for name, gid in self._takeovers.names(spares).items()}
        self._names.update({name: g.gid for name, g in groups.items()})
        wall_offset = time.time() - time.monotonic()
        self._read_stragglers(lighthouse, now, wall_offset)
        self._read_health(lighthouse, now, wall_offset)
        for p in progress:
            group = groups.get(p.replica_id)
            if group is None:
                continue
            before = group.committed
            rejoined_at = group.lighthouse_progress(p, now, wall_offset)
            replaced = (
                self._takeovers.committed(group.gid) if self._takeovers and group.committed > before else None
            )
            if replaced is not None:  # the spare that took a failed group's slot committed: recovered
                if self.groups[replaced].slot_taken_over(now) is not None:
                    self._timeline.recovered(
                        replaced, now, TAKEOVER, f"{group.replica_id}, a hot spare, took its slot"
                    )
                    if self._chaos is not None:
                        self._chaos.rejoined(replaced, now)
            if group.committed and self._training_started is None:
                self._training_started = now
            if rejoined_at is not None:
                self._timeline.recovered(group.gid, rejoined_at, REJOIN, "committed a step again")
                if self._chaos is not None:
                    self._chaos.rejoined(group.gid, rejoined_at)
        self._timeline.sample(now, self.groups)

    def _read_health(self, lighthouse: JobLighthouse, now: float, wall_offset: float) -> None:
        """Mark on the timeline each time a group's health check began failing (``--health-check``),
        as the dashboard does: the lighthouse's history has them."""
        if not self.opts.health_check:
            return
        for h in lighthouse.health_failures() or ():
            key = (h.replica_id or "", h.time)
            if key in self._health_seen:
                continue
            self._health_seen.add(key)
            gid = self._names.get(h.replica_id or "")
            if gid is None:
                gid = next((g.gid for g in self.groups if g.replica_id == h.replica_id), None)
            if gid is not None:
                detail = f"health check failed, kept out: {h.detail}"
                self._timeline.health_failed(gid, min(h.time - wall_offset, now), detail)

    def _read_stragglers(self, lighthouse: JobLighthouse, now: float, wall_offset: float) -> None:
        """Tell the user when the lighthouse finds a straggler or replaces one, and mark both on the
        timeline (the replacement is the incident: its workers' end that follows is the same)."""
        found = lighthouse.stragglers()
        if found is None:
            return
        for v in found.stragglers:
            if v.replica_id in self._slow_seen:
                continue
            self._slow_seen.add(v.replica_id)
            gid = self._names.get(v.replica_id)
            detail = (
                f"straggler: {v.slowdown:.1f}x slower than the "
                f"others ({v.compute_seconds * 1e3:.1f} ms of its "
                f"own work per step against {v.reference_seconds * 1e3:.1f} ms)"
            )
            then = (
                "replacing it"
                if found.policy == "replace"
                else "reported (--stragglers replace would replace it)"
            )
            self.console.err(f"[ftlaunch] replica group {v.replica_id} is a {detail}; {then}")
            if gid is not None:
                self._timeline.found_slow(gid, (v.since - wall_offset) if v.since else now, detail)
        self._slow_seen &= {v.replica_id for v in found.stragglers}
        for r in found.replaced:
            key = (r.replica_id, r.time)
            if key in self._replaced_seen:
                continue
            self._replaced_seen.add(key)
            how = (
                "its slot went to a hot spare"
                if r.how == "spare"
                else "told to restart (no hot spare waited)"
            )
            self.console.err(
                f"[ftlaunch] replica group {r.replica_id} replaced as a straggler ({r.slowdown:.1f}x): {how}"
            )
            gid = self._names.get(r.replica_id)
            if gid is not None:
                at = min(r.time - wall_offset, now)
                self.groups[gid].replaced_as_straggler(at)
                self._timeline.straggler_replaced(gid, at, f"straggler ({r.slowdown:.1f}x): {how}")

    def _on_event(self, group: Group, ev: dict[str, Any]) -> None:
        now = time.monotonic()
        kind = ev.get("event")
        if kind == "result" and isinstance(ev.get("result"), dict) and group.gid in self._agents:
            self._agents[group.gid].piped = ev["result"]
        elif kind == "workers":
            pids = {int(r): int(p) for r, p in ev.get("pids", {}).items()}
            failure = group.workers_started(int(ev.get("restart", 0)), pids, now)
            if failure is not None:
                self._timeline.failed(group.gid, now, failure)
                self._keeper.report_failure(group, failure)
        elif kind == "worker_stopped":
            if self._chaos is not None and self._chaos.throttling(int(ev.get("pid", -1)), now):
                return  # a slowdown's stop (--chaos slow=), no hang
            stopped = f"rank {ev.get('rank')} (pid {ev.get('pid')}) stopped by {ev.get('signal')}"
            self._timeline.failed(group.gid, now, stopped, HANG)
            if not self.opts.kill_stopped:
                self.console.err(
                    f"[ftlaunch] replica group {group.gid}: {stopped}; its peers go on once the lighthouse "
                    "declares it hung (about half a second while they wait for it; else --heartbeat-timeout)"
                )
                return
            # --kill-stopped: a hang handled as a crash. The others' next quorum goes on without it
            # at once (a group merely told failed could continue after they finished and train alone).
            with contextlib.suppress(psutil.Error):
                procs.kill_procs([psutil.Process(int(ev.get("pid", -1)))], timeout=0)
            self.console.err(f"[ftlaunch] replica group {group.gid}: {stopped}; killed (--kill-stopped)")
        elif kind == "worker_exit":
            restart = int(ev.get("restart", group.generation))
            misconfigured = ev.get("configuration_error")
            if isinstance(misconfigured, str) and not group.terminal:
                cause = group.worker_misconfigured(
                    int(ev.get("pid", -1)), ev.get("rank"), restart, misconfigured, now
                )
                self._timeline.failed(group.gid, now, cause, GAVE_UP)
                self.console.err(f"[ftlaunch] {cause}; stopping the job (a restart cannot fix a setting)")
                return
            how = f"killed by {ev['signal']}" if "signal" in ev else f"exited with code {ev.get('exitcode')}"
            failure = group.worker_exited(
                int(ev.get("pid", -1)), ev.get("rank"), restart, ev.get("failed"), how, now
            )
            if failure is not None:
                self._timeline.failed(group.gid, now, failure)
                self._keeper.report_failure(group, failure)
                then = (
                    "its agent restarts the group" if self.opts.max_restarts > restart else "no restarts left"
                )
                if self.opts.max_restarts <= restart:
                    self._out_of_restarts.add(group.gid)  # it fails on its own: not a straggler to stop
                self.console.err(f"[ftlaunch] replica group {group.gid}: {failure}; lighthouse told; {then}")

    def _check_agent(self, group: Group, now: float) -> None:
        agent = self._agents.get(group.gid)
        if agent is None or group.terminal:
            return
        code = agent.proc.poll()
        if code is None:
            return
        if agent.exited_at is None:
            phases.mark("agent_exit_seen", replica=str(group.gid), code=code)
        if agent.last_words_pending(now, code):
            return
        if code == 0:  # whether the lighthouse ended it as a straggler (`Group.stopped_after_end`)
            self._read_progress(now, force=True)
        outcome = group.agent_exited(code, agent.result(), self.opts.max_agent_restarts, now)
        if outcome.kill_orphans:
            self._kill_orphans(group)
            phases.mark("orphans_killed", replica=str(group.gid))
        if group.state == FAILED:
            self._timeline.failed(group.gid, now, group.root_cause or "failed", GAVE_UP)
        elif outcome.report is not None:
            self._timeline.failed(group.gid, now, outcome.report, AGENT if outcome.respawn else GAVE_UP)
        if outcome.report is not None:
            self._keeper.report_failure(group, outcome.report)
        if outcome.message is not None:
            self.console.err(outcome.message)
        if outcome.respawn:
            self._spawn(group)

    def _stop_stragglers(self) -> None:
        """Once a group finished, stop the groups that are down and not back yet: nobody is left to
        heal them, so restarted they would train from scratch, alone, and end with other weights
        than the job's (the soak found exactly that). Groups stepping with the others finish normally.
        Only for groups that train together (a step line said ``participants=`` 2 or more): scripts
        whose groups run independently may still finish alone."""
        if not self._trained_together or not any(g.state == SUCCEEDED or g.finishing for g in self.groups):
            return
        if self.opts.spares:
            # A restarted group comes back as a spare, which the lighthouse tells "done" at the end;
            # stopping it here would also drop its failure's accounting (a spare took over its slot).
            return
        for group in self.groups:
            if group.terminal or group.finishing or (group.failure_at is None and group.state != STARTING):
                continue
            if group.gid in self._out_of_restarts:
                continue
            agent = self._agents.get(group.gid)
            victims = self._group_processes(group)
            if agent is not None and agent.proc.poll() is None:
                victims.append(psutil.Process(agent.proc.pid))
            procs.kill_procs(victims, timeout=5.0)
            group.stopped_by_launcher()
            group.worker_pids = {}
            if self._chaos is not None:
                self._chaos.forget(group.gid)
            self.console.err(
                f"[ftlaunch] replica group {group.gid}: the training finished while it was recovering "
                "(nobody left to heal it from); stopped"
            )

    def _stop_kept_out(self, now: float) -> None:
        """Once a group finished, stop the groups whose health check still keeps them out
        (``--health-check``; the lighthouse has their reports): they never trained, and the job is
        done without them. Looked up at most once a second."""
        if not self.opts.health_check or now < self._kept_out_read_at + 1.0:
            return
        if not any(g.state == SUCCEEDED or g.finishing for g in self.groups):
            return
        waiting = [g for g in self.groups if g.state == STARTING and not g.terminal]
        lighthouse = self._lighthouse
        if not waiting or lighthouse is None:
            return
        self._kept_out_read_at = now
        try:
            failing = {h.replica_id: h for h in lighthouse.snapshot().health if not h.ok}
        except Exception:  # noqa: BLE001 - informational: read again a second later
            return
        for group in waiting:
            health = failing.get(group.replica_id)
            if health is None:
                continue
            agent = self._agents.get(group.gid)
            victims = self._group_processes(group)
            if agent is not None and agent.proc.poll() is None:
                victims.append(psutil.Process(agent.proc.pid))
            procs.kill_procs(victims, timeout=5.0)
            group.stopped_by_launcher()
            self.console.err(
                f"[ftlaunch] replica group {group.gid}: the training finished while its health check kept "
                f"it out ({health.failures} failure(s), last: {health.last_line}); stopped"
            )

    def _group_processes(self, group: Group) -> list[psutil.Process]:
        agents = {a.proc.pid for a in self._agents.values()}
        return procs.group_processes(group.gid, group.worker_pids.values(), agents)

    def _kill_orphans(self, group: Group) -> None:
        victims = self._group_processes(group)
        if victims:
            procs.kill_procs(victims)
        group.worker_pids = {}
        if self._chaos is not None:
            self._chaos.forget(group.gid)

    def _finished(self) -> int | None:
        misconfigured = configuration_stop(self.groups)
        if misconfigured is not None:
            self._exit_root_cause = misconfigured
            self._kill_job()
            return EXIT_USAGE
        alive = [g for g in self.groups if g.state != FAILED]
        if len(alive) < self.opts.min_replicas:
            self._exit_root_cause = (
                f"{self._causes()} (only {len(alive)} group(s) left, --min-replicas {self.opts.min_replicas})"
            )
            return EXIT_FAILED
        if not all(g.terminal for g in self.groups):
            return None
        # Let the last output lines of finished agents arrive before deciding.
        deadline = time.monotonic() + _DRAIN_S
        while any(a.open_streams > 0 for a in self._agents.values()) and time.monotonic() < deadline:
            try:
                self._handle(*self._events.get(timeout=_TICK_S))
            except queue.Empty:
                pass
        if any(g.state == FAILED for g in self.groups):
            self._exit_root_cause = self._causes()
            return EXIT_FAILED
        self._read_progress(time.monotonic(), force=True)
        unsynced = [g for g in self.groups if g.unsynced_sessions]
        if unsynced:
            # E.g. a group restarted after its peers had finished: nobody was left to heal it, so it
            # trained from its own (initial) state. Its result is not the job's: a failure.
            for g in unsynced:
                g.root_cause = (
                    f"replica group {g.gid} trained without the other groups' state: a process of it "
                    "committed steps from behind a group that had already finished, without healing "
                    "(restarted after its peers finished)"
                )
            self._exit_root_cause = self._causes(unsynced)
            return EXIT_FAILED
        return EXIT_OK

    def _kill_job(self) -> None:
        """SIGKILL every agent and every process of every group now. For a job that cannot go on
        (`configuration_stop`) there is nothing for a graceful stop to save, and it would be slow:
        the agents are then busy with their own workers' failure, where torchelastic's log tailer
        swallows the SIGTERM (its ``except Exception`` catches the SignalException) and restarts the
        group before the grace period ends in a SIGKILL anyway."""
        victims = [p for g in self.groups for p in self._group_processes(g)]
        for agent in self._agents.values():
            if agent.proc.poll() is None:
                with contextlib.suppress(psutil.Error):
                    victims.append(psutil.Process(agent.proc.pid))
        procs.kill_procs(victims, timeout=5.0)
        for group in self.groups:
            group.stopped_by_launcher()
            group.worker_pids = {}

    def _causes(self, groups: list[Group] | None = None) -> str:
        if groups is None:
            groups = [g for g in self.groups if g.state == FAILED]
        return "; ".join(g.root_cause or f"replica group {g.gid} failed" for g in groups)

    # --- signals and teardown ------------------------------------------------------------------

    def _install_signal_handlers(self) -> dict[int, Any]:
        """torchrun's ``--signals-to-handle`` (default SIGTERM, SIGINT, SIGHUP, SIGQUIT) stop the job;
        the signal received is the one forwarded to the agents, which forward it to their workers."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        old: dict[int, Any] = {}
        for name in parse_signals(self.opts.signals_to_handle):
            sig = signal.Signals[name]
            old[sig] = signal.signal(sig, self._on_signal)
        return old

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals_received += 1
        if self._stop_signal is None:
            self._stop_signal = signum
        if self._signals_received > 1:
            # A second Ctrl-C: no more grace.
            for group in self.groups:
                agent = self._agents.get(group.gid)
                if agent is not None:
                    victims = [psutil.Process(agent.proc.pid)] if agent.proc.poll() is None else []
                    procs.kill_procs(victims + self._group_processes(group), timeout=1.0)

    def _stop_all(self) -> None:
        """Stop every agent and worker: SIGTERM, ``grace_period``, then SIGKILL whatever is left."""
        if self._chaos is not None:
            self._chaos.resume_all()  # stopped workers must be able to handle SIGTERM
        extra = [p for g in self.groups for p in self._group_processes(g)]
        for group in self.groups:
            group.stopped_by_launcher()
        procs.stop_job(
            [a.proc for a in self._agents.values()],
            extra,
            self.opts.grace_period,
            self._stop_signal or signal.SIGTERM,
        )


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)


def _machine_gpus() -> list[str]:
    """The GPUs the job may use: those ``CUDA_VISIBLE_DEVICES`` lists, else every GPU torch counts
    (through the driver, without creating a CUDA context in the supervisor)."""
    listed = env.visible_gpus()
    if listed is not None:
        return listed
    import torch

    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver: no GPUs to place
        count = 0
    return [str(i) for i in range(count)]
