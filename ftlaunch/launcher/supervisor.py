"""The supervisor behind ``ftlaunch``: one lighthouse, one torchelastic agent process per replica group.

Layers, from the bottom:

* each replica group is a torchelastic agent in its own process (`ftlaunch.launcher.agent`), which
  restarts the group's workers on failure exactly as ``torchrun`` would (``--max-restarts``);
* the supervisor (this module) hosts the lighthouse (or uses ``--lighthouse``), starts the agents,
  relays their output with a ``[rg<g>/r<rank>]`` prefix, and tells the lighthouse *at once* when a
  group's worker dies (the agent reports the death on its event pipe within milliseconds);
* an agent that itself dies is respawned by the supervisor (``--max-agent-restarts``), after its
  orphaned workers are killed -- the supervisor is a child subreaper, so orphans stay in its tree;
* ``--chaos`` injects failures; at exit a summary table tells what happened.

All state changes happen on the main thread: reader threads only turn pipe lines into queue items.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psutil

from ftlaunch import env
from ftlaunch.errors import FtlaunchError, LighthouseError
from ftlaunch.launcher import procs
from ftlaunch.launcher.agent import AgentConfig
from ftlaunch.launcher.options import ChaosSpec, LaunchOptions
from ftlaunch.launcher.output import WORKER_LINE, Console, format_table, parse_checksum, parse_step
from ftlaunch.lifetime import become_subreaper

logger = logging.getLogger(__name__)

#: Exit codes of ``ftlaunch``.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

_TERMINAL = ("succeeded", "failed", "stopped")


def replica_id(group: int) -> str:
    """The lighthouse replica id the Manager uses for replica group ``group`` (see ftlaunch/manager.py)."""
    return f"rg{group}"


class LaunchError(FtlaunchError):
    """The job could not start (lighthouse, ports, ...): reported as one line, exit code 2."""


@dataclass
class Injection:
    at: float
    group: int
    signal: str
    target: str
    step: int | None
    rejoined_after: float | None = None
    note: str = ""


@dataclass
class Group:
    """The supervisor's view of one replica group."""

    gid: int
    proc: subprocess.Popen | None = None
    incarnation: int = 0
    state: str = "starting"
    result_file: str = ""
    worker_pids: dict[int, int] = field(default_factory=dict)
    generation: int = 0  # torchelastic's TORCHELASTIC_RESTART_COUNT of the current agent
    workers_seen: bool = False  # any worker started in this incarnation
    restarts: int = 0
    agent_respawns: int = 0
    failures: int = 0
    failed_generations: set[tuple[int, int]] = field(default_factory=set)
    committed: int = 0
    last_step: int | None = None
    failure_at: float | None = None
    #: After a failure, committed lines only count as "rejoined" once new workers run (lines of the
    #: dead workers can still be in flight).
    awaiting_workers: bool = False
    failed_key: tuple[int, int] | None = None  # (incarnation, generation) of the last failure
    rejoin_times: list[float] = field(default_factory=list)
    checksum: str | None = None
    root_cause: str | None = None
    stopped_pids: list[int] = field(default_factory=list)
    resume_at: float | None = None
    open_streams: int = 0
    finishing: bool = False  # one of its workers exited 0
    stepped: bool = False  # committed a step since its current workers started

    @property
    def terminal(self) -> bool:
        return self.state in _TERMINAL

    @property
    def healthy(self) -> bool:
        """Running with workers up and not recovering from a failure."""
        return self.state == "running" and self.failure_at is None and not self.stopped_pids


