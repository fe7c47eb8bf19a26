"""Test helpers for the process-group tests: a pool of real worker processes.

Workers are started with multiprocessing's spawn context and stay alive across calls, so one
test can configure, reconfigure, kill and inspect them. A worker runs module-level functions
(picklable by reference) and keeps per-process objects in `STATE`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

MARKER = "FTLAUNCH_TEST_SESSION"

#: Per-worker objects (process groups, stores) that must survive between calls.
STATE: dict[str, Any] = {}


def start_unmarked_resource_tracker() -> None:
    """Start multiprocessing's resource tracker without the test-session marker.

    Spawning a process starts Python's per-interpreter resource tracker, a helper that lives as
    long as the interpreter (pytest) itself. It is not something a test leaked, so it must not
    carry the marker the leak check looks for.
    """
    from multiprocessing import resource_tracker

    marker = os.environ.pop(MARKER, None)
    try:
        resource_tracker.ensure_running()
    finally:
        if marker is not None:
            os.environ[MARKER] = marker


def _worker_main(conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        fn, args = msg
        try:
            result = fn(*args)
        except BaseException as e:  # report everything, including AssertionError, to the test
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        else:
            conn.send(("ok", result))


class WorkerError(AssertionError):
    """A worker raised; the message carries its traceback."""


class WorkerPool:
    """`n` spawned worker processes; use as a context manager so none is left behind."""

    def __init__(self, n: int) -> None:
        start_unmarked_resource_tracker()
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child,), name=f"pg-worker-{i}", daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self.procs.append(proc)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pid(self, i: int) -> int:
        return self.procs[i].pid

    def submit(self, i: int, fn: Callable[..., Any], *args: Any) -> None:
        self._conns[i].send((fn, args))

    def result(self, i: int, timeout: float) -> Any:
        conn = self._conns[i]
        if not conn.poll(timeout):
            raise WorkerError(f"worker {i} did not answer within {timeout}s")
        try:
            status, value = conn.recv()
        except EOFError:
            raise WorkerError(f"worker {i} died (exit code {self.procs[i].exitcode})") from None
        if status == "err":
            raise WorkerError(f"worker {i} failed: {value}")
        return value

    def run(
        self,
        ranks: Sequence[int],
        fn: Callable[..., Any],
        args: Sequence[tuple[Any, ...]],
        timeout: float = 60.0,
    ) -> list[Any]:
        """Run `fn(*args[k])` on worker `ranks[k]` concurrently; return the results in order."""
        for i, a in zip(ranks, args, strict=True):
            self.submit(i, fn, *a)
        deadline = time.monotonic() + timeout
        return [self.result(i, max(0.1, deadline - time.monotonic())) for i in ranks]

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        os.kill(self.procs[i].pid, sig)
        if sig == signal.SIGKILL:
            self.procs[i].join(10)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 15
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
