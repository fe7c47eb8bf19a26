"""One replica group's torchelastic agent, run as its own process by the supervisor.

``python -m ftlaunch.launcher.agent CONFIG.json`` runs ``LocalElasticAgent`` through torchelastic's
public launcher API (`elastic_launch`) with the ``ftlaunch`` rendezvous backend and a ``LaunchConfig``
made by torchrun's own ``config_from_args`` (`torchrun_flags.launch_config`), so the group restarts
its own workers (up to ``max_restarts``) exactly as under ``torchrun``. Besides, it

* watches its workers and writes one JSON line per event to the supervisor's event pipe: the worker
  pids of each (re)start, a worker stopped by a signal (a hang), and a worker's death with its exit
  status and, when the worker recorded one in its torchelastic error file, the configuration error
  it ended on (which stops the job: `ftlaunch.errors.error_record`) -- the status read with
  ``waitid(WNOWAIT)``, which leaves the child for torchelastic to reap, so the supervisor can tell
  the lighthouse within milliseconds instead of after torchelastic's monitor tick;
* keeps the group's warm standby interpreter (`ftlaunch.launcher.standby.Standby`,
  `ftlaunch.bootstrap.zygote`), warming up from the agent's start, from which a restarted worker
  is forked with torch already imported (``FTLAUNCH_ZYGOTE=0``: not). The ``ftlaunch`` rendezvous
  sees it announced and starts none of its own;
* writes a result file (success, or the root cause from torchelastic's error files) before exiting;
* dies with the supervisor (``PR_SET_PDEATHSIG``), taking its workers down through torchelastic's
  own signal handling -- and within 2 s even a SIGSTOPped worker, which that handling would leave
  for 30 s (`procs.end_descendants`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil

from ftlaunch import env, phases
from ftlaunch.errors import configuration_error_in
from ftlaunch.launcher import procs
from ftlaunch.launcher.options import LaunchOptions
from ftlaunch.launcher.standby import Standby
from ftlaunch.lifetime import die_with_parent, on_exit
from ftlaunch.streams import is_full_disk

logger = logging.getLogger("ftlaunch.launcher.agent")

#: Seconds a worker has to end gracefully once the supervisor is gone, before it is SIGKILLed.
_ORPHAN_GRACE_S = 2.0
#: torchelastic's prefix of every worker line, ``[rg<group>/r<rank>] `` (`output.WORKER_LINE` parses it).
WORKER_PREFIX_TEMPLATE = "[{replica_id}/r${{rank}}] "


@dataclass(frozen=True)
class AgentConfig:
    """Everything one agent needs besides its job; the supervisor writes it as a JSON file.

    The launch options come whole (what the user asked for) plus this agent's plumbing. The job --
    replica group, number of groups, lighthouse, token -- is not here: it is the agent's environment
    (`env.JobEnv`, written by the supervisor), which its workers inherit, exactly as under
    ``torchrun --rdzv-backend ftlaunch``.
    """

    options: LaunchOptions
    run_id: str
    log_dir: str
    event_fd: int | None = None
    result_file: str | None = None
    supervisor_pid: int | None = None

    @classmethod
    def for_group(
        cls, opts: LaunchOptions, *, run_id: str, log_dir: str, event_fd: int, result_file: str
    ) -> AgentConfig:
        # The agent needs neither the chaos spec nor the token (it has that in its environment and a
        # secret does not belong in a file).
        return cls(
            options=dataclasses.replace(opts, chaos=None, token=None),
            run_id=run_id,
            log_dir=log_dir,
            event_fd=event_fd,
            result_file=result_file,
            supervisor_pid=os.getpid(),
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> AgentConfig:
        data = json.loads(text)
        return cls(**{**data, "options": LaunchOptions(**data["options"])})


class EventWriter:
    """JSON lines to the supervisor; a line under PIPE_BUF bytes is written atomically."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd
        self._lock = threading.Lock()

    def emit(self, kind: str, **data: Any) -> None:
        if self._fd is None:
            return
        line = (json.dumps({"event": kind, **data}) + "\n").encode()
        with self._lock:
            try:
                os.write(self._fd, line)
            except OSError:
                self._fd = None  # supervisor gone; PDEATHSIG takes care of us


