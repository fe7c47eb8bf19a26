"""Starting one replica group's agent process and turning its pipes into supervisor news.

The supervisor (`ftlaunch.launcher.supervisor`) decides *when* a group's agent starts; this module
does the starting: it writes the agent's configuration file, runs ``python -m
ftlaunch.launcher.agent CONFIG.json`` in its own session with the job's environment, and starts one
reader thread per pipe (stdout, stderr, the JSON event pipe). Reader threads only put
``(kind, gid, incarnation, payload)`` items on the supervisor's queue; every state change stays on
the supervisor's main thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import IO, Any

from ftlaunch import env
from ftlaunch.launcher.agent import AgentConfig
from ftlaunch.launcher.logdisk import write_or_none
from ftlaunch.launcher.options import LaunchOptions

#: What reader threads put on the supervisor's queue: (kind, group id, agent incarnation, payload),
#: kind "out"/"err" (a line), "event" (a decoded JSON event) or "eof" (payload: which stream ended).
News = tuple[str, int, int, Any]


@dataclass
class AgentProcess:
    """A group's running agent process and its pipes."""

    proc: subprocess.Popen
    result_file: str
    #: stdout, stderr and the event pipe; the agent's last words are in once all three are closed.
    open_streams: int = 3
    #: The result the agent sent through the event pipe (it could not write its file: a full log disk).
    piped: dict[str, Any] | None = None
    #: When the supervisor first saw it exited (it waits briefly for a piped result).
    exited_at: float | None = None

    def result(self) -> dict[str, Any]:
        """What the agent wrote before exiting ({} if it died first)."""
        try:
            with open(self.result_file) as f:
                return json.load(f)
        except (OSError, ValueError):
            return self.piped or {}

    def last_words_pending(self, now: float, code: int) -> bool:
        """Whether its result may still be on its way through the event pipe (for up to 2 s), for an
        agent that exited with ``code``. Not for one a signal ended (``code`` < 0: SIGKILL, chaos):
        it said nothing more, and its pipes stay open while its standby interpreter, which inherited
        them, winds down -- half a second in the soak, which the respawn and the failure report of
        the group waited for."""
        if self.exited_at is None:
            self.exited_at = now
        if code < 0:
            return False
        return (
            self.piped is None
            and self.open_streams > 0
            and now - self.exited_at < 2.0
            and not os.path.exists(self.result_file)
        )


def start_agent(
    opts: LaunchOptions,
    job: env.JobEnv,
    *,
    run_id: str,
    group_dir: str,
    incarnation: int,
    news: queue.Queue[News],
    extra_env: dict[str, str] | None = None,
) -> tuple[AgentProcess, bool]:
    """Start incarnation ``incarnation`` of the agent of ``job``'s replica group; its output and
    events arrive on ``news``. Also says whether its configuration file could be written (on a full
    log disk it travels through the agent's stdin instead: logdisk.py)."""
    gid = job.replica_group_id
    with contextlib.suppress(OSError):  # a full disk: see write_or_none below
        os.makedirs(group_dir, exist_ok=True)
    result_file = os.path.join(group_dir, f"agent{incarnation}.result.json")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(result_file)
    read_fd, write_fd = os.pipe()
    cfg = AgentConfig.for_group(
        opts,
        run_id=run_id,
        log_dir=os.path.join(group_dir, "workers"),
        event_fd=write_fd,
        result_file=result_file,
    )
    config_file = write_or_none(os.path.join(group_dir, f"agent{incarnation}.json"), cfg.to_json())
    child_env = {**env.inherited(), **job.to_environ(), **(extra_env or {}), env.PYTHONUNBUFFERED: "1"}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "ftlaunch.launcher.agent", config_file or "-"],
            stdin=subprocess.DEVNULL if config_file else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env,
            pass_fds=(write_fd,),
            start_new_session=True,  # Ctrl-C reaches the supervisor only; it stops the groups in order
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    if proc.stdin is not None:
        with proc.stdin:
            proc.stdin.write(cfg.to_json().encode())
    assert proc.stdout is not None and proc.stderr is not None  # noqa: S101 - Popen(PIPE) contract
    for name, stream in (("out", proc.stdout), ("err", proc.stderr)):
        threading.Thread(
            target=_read_lines,
            args=(news, name, gid, incarnation, stream),
            daemon=True,
            name=f"ftlaunch-{job.replica_id}-{name}",
        ).start()
    threading.Thread(
        target=_read_events,
        args=(news, gid, incarnation, read_fd),
        daemon=True,
        name=f"ftlaunch-{job.replica_id}-ev",
    ).start()
    return AgentProcess(proc, result_file), config_file is not None


def _read_lines(news: queue.Queue[News], kind: str, gid: int, inc: int, stream: IO[bytes]) -> None:
    with stream:
        for raw in iter(stream.readline, b""):
            news.put((kind, gid, inc, raw.decode(errors="replace").rstrip("\n")))
    news.put(("eof", gid, inc, kind))


def _read_events(news: queue.Queue[News], gid: int, inc: int, fd: int) -> None:
    with os.fdopen(fd, "rb") as f:
        for raw in f:
            try:
                news.put(("event", gid, inc, json.loads(raw)))
            except ValueError:
                continue
    news.put(("eof", gid, inc, "event"))
