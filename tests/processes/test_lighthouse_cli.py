"""`ftlaunch-lighthouse` / `python -m ftlaunch.lighthouse` as real subprocesses."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from ftlaunch.lighthouse import LighthouseClient, QuorumMember

pytestmark = pytest.mark.timeout(60)

MODULE_CMD = [sys.executable, "-m", "ftlaunch.lighthouse"]


def _read_line(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            return proc.stdout.readline()
        if proc.poll() is not None:
            break
    return ""


def _start(cmd: list[str], *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or dict(os.environ)
    )
    line = _read_line(proc)
    if not line.startswith("ftlaunch-lighthouse listening on http://"):
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"unexpected first line {line!r}; stderr: {err[-2000:]}")
    return proc, line.split(" on ", 1)[1].strip()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _stop(proc: subprocess.Popen, sig: int) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_module_starts_serves_and_stops_cleanly(sig):
    proc, addr = _start(
        MODULE_CMD,
        "--min-replicas",
        "2",
        "--join-timeout",
        "1.5",
        "--quorum-tick",
        "0.05",
        "--heartbeat-timeout",
        "2.5",
        "--log-level",
        "warning",
    )
    try:
        assert addr.startswith("http://127.0.0.1:") and not addr.endswith(":0")
        status = _get(addr + "/v1/status")
        assert status["version"] == 1
        assert status["options"] == {
            "min_replicas": 2,
            "join_timeout": 1.5,
            "heartbeat_timeout": 2.5,
            "quorum_tick": 0.05,
            "admin": False,
        }
    finally:
        code = _stop(proc, sig)
    assert code == 0


def test_console_script_with_token_from_environment():
    exe = shutil.which("ftlaunch-lighthouse")
    assert exe, "console script not installed (pip install -e .)"
    env = {**os.environ, "FTLAUNCH_TOKEN": "envtoken"}
    proc, addr = _start([exe], env=env)
    try:
        client = LighthouseClient(addr, token="envtoken")
        client.quorum(QuorumMember("a"), timeout=10)
        client.report_failure("a", "from the test")
        assert _get(addr + "/status")["groups"][0]["health"] == "failed"
        client.close()
    finally:
        code = _stop(proc, signal.SIGTERM)
    assert code == 0


def test_the_straggler_policy_from_the_flag_or_the_environment():
    env = {**os.environ, "FTLAUNCH_STRAGGLERS": "replace"}
    for args, policy in (((), "replace"), (("--stragglers", "report"), "report")):
        proc, addr = _start(MODULE_CMD, *args, env=env)
        try:
            assert _get(addr + "/status")["stragglers"]["policy"] == policy
        finally:
            assert _stop(proc, signal.SIGTERM) == 0
    bad = subprocess.run(
        MODULE_CMD, capture_output=True, text=True, timeout=60, env={**env, "FTLAUNCH_STRAGGLERS": "evict"}
    )
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        "ftlaunch-lighthouse: error: environment variable FTLAUNCH_STRAGGLERS='evict' is not one of "
        "report, replace"
    ]


@pytest.mark.parametrize(
    "args,code,fragment",
    [
        (["--min-replicas", "0"], 2, "--min-replicas"),
        (["--join-timeout", "soon"], 2, "--join-timeout"),
        (["--heartbeat-timeout", "-1"], 2, "--heartbeat-timeout"),
        (["--bogus"], 2, "unrecognized arguments"),
        (["--log-level", "LOUD"], 2, "--log-level"),
        (["--quorum-tick", "0"], 2, "--quorum-tick: '0' is out of range: use a duration of 10 ms to 60 s"),
        (["--quorum-tick", "1e-7"], 2, "--quorum-tick: '1e-7' is out of range"),
        (["--quorum_tick_ms", "0.0001"], 2, "--quorum_tick_ms: '0.0001' ms is out of range"),
        (
            ["--heartbeat-timeout", "0"],
            2,
            "--heartbeat-timeout: '0' is out of range: use a duration of 50 ms",
        ),
        (["--heartbeat-timeout", "1e-9"], 2, "--heartbeat-timeout: '1e-9' is out of range"),
        (["--join-timeout", "inf"], 2, "--join-timeout: 'inf' is not a duration"),
        (["--startup-grace", "nan"], 2, "--startup-grace: 'nan' is not a duration"),
        (["--expected-replicas", "-1"], 2, "--expected-replicas: '-1' is out of range"),
        (["--stragglers", "evict"], 2, "argument --stragglers: invalid choice: 'evict'"),
        (["--bind", "127.0.0.1:99999"], 1, "bind"),
        (["--bind", "no.such.host.invalid:0"], 1, "cannot bind"),
    ],
)
def test_bad_flags_give_one_line_error(args, code, fragment):
    proc = subprocess.run([*MODULE_CMD, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ftlaunch-lighthouse: error:") and fragment in lines[0]
    assert proc.stdout == ""


def test_port_in_use_is_a_clean_error():
    proc, addr = _start(MODULE_CMD)
    try:
        port = addr.rsplit(":", 1)[1]
        second = subprocess.run(
            [*MODULE_CMD, "--bind", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 1 and "cannot bind" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1
    finally:
        assert _stop(proc, signal.SIGTERM) == 0


def test_torchft_flags_are_aliases_with_their_units():
    """torchft README's command (underscores, milliseconds) starts the same lighthouse."""
    proc, addr = _start(
        MODULE_CMD,
        "--min_replicas",
        "2",
        "--quorum_tick_ms",
        "100",
        "--join_timeout_ms",
        "10000",
        "--heartbeat_timeout_ms",
        "2500",
        "--log-level",
        "error",
    )
    try:
        assert _get(addr + "/v1/status")["options"] == {
            "min_replicas": 2,
            "join_timeout": 10.0,
            "heartbeat_timeout": 2.5,
            "quorum_tick": 0.1,
            "admin": False,
        }
    finally:
        assert _stop(proc, signal.SIGTERM) == 0


def test_torchft_millisecond_flag_is_validated():
    proc = subprocess.run(
        [*MODULE_CMD, "--join_timeout_ms", "soon"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--join_timeout_ms" in proc.stderr and "milliseconds" in proc.stderr


def _tokenless_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "FTLAUNCH_TOKEN"}


def test_reachable_bind_without_token_is_refused_in_one_line():
    """a lighthouse anyone on the network could join, stop or poison is not started."""
    proc = subprocess.run(
        [*MODULE_CMD, "--bind", "0.0.0.0:0"], capture_output=True, text=True, timeout=60, env=_tokenless_env()
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "without a job token" in lines[0] and "--token" in lines[0], proc.stderr


def test_loopback_without_token_serves_and_says_so():
    proc, addr = _start(MODULE_CMD, env=_tokenless_env())
    try:
        client = LighthouseClient(addr)
        client.quorum(QuorumMember("a"), timeout=10)  # a tokenless lighthouse lets groups in
        client.close()
    finally:
        assert _stop(proc, signal.SIGTERM) == 0
    err = proc.stderr.read() if proc.stderr else ""
    assert "no job token" in err and "loopback only" in err, err