class WorkerWatcher(threading.Thread):
    """Finds this agent's workers (polling) and reports each generation and each worker's exit.

    Every worker gets a thread blocked in ``waitid(WEXITED | WNOWAIT)``: the kernel wakes it the
    moment the worker dies, it reads the exit status without reaping (torchelastic still reaps and
    restarts as usual), and the supervisor hears of the death long before torchelastic's next
    monitor tick. If torchelastic happens to reap first the status is unknown and reported as such.

    Looking for workers lists this process's children (`procs.child_pids`, and the environment of
    each child not seen before) every ``interval`` while it expects workers -- at the start, and
    from a worker's exit until as many are alive as before -- and only every ``idle_interval``
    while all of them run, so that the agent takes little CPU from training (and from a
    restarting group's imports).
    """

    def __init__(self, events: EventWriter, interval: float = 0.02, idle_interval: float = 0.5) -> None:
        super().__init__(name="ftlaunch-worker-watcher", daemon=True)
        self._events = events
        self._interval = interval
        self._idle_interval = idle_interval
        self._stopping = False
        self._wake = threading.Event()  # a worker exited, or stop(): look again now
        self._workers: set[int] = set()
        self._ignored: set[int] = set()
        #: Worker pid -> its torchelastic error file, read when it fails (`_configuration_error`).
        self._error_files: dict[int, str] = {}
        self._lock = threading.Lock()
        self._alive: set[int] = set()  # workers found and not yet exited
        self._expected = 0  # the most workers alive at once so far

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self.join(timeout=2)

    def _looking(self) -> bool:
        with self._lock:
            return not self._expected or len(self._alive) < self._expected

    def run(self) -> None:
        while not self._stopping:
            self._wake.wait(self._interval if self._looking() else self._idle_interval)
            self._wake.clear()
            if self._stopping:
                return
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - the watcher must never take the agent down
                logger.debug("worker watcher tick failed", exc_info=True)

    def _tick(self) -> None:
        new: dict[int, dict[str, Any]] = {}
        for pid in procs.child_pids():
            if pid in self._workers or pid in self._ignored:
                continue
            try:
                child = psutil.Process(pid)
                child_env = child.environ()
            except psutil.Error:
                continue
            marks = env.ProcessMarks.from_environ(child_env)
            if not marks.torchelastic or marks.rank is None:
                # Not exec'd yet (still shows our environment) or not a worker: look again later,
                # but stop looking at a child that is still not a worker after a while.
                try:
                    if time.time() - child.create_time() > 2.0:
                        self._ignored.add(child.pid)
                except psutil.Error:
                    pass
                continue
            if marks.error_file is not None:
                self._error_files[child.pid] = marks.error_file
            new[child.pid] = {
                "rank": marks.rank,
                "local_rank": -1 if marks.local_rank is None else marks.local_rank,
                "restart": marks.restart_count,
            }
        if not new:
            return
        self._workers.update(new)
        with self._lock:
            self._alive.update(new)
            self._expected = max(self._expected, len(self._alive))
        for pid in new:
            phases.mark("worker_seen", worker=pid, process_start=phases.process_start_time(pid))
        self._events.emit(
            "workers",
            restart=max(i["restart"] for i in new.values()),
            pids={str(i["rank"]): pid for pid, i in new.items()},
        )
        for pid, info in new.items():
            threading.Thread(
                target=self._wait_for, args=(pid, info), daemon=True, name=f"ftlaunch-wait-{pid}"
            ).start()

    def _wait_for(self, pid: int, info: dict[str, Any]) -> None:
        data: dict[str, Any] = {"pid": pid, **info}
        while True:
            try:
                res = os.waitid(os.P_PID, pid, os.WEXITED | os.WSTOPPED | os.WNOWAIT)
            except ChildProcessError:
                res = None
            if res is None or res.si_code != os.CLD_STOPPED:
                break
            # Stopped (SIGSTOP, SIGTSTP, ...): a hang; the supervisor decides (--kill-stopped).
            # Consume the stop report (WSTOPPED alone never reaps) and wait on.
            try:
                os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG)
            except ChildProcessError:
                pass
            self._events.emit("worker_stopped", **data, signal=signal.Signals(res.si_status).name)
        if res is None:
            data["failed"] = None  # reaped by torchelastic before we looked: status unknown
        elif res.si_code == os.CLD_EXITED:
            data["exitcode"] = res.si_status
            data["failed"] = res.si_status != 0
        else:
            data["signal"] = signal.Signals(res.si_status).name
            data["failed"] = True
        if data["failed"] is not False:
            # Why it failed, if it said so before it exited: a configuration error stops the job.
            cause = _configuration_error(self._error_files.get(pid))
            if cause is not None:
                data["configuration_error"] = cause
        phases.mark("worker_exit_seen", worker=pid, failed=data["failed"])
        self._events.emit("worker_exit", **data)
        with self._lock:
            self._alive.discard(pid)
        self._wake.set()  # the next generation follows: look for it every `interval` again