class Supervisor:
    def __init__(self, opts: LaunchOptions, console: Console | None = None) -> None:
        self.opts = opts
        self.console = console or Console(status=opts.status_line)
        self.groups = [Group(g) for g in range(opts.replicas)]
        self.injections: list[Injection] = []
        self._events: queue.Queue[tuple[str, int, int, Any]] = queue.Queue()
        self._stop_signal: int | None = None
        self._signals_received = 0
        self._server: Any = None
        self._client: Any = None
        self._lighthouse_addr = ""
        self._token = opts.token or os.environ.get(env.FTLAUNCH_TOKEN) or secrets.token_hex(16)
        self._run_id = opts.run_id or uuid.uuid4().hex[:8]
        self._own_log_dir = opts.log_dir is None
        self._log_dir = opts.log_dir or tempfile.mkdtemp(prefix="ftlaunch_")
        self._reporter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftlaunch-report")
        self._started = time.monotonic()
        self._training_started: float | None = None
        self._rng = random.Random(opts.chaos.seed if opts.chaos else None)
        self._next_chaos: float | None = None
        self._chaos_steps = list(opts.chaos.steps) if opts.chaos else []
        self._last_status = 0.0
        self._quorum_id: Any = None
        self._exit_root_cause: str | None = None

    # --- public --------------------------------------------------------------------------------

    @property
    def lighthouse_address(self) -> str:
        return self._lighthouse_addr

    def run(self) -> int:
        """Run the job to the end; returns the process exit code."""
        become_subreaper()
        old_handlers = self._install_signal_handlers()
        try:
            try:
                self._start_lighthouse()
            except LaunchError:
                if self._own_log_dir:  # nothing ran: leave nothing behind
                    shutil.rmtree(self._log_dir, ignore_errors=True)
                raise
            self.console.err(
                f"[ftlaunch] {self.opts.replicas} replica group(s) x {self.opts.nproc_per_node} worker(s), "
                f"lighthouse {self._lighthouse_addr}, logs {self._log_dir}"
            )
            for group in self.groups:
                self._spawn(group)
            code = self._loop()
        finally:
            self._stop_all()
            self._stop_lighthouse()
            self._reporter.shutdown(wait=True)
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
        self.console.clear_status()
        if self.opts.summary:
            for line in self.summary_lines(code):
                self.console.out(line)
        if code != EXIT_OK and self._exit_root_cause:
            self.console.err(f"ftlaunch: error: {self._exit_root_cause}")
        if code == EXIT_OK and self._own_log_dir:
            shutil.rmtree(self._log_dir, ignore_errors=True)
        return code

    # --- lighthouse ----------------------------------------------------------------------------

    def _start_lighthouse(self) -> None:
        if self.opts.lighthouse:
            from ftlaunch.addresses import http_url, parse_host_port
            from ftlaunch.lighthouse.client import LighthouseClient

            try:
                addr = http_url(*parse_host_port(self.opts.lighthouse))
            except ValueError as e:
                raise LaunchError(f"--lighthouse {self.opts.lighthouse!r}: {e}") from None
            client = LighthouseClient(addr, connect_timeout=5.0, token=self._token)
            try:
                client.status()
            except (LighthouseError, OSError) as e:
                client.close()
                raise LaunchError(f"no lighthouse answers at {addr} ({type(e).__name__}: {e})") from None
            self._client, self._lighthouse_addr = client, addr
            return
        from ftlaunch.lighthouse.server import LighthouseServer

        try:
            server = LighthouseServer(
                self.opts.lighthouse_bind,
                min_replicas=self.opts.min_replicas,
                join_timeout=self.opts.join_timeout,
                heartbeat_timeout=self.opts.heartbeat_timeout,
                token=self._token,
            )
            server.start()
        except (OSError, ValueError, LighthouseError) as e:
            raise LaunchError(
                f"cannot start the lighthouse on {self.opts.lighthouse_bind}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
            ) from None
        self._server, self._lighthouse_addr = server, server.address

    def _stop_lighthouse(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.shutdown()
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()

    def _report_failure(self, group: Group, reason: str) -> None:
        rid = replica_id(group.gid)

        def report() -> None:
            try:
                if self._server is not None:
                    self._server.report_failure(rid, reason)
                elif self._client is not None:
                    self._client.report_failure(rid, reason)
            except Exception as e:  # noqa: BLE001 - the lighthouse still notices the lost connection
                logger.debug("report_failure(%s) failed: %s", rid, e)

        self._reporter.submit(report)

    def _lighthouse_status(self) -> dict[str, Any]:
        try:
            if self._server is not None:
                return self._server.status()
            if self._client is not None:
                return self._client.status()
        except Exception:  # noqa: BLE001 - status is informational
            pass
        return {}

    # --- agents --------------------------------------------------------------------------------

    def _spawn(self, group: Group) -> None:
        opts = self.opts
        group.incarnation += 1
        group_dir = os.path.join(self._log_dir, f"rg{group.gid}")
        os.makedirs(group_dir, exist_ok=True)
        group.result_file = os.path.join(group_dir, f"agent{group.incarnation}.result.json")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(group.result_file)
        read_fd, write_fd = os.pipe()
        cfg = AgentConfig(
            group=group.gid,
            num_groups=opts.replicas,
            lighthouse=self._lighthouse_addr,
            run_id=self._run_id,
            entrypoint=opts.entrypoint,
            args=list(opts.args),
            nproc_per_node=opts.nproc_per_node,
            max_restarts=opts.max_restarts,
            monitor_interval=opts.monitor_interval,
            role=opts.role,
            start_method=opts.start_method,
            log_dir=os.path.join(group_dir, "workers"),
            redirects=opts.redirects,
            tee=opts.tee,
            local_ranks_filter=opts.local_ranks_filter,
            run_path=opts.run_path,
            rdzv_conf=dict(opts.rdzv_conf),
            shutdown_timeout=(
                opts.shutdown_timeout
                if opts.shutdown_timeout is not None
                else max(1, int(opts.grace_period) - 2)
            ),
            event_fd=write_fd,
            result_file=group.result_file,
            supervisor_pid=os.getpid(),
        )
        config_file = os.path.join(group_dir, f"agent{group.incarnation}.json")
        with open(config_file, "w") as f:
            f.write(cfg.to_json())
        child_env = dict(os.environ)
        child_env.update(
            {
                env.REPLICA_GROUP_ID: str(group.gid),
                env.NUM_REPLICA_GROUPS: str(opts.replicas),
                env.FTLAUNCH_LIGHTHOUSE: self._lighthouse_addr,
                env.FTLAUNCH_TOKEN: self._token,
                "PYTHONUNBUFFERED": "1",
            }
        )
        try:
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "ftlaunch.launcher.agent", config_file],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=child_env,
                pass_fds=(write_fd,),
                start_new_session=True,  # Ctrl-C reaches the supervisor only; it stops the groups in order
            )
        finally:
            os.close(write_fd)
        group.proc = proc
        group.state = "starting"
        group.stepped = False
        group.worker_pids = {}
        group.generation = 0
        group.workers_seen = False
        group.open_streams = 3
        inc = group.incarnation
        assert proc.stdout is not None and proc.stderr is not None  # noqa: S101 - Popen(PIPE) contract
        for name, stream in (("out", proc.stdout), ("err", proc.stderr)):
            threading.Thread(
                target=self._read_lines, args=(name, group.gid, inc, stream), daemon=True,
                name=f"ftlaunch-rg{group.gid}-{name}",
            ).start()
        threading.Thread(
            target=self._read_events, args=(group.gid, inc, read_fd), daemon=True, name=f"ftlaunch-rg{group.gid}-ev"
        ).start()

    def _read_lines(self, kind: str, gid: int, inc: int, stream: Any) -> None:
        with stream:
            for raw in iter(stream.readline, b""):
                self._events.put((kind, gid, inc, raw.decode(errors="replace").rstrip("\n")))
        self._events.put(("eof", gid, inc, kind))

    def _read_events(self, gid: int, inc: int, fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            for raw in f:
                try:
                    self._events.put(("event", gid, inc, json.loads(raw)))
                except ValueError:
                    continue
        self._events.put(("eof", gid, inc, "event"))

    # --- main loop -----------------------------------------------------------------------------

    def _loop(self) -> int:
        while True:
            try:
                item = self._events.get(timeout=0.05)
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
            for group in self.groups:
                self._check_agent(group, now)
            procs.reap_zombies({g.proc.pid for g in self.groups if g.proc is not None})
            self._chaos_tick(now)
            code = self._finished()
            if code is not None:
                return code
            self._status_tick(now)

    def _handle(self, kind: str, gid: int, inc: int, payload: Any) -> None:
        group = self.groups[gid]
        if kind == "eof":
            if inc == group.incarnation:
                group.open_streams -= 1
            return
        if kind == "event":
            if inc == group.incarnation:
                self._on_event(group, payload)
            return
        line: str = payload
        m = WORKER_LINE.match(line)
        if m is not None:
            text = line
            rank: int | None = int(m.group("rank"))
        else:
            # Agent output (or worker output when --tee is off: then the rank is unknown).
            text = f"[rg{gid}/agent] {line}" if kind == "err" else f"[rg{gid}] {line}"
            rank = None if kind == "err" else -1
        if rank is not None and rank <= 0:
            self._on_worker_line(group, line)
        if kind == "err":
            self.console.err(text)
        else:
            self.console.out(text)

    def _on_worker_line(self, group: Group, line: str) -> None:
        step = parse_step(line)
        if step is not None:
            if self._training_started is None:
                self._training_started = time.monotonic()
            if step.committed:
                group.stepped = True
                group.committed += 1
                group.last_step = step.step
                if group.failure_at is not None and not group.awaiting_workers:
                    elapsed = time.monotonic() - group.failure_at
                    group.rejoin_times.append(elapsed)
                    group.failure_at = None
                    for inj in self.injections:
                        if inj.group == group.gid and inj.rejoined_after is None and not inj.note:
                            inj.rejoined_after = time.monotonic() - inj.at
            return
        checksum = parse_checksum(line)
        if checksum is not None:
            group.checksum = checksum

    def _on_event(self, group: Group, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        if kind == "workers":
            gen = int(ev.get("restart", 0))
            pids = {int(r): int(p) for r, p in ev.get("pids", {}).items()}
            if gen > group.generation:
                previous = (group.incarnation, group.generation)
                if previous not in group.failed_generations:
                    # torchelastic restarted the group before we learned why (its exit status was
                    # reaped first): count the failure now.
                    group.failed_generations.add(previous)
                    self._on_failure(group, f"workers of restart {group.generation} failed")
                group.restarts += gen - group.generation
                group.generation = gen
                group.worker_pids = pids
                group.stepped = False
            else:
                group.worker_pids.update(pids)
            group.workers_seen = True
            if (group.incarnation, gen) != group.failed_key:
                group.awaiting_workers = False
            if group.state == "starting":
                group.state = "running"
        elif kind == "worker_exit":
            pid = int(ev.get("pid", -1))
            for rank, wpid in list(group.worker_pids.items()):
                if wpid == pid:
                    del group.worker_pids[rank]
            if ev.get("failed") is False:
                group.finishing = True  # a worker completed: the training is ending
            if not ev.get("failed"):
                return
            key = (group.incarnation, int(ev.get("restart", group.generation)))
            if key in group.failed_generations:
                return  # the siblings torchelastic stops after the first death
            group.failed_generations.add(key)
            how = f"killed by {ev['signal']}" if "signal" in ev else f"exited with code {ev.get('exitcode')}"
            reason = f"rank {ev.get('rank')} (pid {pid}) {how}"
            self._on_failure(group, reason)
            left = self.opts.max_restarts - key[1]
            then = "its agent restarts the group" if left > 0 else "no restarts left"
            self.console.err(f"[ftlaunch] replica group {group.gid}: {reason}; lighthouse told; {then}")

    def _on_failure(self, group: Group, reason: str) -> None:
        group.failures += 1
        group.awaiting_workers = True
        group.failed_key = (group.incarnation, group.generation)
        if group.failure_at is None:
            group.failure_at = time.monotonic()
        self._report_failure(group, reason)

    def _check_agent(self, group: Group, now: float) -> None:
        if group.stopped_pids and group.resume_at is not None and now >= group.resume_at:
            for pid in group.stopped_pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            group.stopped_pids, group.resume_at = [], None
            group.awaiting_workers = False
        if group.proc is None or group.terminal:
            return
        code = group.proc.poll()
        if code is None:
            return
        result = self._read_result(group)
        status = result.get("status")
        if code == 0 and status == "succeeded":
            group.state = "succeeded"
            return
        if status == "failed":
            group.state = "failed"
            group.root_cause = f"replica group {group.gid} failed: {describe_root_cause(result.get('root_cause', {}))}"
            self._report_failure(group, "workers failed, no restarts left")
            return
        # The agent itself died (killed, crashed, or an exception outside the workers).
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        detail = f": {result['message']}" if status == "error" and result.get("message") else ""
        self._kill_orphans(group)
        self._on_failure(group, f"agent {how}")
        if status == "error" and not group.workers_seen:
            group.state = "failed"
            group.root_cause = f"replica group {group.gid}: agent {how}{detail}"
            return
        if group.agent_respawns >= self.opts.max_agent_restarts:
            group.state = "failed"
            group.root_cause = (
                f"replica group {group.gid}: agent {how}{detail}; respawn budget "
                f"(--max-agent-restarts {self.opts.max_agent_restarts}) exhausted"
            )
            return
        group.agent_respawns += 1
        group.restarts += 1
        self.console.err(
            f"[ftlaunch] replica group {group.gid}: agent {how}{detail}; respawning it "
            f"({group.agent_respawns}/{self.opts.max_agent_restarts})"
        )
        self._spawn(group)

    def _read_result(self, group: Group) -> dict[str, Any]:
        try:
            with open(group.result_file) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def _group_processes(self, group: Group) -> list[psutil.Process]:
        """Live processes of ``group`` that are not its agent: tracked workers, orphans, their children."""
        found: dict[int, psutil.Process] = {}
        agents = {g.proc.pid for g in self.groups if g.proc is not None}
        for pid in group.worker_pids.values():
            with contextlib.suppress(psutil.Error):
                found[pid] = psutil.Process(pid)
        for child in psutil.Process().children(recursive=True):
            if child.pid in agents or child.pid in found:
                continue
            if procs.env_of(child).get(env.REPLICA_GROUP_ID) == str(group.gid):
                found[child.pid] = child
        for p in list(found.values()):
            for d in procs.descendants(p.pid):
                found.setdefault(d.pid, d)
        return list(found.values())

    def _kill_orphans(self, group: Group) -> None:
        victims = self._group_processes(group)
        if victims:
            procs.kill_procs(victims)
        group.worker_pids = {}
        group.stopped_pids, group.resume_at = [], None

    def _finished(self) -> int | None:
        alive = [g for g in self.groups if g.state != "failed"]
        if len(alive) < self.opts.min_replicas:
            failed = [g for g in self.groups if g.state == "failed"]
            causes = "; ".join(g.root_cause or f"replica group {g.gid} failed" for g in failed)
            self._exit_root_cause = (
                f"{causes} (only {len(alive)} group(s) left, --min-replicas {self.opts.min_replicas})"
            )
            return EXIT_FAILED
        if not all(g.terminal for g in self.groups):
            return None
        # Let the last output lines of finished agents arrive before deciding.
        if any(g.open_streams > 0 for g in self.groups):
            deadline = time.monotonic() + 2.0
            while any(g.open_streams > 0 for g in self.groups) and time.monotonic() < deadline:
                try:
                    self._handle(*self._events.get(timeout=0.05))
                except queue.Empty:
                    pass
        failed = [g for g in self.groups if g.state == "failed"]
        if failed:
            self._exit_root_cause = "; ".join(g.root_cause or f"replica group {g.gid} failed" for g in failed)
            return EXIT_FAILED
        return EXIT_OK

    # --- chaos ---------------------------------------------------------------------------------

    def _chaos_tick(self, now: float) -> None:
        spec = self.opts.chaos
        if spec is None or (spec.count is not None and len(self.injections) >= spec.count):
            return
        if any(g.finishing or g.state in ("succeeded", "failed") for g in self.groups):
            return  # the job is ending (or degraded): do not pile on
        due = False
        if spec.every is not None:
            if self._next_chaos is None:
                origin = self._started + spec.start if spec.start is not None else self._training_started
                if origin is not None:
                    self._next_chaos = origin + spec.every
            if self._next_chaos is not None and now >= self._next_chaos:
                due = True
        step = self._max_step()
        if self._chaos_steps and step is not None and step >= self._chaos_steps[0]:
            due = True
        if not due:
            return
        target = self._chaos_target(spec)
        if target is None:
            return  # not safe right now (a group is still recovering); try again on the next tick
        if self._inject(spec, target, now, step):
            if self._chaos_steps and step is not None and step >= self._chaos_steps[0]:
                self._chaos_steps.pop(0)
            if spec.every is not None and self._next_chaos is not None and now >= self._next_chaos:
                self._next_chaos = now + spec.every

    def _chaos_target(self, spec: ChaosSpec) -> Group | None:
        # Only groups that are training: a group still starting up is not a meaningful target (unless
        # the script prints no step lines at all).
        healthy = [
            g for g in self.groups
            if g.healthy and g.worker_pids and (g.stepped or self._training_started is None)
        ]
        if spec.group is not None:
            target = self.groups[spec.group]
            others = [g for g in healthy if g is not target]
            return target if target in healthy and (others or len(self.groups) == 1) else None
        if len(healthy) < 2 and len(self.groups) > 1:
            return None  # never take down the last healthy group: nobody could heal the others
        return self._rng.choice(healthy) if healthy else None

    def _inject(self, spec: ChaosSpec, group: Group, now: float, step: int | None) -> bool:
        if spec.target == "agent":
            if group.proc is None:
                return False
            pids = [group.proc.pid]
        else:
            pids = list(group.worker_pids.values())
        sent = []
        for pid in pids:
            try:
                os.kill(pid, spec.signum)
                sent.append(pid)
            except ProcessLookupError:
                continue
        if not sent:
            return False
        if spec.signal == "STOP":
            group.stopped_pids, group.resume_at = sent, now + spec.stop_for
            group.failure_at = now  # a hung group: rejoin is measured from here too
            group.awaiting_workers = True  # until SIGCONT
        self.injections.append(Injection(now, group.gid, f"SIG{spec.signal}", spec.target, step))
        self.console.err(
            f"[ftlaunch] chaos: SIG{spec.signal} -> replica group {group.gid} {spec.target} "
            f"(pids {','.join(map(str, sent))})" + (f" at step {step}" if step is not None else "")
        )
        return True

    def _max_step(self) -> int | None:
        steps = [g.last_step for g in self.groups if g.last_step is not None]
        return max(steps) if steps else None

    # --- status --------------------------------------------------------------------------------

    def _status_tick(self, now: float) -> None:
        if not self.console.status_enabled or now - self._last_status < 0.5:
            return
        self._last_status = now
        status = self._lighthouse_status()
        self._quorum_id = quorum_id_of(status) or self._quorum_id
        up = sum(1 for g in self.groups if g.state == "running")
        step = self._max_step()
        self.console.status(
            f"[ftlaunch] quorum {self._quorum_id if self._quorum_id is not None else '-'} | "
            f"step {step if step is not None else '-'} | groups up {up}/{len(self.groups)} | "
            f"failures {sum(g.failures for g in self.groups)} | restarts {sum(g.restarts for g in self.groups)} | "
            f"{now - self._started:.0f}s"
        )

    # --- signals and teardown ------------------------------------------------------------------

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        old: dict[int, Any] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, self._on_signal)
        return old

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals_received += 1
        if self._stop_signal is None:
            self._stop_signal = signum
        if self._signals_received > 1:
            # A second Ctrl-C: no more grace.
            for group in self.groups:
                if group.proc is not None:
                    victims = [psutil.Process(group.proc.pid)] if group.proc.poll() is None else []
                    procs.kill_procs(victims + self._group_processes(group), timeout=1.0)

    def _stop_all(self) -> None:
        """Stop every agent and worker: SIGTERM, ``grace_period``, then SIGKILL whatever is left."""
        roots: list[psutil.Process] = []
        extra: list[psutil.Process] = []
        for group in self.groups:
            if group.stopped_pids:
                for pid in group.stopped_pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            if group.proc is not None and group.proc.poll() is None:
                with contextlib.suppress(psutil.Error):
                    roots.append(psutil.Process(group.proc.pid))
            extra.extend(self._group_processes(group))
            if not group.terminal:
                group.state = "stopped"
        if roots or extra:
            left = procs.terminate_tree(roots, self.opts.grace_period, extra)
            if left:
                logger.error("could not stop processes: %s", [p.pid for p in left])
        for group in self.groups:
            if group.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    group.proc.wait(timeout=5)
        # Anything re-parented to us that is still around (workers of a killed agent) goes too.
        leftovers = [p for p in psutil.Process().children(recursive=True) if env.REPLICA_GROUP_ID in procs.env_of(p)]
        if leftovers:
            procs.kill_procs(leftovers)
        procs.reap_zombies(set())

    # --- summary -------------------------------------------------------------------------------

    def summary_lines(self, code: int) -> list[str]:
        elapsed = time.monotonic() - self._started
        status = self._lighthouse_status()
        qid = quorum_id_of(status) or self._quorum_id
        lines = [
            "",
            f"[ftlaunch] summary: exit {code} after {elapsed:.1f}s"
            + (f", last quorum id {qid}" if qid is not None else ""),
        ]
        rows = []
        for g in self.groups:
            rejoin = (
                f"{max(g.rejoin_times):.1f}s max ({len(g.rejoin_times)}x)" if g.rejoin_times else "-"
            )
            rows.append(
                [
                    f"rg{g.gid}",
                    g.state,
                    str(g.committed),
                    str(g.last_step) if g.last_step is not None else "-",
                    str(g.failures),
                    str(g.restarts),
                    rejoin,
                    g.checksum or "-",
                ]
            )
        headers = ["group", "state", "steps committed", "last step", "failures", "restarts", "time to rejoin",
                   "final checksum"]
        lines += ["[ftlaunch] " + line for line in format_table(headers, rows)]
        sums = {g.checksum for g in self.groups if g.checksum}
        if sums:
            with_sum = sum(1 for g in self.groups if g.checksum)
            if len(sums) == 1:
                lines.append(f"[ftlaunch] {with_sum}/{len(self.groups)} groups ended bit-identical ({sums.pop()})")
            else:
                lines.append(f"[ftlaunch] WARNING: groups ended with different weights: {sorted(sums)}")
        if self.opts.chaos is not None:
            lines.append(f"[ftlaunch] chaos: {len(self.injections)} injection(s)")
            for inj in self.injections:
                fate = (
                    f"group committed again {inj.rejoined_after:.1f}s later"
                    if inj.rejoined_after is not None
                    else "group did not commit again"
                )
                at = f" at step {inj.step}" if inj.step is not None else ""
                lines.append(
                    f"[ftlaunch]   t={inj.at - self._started:.1f}s {inj.signal} rg{inj.group} {inj.target}{at}: {fate}"
                )
            total = sum(g.committed for g in self.groups)
            lines.append(
                f"[ftlaunch] training {'finished' if code == EXIT_OK else 'did not finish'} despite "
                f"{sum(g.failures for g in self.groups)} failure(s); {total} committed group-steps"
            )
        for g in self.groups:
            if g.root_cause:
                lines.append(f"[ftlaunch] root cause: {g.root_cause}")
        if code != EXIT_OK:
            lines.append(f"[ftlaunch] logs kept in {self._log_dir}")
        return lines


def quorum_id_of(status: dict[str, Any]) -> Any:
    """The current quorum id from a lighthouse status document, whatever its exact layout."""
    if not isinstance(status, dict):
        return None
    if "quorum_id" in status:
        return status["quorum_id"]
    quorum = status.get("quorum") or status.get("last_quorum")
    if isinstance(quorum, dict):
        return quorum.get("quorum_id")
    return None


def describe_root_cause(cause: dict[str, Any]) -> str:
    """One line from the agent's root-cause record (torchelastic's first failure)."""
    if not cause:
        return "workers failed (no details)"
    if cause.get("signal"):
        how = f"killed by {cause['signal']}"
    else:
        how = f"exited with code {cause.get('exitcode')}"
    text = f"rank {cause.get('rank')} (pid {cause.get('pid')}) {how}"
    message = (cause.get("message") or "").strip()
    if message:
        text += f": {message.splitlines()[-1] if message.splitlines() else message}"
    elif cause.get("stderr_tail"):
        text += f": {cause['stderr_tail'][-1]}"
    if cause.get("error_file"):
        text += f" (error file {cause['error_file']})"
    return text
