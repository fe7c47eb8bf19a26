"""the warm standby interpreter (`ftlaunch.bootstrap.zygote`) and the worker's proxy for it
(`ftlaunch.bootstrap.zygote_proxy`).

In one process: the wire (a JSON line with the worker's descriptors attached), the switch, and the
fallback when the announced standby is not there. With real processes: a worker handed over runs
its script as ``python SCRIPT`` would (argv, cwd, environment, stdout/stderr, exit code, atexit),
with torch already imported; the proxy ends as the real worker did (exit code, signal); a
SIGKILLed proxy takes the real worker (and its Baby child) down; a SIGSTOPped proxy stops the real
worker and SIGCONT continues it (and the other way round); SIGTERM to the proxy reaches the real worker; and
with the standby gone the worker starts cold. Through ``ftlaunch``: a restarted worker goes through the
standby and the group trains on (slow).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from ftlaunch import env, phases
from ftlaunch.bootstrap import zygote_proxy
from ftlaunch.launcher import procs

SCRIPT = """
import atexit, json, os, sys, time
out = {"argv": sys.argv, "cwd": os.getcwd(), "var": os.environ.get("ZYGOTE_TEST_VAR"), "pid": os.getpid(),
       "ppid": os.getppid(), "path0": sys.path[0], "had_torch": "torch" in sys.modules,
       "priority": os.getpriority(os.PRIO_PROCESS, 0)}
import torch
out["threads"] = torch.get_num_threads()
print(json.dumps(out), flush=True)
print("to stderr", file=sys.stderr, flush=True)
atexit.register(lambda: print("atexit ran", flush=True))
mode = sys.argv[1]
if mode == "sleep":
    open(sys.argv[2], "w").write(str(os.getpid()))
    while True:
        time.sleep(0.05)
