"""the worker imports torch once and forks its Baby child (`ftlaunch.bootstrap.prestart.fork`).

Real processes throughout: ``python -m ftlaunch.bootstrap.prestart SCRIPT`` as the launcher runs a worker.

- the child is a fork (same executable image, no second interpreter start), adopted by the first
  ``ProcessGroupBabyGloo``, and runs collectives;
- a fork is refused when another thread is alive at the fork (the child is killed before it runs
  anything of its own, and reaped) and an interpreter is started instead;
- ``FTLAUNCH_PRESTART_FORK=0``: no early torch import, the child is its own interpreter;
- a SIGKILLed worker leaves no forked child behind;
- ``python -m ftlaunch.run`` (the public name) explains itself and refuses a missing script.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ftlaunch import env, phases

PROBE = """
import json, os, sys, threading, time
had_torch = "torch" in sys.modules  # what the script finds when it starts
from ftlaunch.bootstrap import prestart
if sys.argv[1] == "thread":  # a thread is alive: a fork must be refused
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
    prestart.start("gloo", forked=True)
    stop.set()
early = prestart._started.get("gloo")
out = {"had_torch": had_torch, "early": early[0].pid if early else None,
       "kind": type(early[0]).__name__ if early else None}
if early:
    if sys.argv[1] == "sleep":
        print(json.dumps(out), flush=True)
        time.sleep(120)
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    from ftlaunch.process_group import ProcessGroupBabyGloo
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, \
timeout=timedelta(seconds=30))
    pg = ProcessGroupBabyGloo(timeout=30.0)
    out["adopted"] = pg.child_pid
    pg.wait_ready()
    with open(f"/proc/{early[0].pid}/cmdline", "rb") as f:
        out["child_cmdline"] = [x.decode() for x in f.read().split(b"\\0")[:3]]
    if sys.argv[1] == "env":  # set after the child was forked: the child's backend must see it
        os.environ["GLOO_SOCKET_IFNAME"] = "ftl-none0"
        try:
            pg.configure(f"127.0.0.1:{store.port}/probe-env", 0, 1)
            out["configure_error"] = None
        except Exception as e:
            out["configure_error"] = str(e)
        del os.environ["GLOO_SOCKET_IFNAME"]
    pg.configure(f"127.0.0.1:{store.port}/probe", 0, 1)
    t = torch.full((4,), 3.0)
    pg.allreduce([t], dist.ReduceOp.SUM).wait()
    out["sum"] = t.tolist()
    if sys.argv[1] == "abort":  # a hung peer's abort kills the child: the spare takes over
        out["spares"] = [c.pid for c, _ in prestart._spares.get("gloo", [])]
        pg.abort()
        t0 = time.monotonic()
        pg.configure(f"127.0.0.1:{store.port}/probe2", 0, 1)
        out["reconfigure_s"] = time.monotonic() - t0
        out["after_abort"] = pg.child_pid
        t = torch.full((4,), 2.0)
        pg.allreduce([t], dist.ReduceOp.SUM).wait()
        out["sum_after_abort"] = t.tolist()
        out["next_spare"] = pg._spare.pid if pg._spare is not None else None
    unused = [c.pid for c, _ in prestart._spares.get("gloo", [])]  # forked beside it, never needed
    pg.shutdown()
    out["child_alive_after_shutdown"] = os.path.exists(f"/proc/{early[0].pid}")
    out["unused_spares"] = unused
    out["unused_spares_alive_after_shutdown"] = [p for p in unused if os.path.exists(f"/proc/{p}")]