def _configuration_error(error_file: str | None) -> str | None:
    """The `ConfigurationError` a failed worker recorded in its torchelastic error file
    (`ftlaunch.errors.error_record`), or None: no file, another failure, or unreadable."""
    if error_file is None:
        return None
    try:
        with open(error_file, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return configuration_error_in(record)


def _last_attempt_log(log_dir: str | None, local_rank: int, name: str) -> str:
    """``<log_dir>/<run>/attempt_<n>/<local_rank>/<name>`` of the latest attempt ("" if none)."""
    if not log_dir:
        return ""
    best, best_attempt = "", -1
    for pattern_dir in glob.glob(os.path.join(log_dir, "*", "attempt_*", str(local_rank), name)):
        attempt_text = pattern_dir.split("attempt_")[-1].split(os.sep)[0]
        if attempt_text.isdigit() and int(attempt_text) > best_attempt:
            best, best_attempt = pattern_dir, int(attempt_text)
    return best


def _describe_failure(rank: int, failure: Any, log_dir: str | None) -> dict[str, Any]:
    """The root cause of a worker group failure, from torchelastic's `ProcessFailure`."""
    data: dict[str, Any] = {"rank": rank, "pid": failure.pid, "exitcode": failure.exitcode}
    if failure.exitcode < 0:
        data["signal"] = failure.signal_name()
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    default = "To enable traceback see"
    data["message"] = "" if not message or str(message).startswith(default) else str(message)
    data["error_file"] = failure.error_file if os.path.isfile(str(failure.error_file)) else ""
    # The worker's stderr (teed or redirected to the log dir) usually names the exception.
    data["stderr_tail"] = _tail(_last_attempt_log(log_dir, failure.local_rank, "stderr.log"))
    return data


def _tail(path: str, lines: int = 5) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            content = [line.rstrip() for line in f.readlines()[-200:] if line.strip()]
    except OSError:
        return []
    return content[-lines:]


def run_agent(cfg: AgentConfig) -> int:
    """Run the group to completion; returns the agent's exit code (0 = workers succeeded)."""
    # The standby first: it warms up while this process imports torchelastic (seconds), so that the
    # workers find it ready, or nearly (they wait for it rather than import torch beside it).
    standby = Standby.start() if _through_prestart(cfg.options) else None
    try:
        return _run_agent(cfg, standby)
    finally:
        if standby is not None:
            standby.stop()


def _run_agent(cfg: AgentConfig, standby: Standby | None) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from ftlaunch.launcher import rendezvous, torchrun_flags

    rendezvous.register()
    job = env.JobEnv.from_environ()  # written by the supervisor
    opts = cfg.options
    events = EventWriter(cfg.event_fd)
    watcher = WorkerWatcher(events)
    watcher.start()

    rdzv_conf = {
        "replica_group_id": str(job.replica_group_id),
        "num_replica_groups": str(job.num_replica_groups),
        "spares": str(job.spares),
        # The supervisor owns the lighthouse; an agent must never start a second one.
        "start_lighthouse": "false",
        **opts.rdzv_conf,
    }
    launch_config = torchrun_flags.launch_config(
        opts,
        run_id=cfg.run_id,
        log_dir=cfg.log_dir,
        lighthouse=job.lighthouse,
        rdzv_configs=rdzv_conf,
        log_line_prefix_template=WORKER_PREFIX_TEMPLATE.format(replica_id=job.replica_id),
        # The launcher runs every group (spares included) on this machine.
        workers_on_host=opts.nproc_per_node * (job.num_replica_groups + job.spares),
    )
    if opts.run_path:
        from torch.distributed.run import run_script_path

        entrypoint: Any = run_script_path
    else:
        entrypoint = opts.entrypoint

    result: dict[str, Any]
    try:
        elastic_launch(launch_config, entrypoint)(*_worker_args(opts))
        result, code = {"status": "succeeded"}, 0
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        result, code = {"status": "failed", "root_cause": _describe_failure(rank, failure, cfg.log_dir)}, 1
    except SignalException as e:
        result, code = {"status": "signaled", "signal": signal.Signals(e.sigval).name}, 128 + int(e.sigval)
    except Exception as e:  # noqa: BLE001 - reported to the supervisor, which decides
        logger.exception("agent for replica group %d failed", job.replica_group_id)
        result, code = {"status": "error", "message": f"{type(e).__name__}: {e}"}, 1
    finally:
        watcher.stop()
        if standby is not None:
            standby.stop()  # before the result file: the supervisor may act on that at once
    if cfg.result_file:
        tmp = cfg.result_file + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, cfg.result_file)
        except OSError as e:  # a full log disk: the supervisor goes by the exit code alone
            if not is_full_disk(e):
                raise
            # The supervisor reports the full log disk (once); this is its detail.
            logger.info(
                "cannot write the result file %s (%s): sending the result through the event pipe",
                cfg.result_file,
                e,
            )
            events.emit("result", result=result)
    return code


