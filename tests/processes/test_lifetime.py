"""`lifetime.StopSignals`: a stop signal ends the wait at once, and no signal can hang the process.

The stress test sends 3,000 signals (``STOP_ROUNDS``), each at a random moment of a loop that waits
10 µs at a time (~4 s). The pattern it replaces (``signal.signal(sig, lambda *_: event.set())``
around ``event.wait(t)``) hung there about once in 1,000 signals: the handler, run inside
`Condition._acquire_restore`, blocks on the event's lock, which the main thread itself holds.
``OLD_PATTERN=1`` runs the same child with it: it failed in each of 5 runs.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

CHILD = r"""
import os, signal, sys, threading
from ftlaunch.lifetime import StopSignals

class EventStop:  # the replaced pattern, for OLD_PATTERN=1
    def __init__(self):
        self.received, self._event = None, threading.Event()
        def on(signum, frame):
            self.received = signum
            self._event.set()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on)
    def wait(self, timeout=None):
        return self._event.wait(timeout)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        pass

Stop = EventStop if os.environ.get("OLD_PATTERN") else StopSignals
for i in range(int(sys.argv[1])):
    with Stop() as stop:
        print("ready", flush=True)
        while not stop.wait(float(sys.argv[2])):
            pass
        print("got", stop.received, flush=True)
"""


@contextlib.contextmanager
def _child(rounds: int, wait: float) -> Iterator[subprocess.Popen]:
    """The child above, waiting ``wait`` seconds at a time for ``rounds`` stop signals; killed on exit."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(rounds), str(wait)], stdout=subprocess.PIPE, bufsize=0
    )
    assert proc.stdout is not None
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        _pending.pop(proc.stdout.fileno(), None)
        proc.stdout.close()


_pending: dict[int, bytes] = {}  # a child's output read but not yet split into lines


def _line(proc: subprocess.Popen, timeout: float) -> str:
    """The child's next line (read from its pipe directly: a buffered reader would hide from
    select() a line it already holds)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    while b"\n" not in _pending.get(fd, b""):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no line from the child within {timeout}s (hung in a signal handler?)"
        chunk = os.read(fd, 4096)
        assert chunk, "the child exited"
        _pending[fd] = _pending.get(fd, b"") + chunk
    line, _, _pending[fd] = _pending[fd].partition(b"\n")
    return line.decode().strip()


def test_a_stop_signal_ends_the_wait_at_once():
    with _child(1, 30.0) as proc:
        assert _line(proc, 20) == "ready"
        proc.send_signal(signal.SIGTERM)
        assert _line(proc, 5) == f"got {int(signal.SIGTERM)}"  # long before the 30 s wait would end
        assert proc.wait(10) == 0


def test_no_stop_signal_hangs_the_process():
    rounds = int(os.environ.get("STOP_ROUNDS", "3000"))
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    with _child(rounds, 1e-5) as proc:
        for i in range(rounds):
            assert _line(proc, 20) == "ready"
            time.sleep(rng.uniform(0.0, 0.002))  # anywhere in the loop: in the wait, or between two
            sig = (signal.SIGTERM, signal.SIGINT)[i % 2]
            proc.send_signal(sig)
            assert _line(proc, 5) == f"got {int(sig)}", f"signal {i + 1} of {rounds}"
        assert proc.wait(10) == 0


def test_closing_puts_the_previous_handlers_back():
    from ftlaunch.lifetime import StopSignals

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with StopSignals() as stop:
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
        assert not stop.wait(0.01) and stop.received is None
    assert {sig: signal.getsignal(sig) for sig in before} == before