sys.exit(int(mode))
"""


# ------------------------------------------------------------------------------ in one process
def test_wire_carries_a_message_and_descriptors() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    try:
        zygote_proxy.send_message(a, {"argv": ["x", "é"], "env": {"A": "1" * 70000}}, [r])
        zygote_proxy.send_message(a, {"exit": 3})
        buffer = bytearray()
        first, fds = zygote_proxy.read_message(b, buffer, max_fds=3)
        assert first == {"argv": ["x", "é"], "env": {"A": "1" * 70000}} and len(fds) == 1
        os.write(w, b"!")
        assert os.read(fds[0], 1) == b"!"  # the same pipe, passed over
        os.close(fds[0])
        assert zygote_proxy.read_message(b, buffer) == ({"exit": 3}, [])
        a.close()
        assert zygote_proxy.read_message(b, buffer) == (None, [])
    finally:
        for s in (a, b):
            s.close()
        os.close(r)
        os.close(w)


def test_switch_and_fallback_without_a_standby(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert zygote_proxy.enabled({}) and zygote_proxy.enabled({env.FTLAUNCH_ZYGOTE: "1"})
    assert not zygote_proxy.enabled({env.FTLAUNCH_ZYGOTE: "off"})
    monkeypatch.delenv(env.FTLAUNCH_ZYGOTE_SOCKET, raising=False)
    assert zygote_proxy.hand_over(["s.py"]) is None  # none announced: silent cold start
    monkeypatch.setenv(env.FTLAUNCH_ZYGOTE_SOCKET, str(tmp_path / "gone.sock"))
    why = zygote_proxy.hand_over(["s.py"])
    monkeypatch.setenv(env.TORCHELASTIC_RESTART_COUNT, "0")
    assert zygote_proxy.hand_over(["s.py"]) is None  # a first start that beat the warm-up: nothing to say
    monkeypatch.setenv(env.TORCHELASTIC_RESTART_COUNT, "2")
    why = zygote_proxy.hand_over(["s.py"])
    assert why is not None and "not ready" in why
    monkeypatch.setenv(env.FTLAUNCH_ZYGOTE, "0")
    why = zygote_proxy.hand_over(["s.py"])
    assert why is not None and env.FTLAUNCH_ZYGOTE in why


# ---------------------------------------------------------------------------- real processes
def _start_zygote(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    path = str(tmp_path / "z.sock")
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "ftlaunch.bootstrap.zygote", path], stdin=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)  # listening: warmed up (an empty request is dropped)
            return proc, path
        except OSError:
            assert proc.poll() is None, "the standby interpreter died while warming up"
            time.sleep(0.1)
        finally:
            probe.close()
    proc.kill()
    raise AssertionError("the standby interpreter never listened")


def _worker(tmp_path: Path, sock: str, *args: str, **extra: str) -> subprocess.Popen[str]:
    script = tmp_path / "sub" / "script.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(SCRIPT)
    run_env = {**os.environ, env.FTLAUNCH_ZYGOTE_SOCKET: sock,
               env.FTLAUNCH_PHASE_LOG: str(tmp_path / "ph.jsonl"),
               "ZYGOTE_TEST_VAR": "hello", "OMP_NUM_THREADS": "1", **extra}  # fmt: skip
    return subprocess.Popen([sys.executable, "-u", "-m", "ftlaunch.bootstrap.prestart", str(script), *args],
                            cwd=tmp_path,
                            env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def _wait_for_file(path: Path, proc: subprocess.Popen[str]) -> int:
    deadline = time.monotonic() + 60
    while not (path.exists() and path.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    return int(path.read_text())


def _gone(pid: int, timeout: float = 10.0) -> bool:
    try:
        psutil.Process(pid).wait(timeout=timeout)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return False
    return True


def _status(pid: int) -> str:
    return psutil.Process(pid).status()


@pytest.mark.timeout(300)
def test_a_worker_handed_over_runs_as_python_script_would(tmp_path: Path) -> None:
    zygote, sock = _start_zygote(tmp_path)
    try:
        # argv, cwd, env, stdout/stderr, sys.path[0], exit code, atexit; torch already imported.
        proxy = _worker(tmp_path, sock, "3", FTLAUNCH_BACKEND="gloo")  # another backend: no Baby child
        out, err = proxy.communicate(timeout=60)
        assert proxy.returncode == 3, err
        first = json.loads(out.splitlines()[0])
        assert first["argv"] == [str(tmp_path / "sub" / "script.py"), "3"]
        assert (first["cwd"], first["var"], first["path0"]) == (str(tmp_path), "hello", str(tmp_path / "sub"))
        assert first["had_torch"] and first["threads"] == 1  # OMP_NUM_THREADS applied after the fork
        assert first["pid"] != proxy.pid and first["ppid"] == zygote.pid  # forked by the standby
        assert (
            out.splitlines()[-1] == "atexit ran"
            and "to stderr" in err
            and "ftlaunch.bootstrap.prestart" not in err
        )
        recs = phases.read(tmp_path / "ph.jsonl")
        assert any(r["phase"] == "zygote_handover" and r["pid"] == proxy.pid for r in recs)

        # SIGSTOP of the proxy stops the real worker; SIGCONT continues it; SIGTERM reaches it.
        proxy = _worker(tmp_path, sock, "sleep", str(tmp_path / "pid1"))
        real = _wait_for_file(tmp_path / "pid1", proxy)
        assert psutil.Process(real).ppid() == zygote.pid
        # What --chaos slow= throttles is the fork behind the proxy, not the proxy (which only waits);
        # this process stands for the agent here.
        assert [p.pid for p in procs.worker_processes([proxy.pid], os.getpid())] == [real]
        os.kill(proxy.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _status(real) != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _status(real) == psutil.STATUS_STOPPED
        os.kill(proxy.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while _status(real) == psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _status(real) != psutil.STATUS_STOPPED
        # ... and a real worker stopped directly stops its proxy (what the agent watches), and back.
        os.kill(real, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _status(proxy.pid) != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _status(proxy.pid) == psutil.STATUS_STOPPED
        os.kill(real, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while _status(proxy.pid) == psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _status(proxy.pid) != psutil.STATUS_STOPPED and _status(real) != psutil.STATUS_STOPPED
        proxy.send_signal(signal.SIGTERM)
        proxy.communicate(timeout=30)
        assert proxy.returncode == -signal.SIGTERM and _gone(real)  # died by the signal, as the worker did

        # A SIGKILLed proxy takes the real worker and its Baby child down at once.
        proxy = _worker(tmp_path, sock, "sleep", str(tmp_path / "pid2"))
        real = _wait_for_file(tmp_path / "pid2", proxy)
        tree = psutil.Process(real).children(recursive=True)
        assert tree  # its Baby child, forked from it (prestart.run)
        proxy.kill()
        proxy.communicate(timeout=30)
        assert _gone(real) and all(_gone(p.pid) for p in tree)

        # The standby stopped: the next worker starts cold, saying why.
        zygote.terminate()
        assert zygote.wait(timeout=30) == 0
        proxy = _worker(tmp_path, sock, "0", TORCHELASTIC_RESTART_COUNT="1")  # a restart says why
        out, err = proxy.communicate(timeout=120)
        assert proxy.returncode == 0, err
        assert json.loads(out.splitlines()[0])["pid"] == proxy.pid  # the script ran in the worker itself
        assert re.search(
            r"ftlaunch\.bootstrap\.prestart: standby interpreter not ready .*starting the worker here", err
        )
    finally:
        if zygote.poll() is None:
            zygote.kill()
            zygote.wait(timeout=30)


@pytest.mark.timeout(300)
def test_a_worker_that_starts_while_the_standby_warms_up_waits_for_it(tmp_path: Path) -> None:
    """The standby listens from its first instant: a worker started while it still imports torch
    (a group's first start, or the first after its agent was respawned mid-training) waits and is
    forked from it, instead of importing torch beside it (before: refused, it started cold). The
    warm-up runs at a lower priority where it can be raised back (root here), and the worker forked
    afterwards runs at the priority it would have had."""
    path = str(tmp_path / "z.sock")
    run_env = {**os.environ, env.FTLAUNCH_PHASE_LOG: str(tmp_path / "ph.jsonl")}
    zygote = subprocess.Popen([sys.executable, "-u", "-m", "ftlaunch.bootstrap.zygote", path],
                              stdin=subprocess.DEVNULL,
                              env=run_env)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(path):  # bound: from here on a worker may connect
            assert zygote.poll() is None and time.monotonic() < deadline, "the standby never bound its socket"
            time.sleep(0.01)
        launched = time.time()
        proxy = _worker(tmp_path, path, "0", FTLAUNCH_BACKEND="gloo")  # a first start (no restart count)
        out, err = proxy.communicate(timeout=240)
        assert proxy.returncode == 0, err
        first = json.loads(out.splitlines()[0])
        assert first["pid"] != proxy.pid and first["ppid"] == zygote.pid, err  # forked by the standby
        assert first["had_torch"] and "ftlaunch.bootstrap.prestart" not in err
        warm = [r for r in phases.read(tmp_path / "ph.jsonl") if r["phase"] == "zygote_warm"]
        assert len(warm) == 1 and launched < warm[0]["t"], (
            "precondition: the worker started during the warm-up"
        )
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert first["priority"] == mine  # the fork trains at the priority it would have had
        assert psutil.Process(zygote.pid).nice() == mine  # restored after the warm-up
        assert warm[0]["niced"] is (os.geteuid() == 0 or _nice_limit_allows(mine))
    finally:
        if zygote.poll() is None:
            zygote.terminate()
            zygote.wait(timeout=30)


def _nice_limit_allows(priority: int) -> bool:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= priority


def test_the_warm_up_is_niced_only_where_the_priority_can_be_raised_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An unprivileged process cannot raise its priority again (``RLIMIT_NICE`` 0, the usual
    default): then the warm-up runs at the process's priority, since a worker forked from a niced
    standby would train niced for good."""
    import resource

    from ftlaunch.bootstrap import zygote

    set_calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(os, "setpriority", lambda *a: set_calls.append(a))
    monkeypatch.setattr(os, "getpriority", lambda which, who: 0)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (0, 0))
    assert zygote._lower_priority() is None and set_calls == []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (20, 20))  # may go back to nice 0
    assert zygote._lower_priority() == 0 and set_calls == [(os.PRIO_PROCESS, 0, zygote.WARM_UP_NICE)]
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (0, 0))
    assert zygote._lower_priority() == 0  # root may


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_restarted_group_goes_through_the_standby(tmp_path: Path) -> None:
    """Through `ftlaunch`: rg1 is SIGKILLed at step 40 (by then its standby is warm), its restart
    is forked from the standby, heals and finishes bit-identical with rg0; chaos' SIGSTOP of the
    restarted (proxied) worker at step 120 really pauses its training for ``stop_for``; no process
    is left (the autouse fixture). ``signal=MIX,seed=4`` picks KILL workers, then STOP workers."""
    log = tmp_path / "ph.jsonl"
    train = Path(__file__).resolve().parents[2] / "scripts" / "train_ddp.py"
    run_env = {**os.environ, env.FTLAUNCH_PHASE_LOG: str(log), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "ftlaunch.launcher.cli", "--no-status", "--replicas", "2",
         "--chaos", "steps=40/120,group=1,signal=MIX,seed=4,stop_for=2", str(train), "--steps", "220",
         "--step-sleep", "0.03"],
        capture_output=True, text=True, timeout=380, env=run_env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    recs = phases.read(log)
    handed = [
        r
        for r in recs
        if r["phase"] == "zygote_handover" and r.get("replica") == "1" and r.get("restart") not in (None, "0")
    ]
    assert handed, "the restarted worker did not go through the standby"
    assert "2/2 groups ended bit-identical" in res.stdout, res.stdout
    assert re.search(r"SIGKILL rg1 workers at step \d+: group committed again", res.stdout), res.stdout
    m = re.search(r"SIGSTOP rg1 workers at step \d+: group committed again (\d+\.\d)s later", res.stdout)
    assert m and float(m.group(1)) >= 2.0, res.stdout  # the real worker was stopped, not only its proxy