print(json.dumps(out), flush=True)
"""


def run_probe(tmp_path: Path, mode: str, **extra_env: str) -> tuple[dict, list[dict]]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    log = tmp_path / f"phases_{mode}.jsonl"
    run_env = {**os.environ, env.FTLAUNCH_BACKEND: "", "CUDA_VISIBLE_DEVICES": "",
               env.FTLAUNCH_PHASE_LOG: str(log), **extra_env}  # fmt: skip
    res = subprocess.run([sys.executable, "-u", "-m", "ftlaunch.bootstrap.prestart", str(script), mode],
                         capture_output=True, text=True, timeout=150, env=run_env, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), phases.read(log)


@pytest.mark.timeout(180)
def test_the_worker_imports_torch_once_and_forks_its_baby_child(tmp_path: Path) -> None:
    out, recs = run_probe(tmp_path, "plain")
    assert out["had_torch"]  # imported before the script ran: the script's own import is free
    assert out["kind"] == "ForkedChild"
    # A fork runs the worker's image: the same command line, not `python -m ...baby.child`.
    assert "ftlaunch.process_group.baby.child" not in out["child_cmdline"]
    assert out["child_cmdline"][1:3] == ["-u", "-m"]
    assert out["adopted"] == out["early"]
    assert out["sum"] == [3.0] * 4  # the forked child runs the collective
    assert not out["child_alive_after_shutdown"]
    # The spare forked beside the child, never needed (no abort), ends with the group (gang.close()).
    assert len(out["unused_spares"]) == 1 and out["unused_spares_alive_after_shutdown"] == []
    spawned = [r for r in recs if r["phase"] == "baby_child_spawn"]
    assert len(spawned) == 1 and spawned[0]["forked"] and spawned[0]["child"] == out["early"]
    assert any(r["phase"] == "baby_child_ready" and r["pid"] == out["early"] for r in recs)


@pytest.mark.timeout(180)
def test_a_spare_child_forked_at_start_replaces_an_aborted_one(tmp_path: Path) -> None:
    """Beside its child the worker forks a spare (`prestart.FORKED_SPARES`): the configure after an
    abort (a hung peer) adopts it instead of waiting for a new interpreter to import torch (3.5 s
    seen in the soak), and the next spare starts at once for a later abort."""
    out, recs = run_probe(tmp_path, "abort")
    assert out["kind"] == "ForkedChild" and len(out["spares"]) == 1
    assert out["after_abort"] == out["spares"][0] != out["early"]  # the forked spare, not a spawn
    assert out["sum_after_abort"] == [2.0] * 4
    spares = [r for r in recs if r["phase"] == "baby_child_spare"]
    assert [r["child"] for r in spares] == out["spares"] and spares[0]["forked"]
    spawned = [r for r in recs if r["phase"] == "baby_child_spawn" and not r.get("forked")]
    assert [r["child"] for r in spawned] == [out["next_spare"]]  # the one after it: started, not waited for
    # The forked spare waited, blocked, until taken: it started serving only then (no CPU of its own
    # while the worker started).
    taken = [r["t"] for r in recs if r["phase"] == "baby_child_spawn" and r.get("spare")]
    ready = [r["t"] for r in recs if r["phase"] == "baby_child_ready" and r["pid"] == out["spares"][0]]
    assert len(taken) == 1 and len(ready) == 1 and ready[0] >= taken[0]


@pytest.mark.timeout(180)
def test_a_fork_is_refused_while_another_thread_runs(tmp_path: Path) -> None:
    # FTLAUNCH_BACKEND=gloo: prestart starts nothing early; the probe then tries a fork itself.
    out, recs = run_probe(tmp_path, "thread", **{env.FTLAUNCH_BACKEND: "gloo"})
    assert out["kind"] == "Popen"  # the fork was refused: an interpreter of its own instead
    assert "ftlaunch.process_group.baby.child" in out["child_cmdline"]
    assert out["sum"] == [3.0] * 4
    refused = [r for r in recs if r["phase"] == "baby_child_fork_refused"]
    assert len(refused) == 1 and refused[0]["threads"] >= 2
    spawned = [r for r in recs if r["phase"] == "baby_child_spawn"]
    assert len(spawned) == 1 and not spawned[0].get("forked") and spawned[0]["child"] == out["early"]


@pytest.mark.timeout(180)
def test_opting_out_starts_the_child_as_its_own_interpreter(tmp_path: Path) -> None:
    out, _ = run_probe(tmp_path, "plain", **{env.FTLAUNCH_PRESTART_FORK: "0"})
    assert not out["had_torch"] and out["kind"] == "Popen"
    assert "ftlaunch.process_group.baby.child" in out["child_cmdline"]
    assert out["sum"] == [3.0] * 4 and not out["child_alive_after_shutdown"]


@pytest.mark.timeout(180)
def test_a_killed_worker_leaves_no_forked_child(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    run_env = {**os.environ, env.FTLAUNCH_BACKEND: "", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "ftlaunch.bootstrap.prestart", str(script), "sleep"],
                            stdout=subprocess.PIPE, text=True, env=run_env, cwd=tmp_path)  # fmt: skip
    try:
        assert proc.stdout is not None
        out = json.loads(proc.stdout.readline())
        assert out["kind"] == "ForkedChild"
        child = psutil.Process(out["early"])
        assert child.ppid() == proc.pid
        forked = [p for p in psutil.Process(proc.pid).children() if p.pid != child.pid]
        assert forked, "the spare forked beside the child"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    for p in (child, *forked):  # the child and the spare die with the worker
        deadline = time.monotonic() + 10
        while p.is_running() and p.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE


def test_the_public_name_explains_itself() -> None:
    """``python -m ftlaunch.run --help`` says what it is for and how torchrun uses it; without a
    script it prints its usage and fails, pointing at ``--help``."""
    helped = subprocess.run(
        [sys.executable, "-m", "ftlaunch.run", "--help"], capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0, helped.stderr
    assert "torchrun --rdzv-backend ftlaunch ... -m ftlaunch.run train.py" in helped.stdout
    assert "FTLAUNCH_ZYGOTE=0" in helped.stdout and "standby" in helped.stdout
    bare = subprocess.run([sys.executable, "-m", "ftlaunch.run"], capture_output=True, text=True, timeout=60)
    assert bare.returncode == 1 and bare.stderr.startswith(
        "usage: python -m ftlaunch.run [-m MODULE | SCRIPT]"
    )
    assert "python -m ftlaunch.run --help" in bare.stderr


@pytest.mark.timeout(180)
def test_a_child_started_before_the_script_gets_the_environment_the_script_set(tmp_path: Path) -> None:
    """The child is forked before the script runs; a variable the script sets afterwards for its
    backend (here ``GLOO_SOCKET_IFNAME``, on a GPU ``NCCL_*``) must still reach the child's backend:
    its first configure mirrors the worker's environment. An interface that does not exist makes
    that configure fail; without it, the next one succeeds."""
    out, _ = run_probe(tmp_path, "env")
    assert out["kind"] == "ForkedChild"
    assert out["configure_error"] is not None and "ftl-none0" in out["configure_error"], out
    assert out["sum"] == [3.0] * 4


@pytest.mark.parametrize(
    ("backend", "gpu", "hidden", "want"),
    [
        ("", False, False, "gloo"),  # no NVIDIA device: Baby Gloo, the default there
        ("", True, False, "nccl"),  # a GPU machine: Baby NCCL, the default for a model on the GPU
        ("", True, True, "gloo"),  # GPUs hidden (CUDA_VISIBLE_DEVICES=""): the CPU default
        ("baby-nccl", False, False, "nccl"),
        ("baby-gloo", True, False, "gloo"),
        ("gloo", True, False, None),  # in-process backends have no child
        ("nccl", True, False, None),
    ],
)
def test_the_child_started_early_is_for_the_backend_the_job_will_use(
    backend: str, gpu: bool, hidden: bool, want: str | None, monkeypatch
) -> None:
    from ftlaunch.bootstrap import prestart

    monkeypatch.setenv(env.FTLAUNCH_BACKEND, backend)
    if hidden:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    else:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: gpu if p == "/dev/nvidiactl" else real_exists(p))
    assert prestart.wanted() == want
