"""Health checks before a group (re)joins (``--health-check``): the agent's gate running real check
processes against a real lighthouse -- a check that fails twice then passes, one that hangs (killed
at its timeout), and what ``/status`` and ``/metrics`` then say; the built-in ``python -m
ftlaunch.health``; the launcher's summary. The whole path through ``ftlaunch``, with a group whose
check never passes while the others finish: tests/processes/test_health_e2e.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import urllib.request

import psutil
import pytest

from ftlaunch.launcher.health_gate import HealthGate, retry_delay, run_check
from ftlaunch.launcher.report import health_lines
from ftlaunch.lighthouse.client import LighthouseClient
from ftlaunch.lighthouse.health import HealthBook, HealthReport
from ftlaunch.lighthouse.server import LighthouseServer
from ftlaunch.lighthouse.status import HealthStatus, LighthouseStatus


def test_retry_delay_doubles_up_to_its_cap() -> None:
    assert [retry_delay(n, 1.0, 10.0) for n in range(6)] == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0]
    assert retry_delay(10_000, 1.0, 60.0) == 60.0


def test_the_book_records_a_streak_and_the_recovery() -> None:
    book = HealthBook()
    fail = HealthReport("check", False, "no GPU", 1.0)
    assert book.report("rg1", fail, 10.0) == "health_failed"
    assert book.report("rg1", fail, 11.0) is None  # the same streak
    assert book.report("rg1", HealthReport("check", True, "ok"), 12.0) == "health_passed"
    assert book.report("rg1", HealthReport("check", True, "ok"), 13.0) is None
    (entry,) = book.snapshot()
    assert (entry.ok, entry.failures, entry.streak, entry.failing_since, entry.retry_in) == (
        True,
        2,
        0,
        None,
        None,
    )
    assert HealthStatus.from_json(entry.to_json()) == entry


def counting_check(tmp_path, fails: int) -> str:
    """A check that fails ``fails`` times (saying which try it was), then passes."""
    script = tmp_path / "check.sh"
    script.write_text(
        textwrap.dedent(f"""\
        n=$(cat {tmp_path}/count 2>/dev/null || echo 0); n=$((n+1)); echo $n > {tmp_path}/count
        echo "checking the GPU (try $n)"
        if [ $n -le {fails} ]; then echo "GPU 0: uncorrectable ECC error (try $n)" >&2; exit 3; fi
        echo "all good"
        """)
    )
    return f"sh {script}"


def test_a_check_failing_twice_then_passing_keeps_the_group_out_then_lets_it_join(tmp_path) -> None:
    """Real check processes, a real lighthouse: each failure is reported with the check's last line
    and retried after a pause; the third run passes and the gate lets the group go on."""
    command = counting_check(tmp_path, fails=2)
    pauses: list[float] = []
    seen: list[tuple[bool, int]] = []
    with LighthouseServer("127.0.0.1:0", token="t") as server:

        def report(rid: str, health: HealthReport) -> None:
            with LighthouseClient(server.address, connect_timeout=5, token="t") as client:
                client.report_health(rid, health)
            entry = next(h for h in server.snapshot().health if h.replica_id == rid)
            seen.append((entry.ok, entry.failures))

        gate = HealthGate(command, 30.0, "rg1", report, sleep=pauses.append, first_retry=0.5)
        assert gate.wait_until_healthy() == 2
        assert pauses == [0.5, 1.0]  # the backoff between the runs
        assert seen == [(False, 1), (False, 2), (True, 2)]  # out while failing, then in
        status = server.snapshot()
        (entry,) = status.health
        assert (entry.replica_id, entry.check, entry.ok, entry.failures) == ("rg1", command, True, 2)
        events = [(h.event, h.replica_id) for h in reversed(status.history) if h.event.startswith("health")]
        assert events == [("health_failed", "rg1"), ("health_passed", "rg1")]
        failed = next(h for h in status.history if h.event == "health_failed")
        assert failed.detail == f"{command}: GPU 0: uncorrectable ECC error (try 1)"  # the last line
        metrics = urllib.request.urlopen(server.address + "/metrics", timeout=10).read().decode()
        assert 'ftlaunch_group_health_check_failures_total{replica_id="rg1"} 2.0' in metrics
        assert 'ftlaunch_group_health_failing{replica_id="rg1"} 0.0' in metrics
    assert (tmp_path / "count").read_text().strip() == "3"


def test_a_hanging_check_is_killed_at_its_timeout_with_everything_it_started(tmp_path) -> None:
    """The first run hangs (in a grandchild, too): killed at its timeout and counted failed, with
    its last line; nothing of it is left; the next run passes."""
    flag = tmp_path / "hung-once"
    command = (
        f"if [ -e {flag} ]; then exit 0; fi; touch {flag}; echo 'probing the NIC'; sleep 120 & sleep 120"
    )
    started = time.monotonic()
    run = run_check(command, timeout=1.0)
    assert time.monotonic() - started < 15
    assert (run.ok, run.code) == (False, None)
    assert run.last_line == "timed out after 1s and was killed (its last line: probing the NIC)"
    # A killed grandchild is a zombie until init reaps it (late on a loaded host): dead, not left.
    left = [
        p
        for p in psutil.process_iter(["cmdline", "status"])
        if p.info["cmdline"] == ["sleep", "120"] and p.info["status"] != psutil.STATUS_ZOMBIE
    ]
    assert not [p for p in left if _session(p) == run.pid], left
    pauses: list[float] = []
    gate = HealthGate(command, 1.0, "rg2", None, sleep=pauses.append)
    assert gate.wait_until_healthy() == 0  # the flag is there now: it passes
    flag.unlink()
    assert HealthGate(command, 1.0, "rg2", None, sleep=pauses.append).wait_until_healthy() == 1
    assert pauses == [1.0]


def _session(p: psutil.Process) -> int | None:
    try:
        return os.getsid(p.pid)
    except OSError:
        return None


def test_the_builtin_check(tmp_path) -> None:
    """``python -m ftlaunch.health``: device skipped with its reason on a CPU machine, the
    checkpoint directory, memory, the lighthouse (``FTLAUNCH_LIGHTHOUSE``, as the rendezvous sets
    it), and a Python hook; the last line is the verdict ftlaunch reports."""
    (tmp_path / "mychecks.py").write_text(
        "def nic():\n    return 'eth1 is down'\n\ndef fine():\n    return None\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def health(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ftlaunch.health", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**env, **extra},
        )

    with LighthouseServer("127.0.0.1:0") as server:
        ok = health(
            "--checkpoint-dir", str(tmp_path), "--hook", "mychecks:fine", FTLAUNCH_LIGHTHOUSE=server.address
        )
        assert ok.returncode == 0, ok.stdout + ok.stderr
        lines = ok.stdout.splitlines()
        gpu = os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1")
        assert lines[-1] == (
            "healthy: 5 check(s) passed, 0 skipped" if gpu else "healthy: 4 check(s) passed, 1 skipped"
        )
        assert f"ok   lighthouse: {server.address} answers" in lines
        assert f"ok   checkpoint: {tmp_path} is writable" in lines
        device = next(line for line in lines if " device: " in line)
        if not os.path.exists("/dev/nvidiactl"):
            assert device.startswith("skip device: no GPU"), device
        assert not list(tmp_path.glob(".ftlaunch-health-*"))  # its probe file is gone
    bad = health(
        "--checkpoint-dir",
        str(tmp_path / "missing"),
        "--hook",
        "mychecks:nic",
        "--lighthouse-timeout",
        "1",
        FTLAUNCH_LIGHTHOUSE="127.0.0.1:1",
    )
    assert bad.returncode == 1
    lines = bad.stdout.splitlines()
    assert "FAIL mychecks:nic: eth1 is down" in lines
    assert any(line.startswith("FAIL lighthouse: 127.0.0.1:1 does not answer") for line in lines)
    assert (
        lines[-1]
        == f"unhealthy: checkpoint: {tmp_path / 'missing'} is not a directory (and 2 more check(s) failed)"
    )
    usage = health("--hook", "nocolon")
    assert usage.returncode == 2 and "is not MODULE:FUNCTION" in usage.stderr


def test_the_summary_names_the_check_and_its_last_line() -> None:
    status = LighthouseStatus(
        health=(
            HealthStatus("rg0", "hc", True),
            HealthStatus("rg1", "hc", True, "all good", failures=2),
            HealthStatus("rg2", "hc", False, "GPU 0: ECC error", failures=7, streak=7),
        )
    )
    assert health_lines(status.health) == [
        "[ftlaunch] health check of rg1 failed 2 time(s), then passed (the group joined): hc",
        "[ftlaunch] WARNING: health check of rg2 still failing at the end (7 failure(s); the group "
        "stayed out): "
        "hc: GPU 0: ECC error",
    ]
    assert LighthouseStatus.from_json(status.to_json()).health == status.health


def test_a_malformed_report_is_refused() -> None:
    with LighthouseServer("127.0.0.1:0") as server:
        req = urllib.request.Request(
            server.address + "/health",
            data=b'{"replica_id": "rg0", "check": "x", "ok": "yes"}',
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400
        assert server.snapshot().health == ()


def test_the_gate_gives_up_once_the_training_finished_without_the_group(tmp_path) -> None:
    """Under plain torchrun nobody stops a group its check keeps out: the gate asks (after each
    failure) whether the training finished, and then ends with the reason."""
    from ftlaunch.errors import TrainingFinishedError

    answers = iter([False, RuntimeError("lighthouse unreachable"), True])

    def finished() -> bool:
        a = next(answers)
        if isinstance(a, Exception):
            raise a  # an unreadable lighthouse is no verdict
        return a

    pauses: list[float] = []
    gate = HealthGate(
        "echo 'GPU 1 missing'; exit 1", 10.0, "rg2", None, sleep=pauses.append, finished=finished
    )
    with pytest.raises(
        TrainingFinishedError,
        match=r"rg2: the training finished while its health check kept it out \(3 failure",
    ):
        gate.wait_until_healthy()
    assert pauses == [1.0, 2.0] and gate.failures == 3