def test_a_refusal_reaches_the_worker_as_its_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In one process: a standby that refuses (here: another interpreter's flags) -> `hand_over`
    returns why, and the worker starts cold; the standby got the worker's three descriptors."""
    from ftlaunch.bootstrap.zygote import Zygote

    server = Zygote(str(tmp_path / "z.sock"))
    request = {"interpreter": {**zygote_proxy.interpreter_identity(), "flags": [9]}}
    assert "flags differ" in server._refusal(request, [0, 1, 2], os.getuid())
    assert "another user" in server._refusal({}, [0, 1, 2], os.getuid() + 1)
    assert "3 standard descriptors" in server._refusal({}, [0], os.getuid())

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "r.sock"))
    listener.listen(1)
    got: dict[str, object] = {}

    def refuse() -> None:
        conn, _ = listener.accept()
        message, fds = zygote_proxy.read_message(conn, bytearray(), max_fds=3)
        got["fds"], got["argv"] = len(fds), (message or {}).get("argv")
        for fd in fds:
            os.close(fd)
        zygote_proxy.send_message(conn, {"refused": "busy elsewhere"})
        conn.close()

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    monkeypatch.setenv(env.FTLAUNCH_ZYGOTE_SOCKET, str(tmp_path / "r.sock"))
    monkeypatch.delenv(env.FTLAUNCH_ZYGOTE, raising=False)
    assert zygote_proxy.hand_over(["s.py", "x"]) == "standby interpreter refused: busy elsewhere"
    thread.join(timeout=10)
    assert got == {"fds": 3, "argv": ["s.py", "x"]}
    listener.close()
    server._listener.close()
    os.close(server._wake_r)
    os.close(server._wake_w)


