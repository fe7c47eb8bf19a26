"""How soon the supervisor acts on an agent's death, and how soon a dead agent's standby lets go.

An agent killed by a signal (chaos' ``target=agent``) said nothing more: the supervisor acts at once
(kills the orphans, tells the lighthouse, respawns) instead of waiting up to 2 s for last words on
pipes that its standby interpreter, which inherited them, still holds. And the standby itself ends
without the interpreter's teardown (0.8-0.9 s with torch imported on the loaded 2-core machine),
so those pipes close at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftlaunch import env, phases
from ftlaunch.launcher.agent_process import AgentProcess


def test_an_agent_a_signal_ended_has_no_last_words_to_wait_for(tmp_path: Path) -> None:
    agent = AgentProcess(proc=None, result_file=str(tmp_path / "none.json"))  # type: ignore[arg-type]
    assert agent.open_streams == 3  # its pipes are still open (its standby holds them)
    assert not agent.last_words_pending(10.0, -signal.SIGKILL)
    exited = AgentProcess(proc=None, result_file=str(tmp_path / "none.json"))  # type: ignore[arg-type]
    assert exited.last_words_pending(10.0, 1)  # an agent that exited itself may still be sending them
    assert exited.last_words_pending(11.9, 1) and not exited.last_words_pending(12.1, 1)  # at most 2 s


@pytest.mark.timeout(120)
def test_a_stopped_standby_ends_without_the_interpreters_teardown(tmp_path: Path) -> None:
    """Its stdout closes as soon as it is stopped: the reader sees EOF before a torch-laden
    interpreter's teardown could have finished (an atexit handler the test registers in the
    standby through `sitecustomize` would run in a teardown; it never does)."""
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "atexit_ran"
    (site / "sitecustomize.py").write_text(
        f"import atexit\natexit.register(lambda: open({str(marker)!r}, 'w').write('1'))\n"
    )
    path, log = str(tmp_path / "z.sock"), tmp_path / "ph.jsonl"
    run_env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               env.FTLAUNCH_PHASE_LOG: str(log)}  # fmt: skip
    zygote = subprocess.Popen([sys.executable, "-u", "-m", "ftlaunch.bootstrap.zygote", path],
                              stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, env=run_env)  # fmt: skip
    try:
        deadline = time.monotonic() + 100
        while not any(r["phase"] == "zygote_ready" for r in phases.read(log)):  # warm, serving
            assert zygote.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        zygote.terminate()
        assert zygote.stdout is not None
        assert zygote.stdout.read() == b""  # EOF: it let go of the pipe
        assert zygote.wait(timeout=30) == 0
    finally:
        if zygote.poll() is None:
            zygote.kill()
            zygote.wait(timeout=30)
    assert not marker.exists()  # no teardown ran (before: sys.exit, and its atexit handlers)