def _worker_args(opts: LaunchOptions) -> list[str]:
    """The workers' command line: ``python -u -m ftlaunch.bootstrap.prestart SCRIPT ...`` for a Python
    script or module, so its Baby child imports torch while the script does (`ftlaunch.bootstrap.prestart`);
    anything else (``--no-python``, ``--run-path``) as given."""
    args = list(opts.args)
    if opts.run_path or args[:1] != ["-u"] or not os.path.basename(opts.entrypoint).startswith("python"):
        return args
    return ["-u", "-m", "ftlaunch.bootstrap.prestart", *args[1:]]


def _through_prestart(opts: LaunchOptions) -> bool:
    """Whether the workers hand over to a standby: only a worker run through
    ``ftlaunch.bootstrap.prestart`` connects to one."""
    return _worker_args(opts)[:3] == ["-u", "-m", "ftlaunch.bootstrap.prestart"]


def _supervisor_gone() -> None:
    """The supervisor died: end the workers' trees (stopped ones too), then this agent, should
    torchelastic's own shutdown still be stuck (e.g. in a store call) after the grace period."""
    procs.end_descendants(_ORPHAN_GRACE_S)
    time.sleep(_ORPHAN_GRACE_S)
    os._exit(128 + signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    phases.mark("agent_start", process_start=phases.process_start_time())
    if len(argv) != 1:
        print("usage: python -m ftlaunch.launcher.agent CONFIG.json", file=sys.stderr)
        return 2
    if argv[0] == "-":  # the supervisor could not write it to the (full) log disk
        cfg = AgentConfig.from_json(sys.stdin.read())
    else:
        with open(argv[0]) as f:
            cfg = AgentConfig.from_json(f.read())
    if cfg.supervisor_pid is not None:
        die_with_parent(signal.SIGTERM, expected_parent=cfg.supervisor_pid)
        # SIGTERM starts torchelastic's graceful stop, which a stopped worker cannot take part in.
        on_exit(cfg.supervisor_pid, _supervisor_gone, name="ftlaunch-supervisor-watch")
    logging.basicConfig(
        level=env.log_level("WARNING", lenient=True), format="%(levelname)s %(name)s: %(message)s"
    )
    return run_agent(cfg)


if __name__ == "__main__":
    sys.exit(main())