STARTER = """
import sys, time
from ftlaunch.launcher.standby import Standby
standby = Standby.start(on_demand=True)
print(standby.proc.pid, standby.path, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_an_on_demand_standby_imports_nothing_until_asked_and_dies_with_its_starter(tmp_path: Path) -> None:
    """The standby torchrun's rendezvous starts (`ftlaunch.launcher.standby`, ``--on-demand``):
    listening from the start, a bare interpreter until a worker connects (a job whose workers never
    ask pays one idle interpreter), then warming up; its starter SIGKILLed meanwhile, it ends and
    removes its socket and the socket's directory."""
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True)
    try:
        assert starter.stdout is not None
        pid_text, path = starter.stdout.readline().split()
        standby = psutil.Process(int(pid_text))
        assert standby.ppid() == starter.pid and os.path.exists(path)
        time.sleep(2.0)
        assert "libtorch" not in Path(f"/proc/{pid_text}/maps").read_text(), "it imported torch unasked"
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(path)  # listening from its first instant (the starter bound it)
        probe.close()  # an empty request (dropped once it serves): the warm-up starts
        deadline = time.monotonic() + 60
        while "libtorch" not in Path(f"/proc/{pid_text}/maps").read_text():
            assert time.monotonic() < deadline, "a worker's connection did not start the warm-up"
            time.sleep(0.05)
        os.kill(starter.pid, signal.SIGKILL)  # mid-warm-up
        starter.wait(timeout=30)
        assert _gone(standby.pid), "the standby outlived its starter"
        assert not os.path.exists(os.path.dirname(path))
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait(timeout=30)
