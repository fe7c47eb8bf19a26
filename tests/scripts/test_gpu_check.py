"""scripts/gpu_check.py, the one-GPU check, kept from rotting where there is no GPU.

* CPU mode end to end (what CI can run): every check that can runs the same code paths with Gloo /
  Baby Gloo -- real processes, the real ``ftlaunch`` launcher, a real SIGKILL and heal -- and
  PASSes; the CUDA-only ones are SKIP with their reason; exit status 0.
* A check past its deadline FAILs, the run exits 1, and nothing it started is left running (the
  autouse leak check in conftest).
* The verdicts on a launcher run's output, on the phase log, and the GPU-memory bookkeeping, on
  made-up inputs: each property the GPU run relies on can fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest
from workers.helpers import REPO, free_port, run, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gpu_check  # noqa: E402

SCRIPT = str(Path(REPO) / "scripts" / "gpu_check.py")
LINE = re.compile(r"^(PASS|FAIL|SKIP)  (\S+)\s+(.*)  \(([\d.]+) s\)$", re.M)


def verdicts(out: str) -> dict[str, tuple[str, str]]:
    return {name: (status, figure) for status, name, figure, _ in LINE.findall(out)}


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.timeout(600)
def test_cpu_mode_runs_every_check_that_can_and_skips_the_cuda_only_ones(tmp_path: Path) -> None:
    res = run(
        [sys.executable, SCRIPT, "--cpu", "--budget", "540", "--log-dir", str(tmp_path / "logs")],
        timeout=580,
    )
    out = res.stdout
    assert res.returncode == 0, out[-6000:] + res.stderr[-3000:]
    got = verdicts(out)
    names = (
        "env",
        "baby",
        "standby",
        "ddp",
        "ddp-step-time",
        "kill-to-commit",
        "hsdp",
        "diloco",
        "http",
        "durable",
    )
    for name in names:
        assert got.get(name, ("missing",))[0] == "PASS", (name, out[-6000:])
    assert got["nccl-one-gpu"] == ("SKIP", "CUDA only (NCCL needs CUDA)")
    assert got["gpu-clean"] == ("SKIP", "CUDA only (no GPU)")
    # The stream check's CUDA part cannot run here; its calls did, on CPU tensors, and were right.
    status, figure = got["stream"]
    assert status == "SKIP" and figure.startswith("CUDA streams need a GPU")
    assert re.search(r"there 0, .* stream 0, default stream 0", figure), figure
    # The figures are measured, not placeholders.
    assert re.search(r"kill -> first commit \d+\.\d\d s", got["kill-to-commit"][1])
    assert re.search(r"= \d+\.\d\d \(Baby Gloo / torch Gloo", got["ddp-step-time"][1])
    assert re.search(r"20 reconfigures x 2 ranks .* 0 of \d+ child processes left", got["baby"][1])
    assert "2 groups x 2 worker(s)" in got["hsdp"][1]
    assert re.search(
        r"global and outer state identical at (\d+) of \1;.* healed at sync \d+", got["diloco"][1]
    )
    assert re.search(r"over HTTP.* healed at step \d+, .* kill -> first commit \d+\.\d\d s", got["http"][1])
    # Resumed from the newest checkpoint on disk, and ended as the run never interrupted did.
    m = re.search(
        r"with the checkpoint of step (\d+) on disk; the same command resumed from step \1, "
        r".* checksums (\w+) \(uninterrupted run: \2\)",
        got["durable"][1],
    )
    assert m, got["durable"][1]
    assert "[gpu_check] summary: 10 passed, 0 failed, 3 skipped" in out
    logs = {p.name for p in (tmp_path / "logs").iterdir()}
    assert logs >= {"baby.log", "ddp.log", "hsdp.log", "diloco.log", "http.log", "durable.log"}


@pytest.mark.timeout(120)
def test_a_check_past_its_deadline_fails_and_leaves_nothing_running(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        SCRIPT,
        "--cpu",
        "--only",
        "baby",
        "--check-timeout",
        "2",
        "--log-dir",
        str(tmp_path),
    ]
    res = run(cmd, timeout=100)
    got = verdicts(res.stdout)
    assert res.returncode == 1, res.stdout
    status, figure = got["baby"]
    assert status == "FAIL" and figure.startswith("timed out after"), res.stdout
    assert re.search(r"summary: \d+ passed, [12] failed", res.stdout), res.stdout
    assert "--worker baby 0" in (tmp_path / "baby.log").read_text()  # the log names what was cut short
    # conftest's autouse fixture fails this test if a helper, a Baby child or a spare survived.


def test_a_worker_cut_short_by_the_deadline_leaves_its_stacks_in_the_log(tmp_path: Path) -> None:
    run_id = uuid.uuid4().hex
    base_env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", **{gpu_check.MARKER: run_id})
    ctx = gpu_check.Ctx(False, gpu_check.CPU_SIZES, tmp_path, run_id, base_env)
    ctx.begin(tmp_path / "check.log", time.monotonic() + 120)
    # Rank 0 of 2 alone: it hosts the store and waits for rank 1, which never comes.
    port = free_port()
    proc = ctx.start(ctx.python("--worker", "baby", "0", str(port), "1", "16", "gloo"))
    try:
        wait_for(lambda: _listening(port), 90, "rank 0's store")  # torch imported, waiting in the store
        ctx.deadline = time.monotonic() + 0.5
        with pytest.raises(gpu_check.CheckTimeout, match="rank 0 alone still running"):
            ctx.wait(proc, "rank 0 alone")
    finally:
        gpu_check.end_processes(run_id, ctx.started, grace=5.0)
        ctx.end()
    log = (tmp_path / "check.log").read_text()
    assert "Current thread" in log and "in worker_baby" in log, log[-3000:]
    assert gpu_check.marked_pids(run_id) == []


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


# ------------------------------------------------------------------------------------------ verdicts
def _probe(group: int, rank: int, restart: int, standby: bool = True, bad_fork: bool = False) -> str:
    body = {
        "worker": "train",
        "pid": 100 + group * 10 + rank + restart,
        "restart": restart,
        "standby": standby,
        "cuda_initialized_at_start": False,
        "bad_fork": bad_fork,
    }
    return f"[rg{group}/r{rank}] {gpu_check.RESULT} {json.dumps(body)}"


def _run_text(
    *,
    backend: str = "baby-nccl",
    device: str = "cuda:0",
    restarted_standby: bool = True,
    bad_fork: bool = False,
    checksums: tuple[str, str] = ("abc", "abc"),
    heal_step: int = 82,
    extra: str = "",
) -> str:
    lines = [_probe(0, 0, 0, standby=False), _probe(1, 0, 0)]
    for g in (0, 1):
        lines.append(
            f"[rg{g}/r0] 2026-01-01 00:00:00,000 INFO [step 0] ftlaunch.init: replica group {g} of 2, "
            f"rank 0 of 1, backend {backend}, transport pg, device {device}"
        )
    for step in range(1, 6):
        for g in (0, 1):
            lines.append(f"[rg{g}/r0] step={step} committed=True participants=2 loss=1.5 ms=3.0 t={step}.0")
    lines.append(_probe(1, 0, 1, standby=restarted_standby, bad_fork=bad_fork))
    lines.append(f"[rg1/r0] 2026-01-01 00:00:09,000 INFO [step 0] healing from rg0 at step {heal_step}")
    lines.append("[rg0/r0] step=200 committed=True participants=2 loss=0.5 ms=3.0 t=9.0")
    lines.append("[rg1/r0] step=200 committed=True participants=2 loss=0.5 ms=3.0 t=9.0")
    lines.append(f"[rg0/r0] final_checksum={checksums[0]} step=200")
    lines.append(f"[rg1/r0] final_checksum={checksums[1]} step=200")
    return "\n".join(lines) + "\n" + extra


def _judge(text: str, rc: int = 0) -> list[str]:
    return gpu_check.judge_training(True, rc, text, groups=2, workers=1, steps=200, kill_at=80)[0]


def test_a_good_run_passes_and_every_broken_property_is_named() -> None:
    assert _judge(_run_text()) == []
    assert any("exited 3" in p for p in _judge(_run_text(), rc=3))
    assert any("not baby-nccl on cuda" in p for p in _judge(_run_text(backend="baby-gloo", device="cpu")))
    assert any("not forked by the warm standby" in p for p in _judge(_run_text(restarted_standby=False)))
    assert any("inherited initialised CUDA" in p for p in _judge(_run_text(bad_fork=True)))
    assert any("different checksums" in p for p in _judge(_run_text(checksums=("abc", "abd"))))
    assert any("did not heal" in p for p in _judge(_run_text(heal_step=0)))  # only the start's heal
    dup = "[rg1/r0] NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000\n"
    assert any("Duplicate GPU" in p for p in _judge(_run_text(extra=dup)))
    no_restart = "\n".join(x for x in _run_text().splitlines() if '"restart": 1' not in x)
    assert any("restarted worker" in p for p in _judge(no_restart))


def test_a_run_over_another_transport_than_asked_fails() -> None:
    text = _run_text()  # every worker logged transport pg
    assert gpu_check.judge_training(True, 0, text, 2, 1, 200, 80, transport="pg")[0] == []
    problems = gpu_check.judge_training(True, 0, text, 2, 1, 200, 80, transport="http")[0]
    assert problems == ["workers used the transport(s) ['pg'], not http"]


def test_a_run_without_a_kill_is_judged_on_its_end_alone() -> None:
    """The durable check's runs (the uninterrupted one, the resumed one): no restart, no heal to see."""
    text = "\n".join(x for x in _run_text().splitlines() if '"restart": 1' not in x and "healing" not in x)
    assert gpu_check.judge_run(True, 0, text, 2, 1, 200)[0] == []
    assert any(
        "different checksums" in p
        for p in gpu_check.judge_run(True, 0, _run_text(checksums=("a", "b")), 2, 1, 200)[0]
    )
    assert any(
        "not every rank ended at step 300" in p for p in gpu_check.judge_run(True, 0, text, 2, 1, 300)[0]
    )
    nan = text.replace(
        "step=200 committed=True participants=2 loss=0.5", "step=200 committed=True participants=2 loss=nan"
    )
    assert any("non-finite" in p for p in gpu_check.judge_run(True, 0, nan, 2, 1, 200)[0])


def test_only_complete_checkpoints_are_counted(tmp_path: Path) -> None:
    for name in ("step-00000004", "step-00000002", "step-00000006.tmp", "group-0", "latest"):
        (tmp_path / name).mkdir()
    assert gpu_check.complete_checkpoints(tmp_path) == [2, 4]
    assert gpu_check.complete_checkpoints(tmp_path / "absent") == []


def test_killing_the_job_ends_it_and_everything_under_it_at_once(tmp_path: Path) -> None:
    """A parent whose children start grandchildren in sessions of their own: all SIGKILLed."""
    import subprocess

    leaf = tmp_path / "leaf.py"  # a child that starts a grandchild in a session of its own
    leaf.write_text(
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
        "time.sleep(300)\n"
    )
    tree = (
        "import subprocess, sys, time\n"
        f"kids = [subprocess.Popen([sys.executable, {str(leaf)!r}]) for _ in range(2)]\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", tree])
    try:
        wait_for(lambda: len(gpu_check.descendants(proc.pid)) == 4, 60, "the tree of 5 processes")
        everyone = [proc.pid, *gpu_check.descendants(proc.pid)]
        assert gpu_check.kill_job(proc.pid) == 5
        assert proc.wait(timeout=10) == -9
        wait_for(lambda: not any(gpu_check.alive(p) for p in everyone), 10, "every process of the tree gone")
    finally:
        for pid in [proc.pid, *gpu_check.descendants(proc.pid)]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_the_restarted_groups_phases_are_counted_from_the_kill_its_slowest_rank_last(tmp_path: Path) -> None:
    log = tmp_path / "phases.jsonl"
    recs = [
        {"t": 100.0, "phase": "chaos_kill", "replica": None, "rank": None, "restart": None},
        {"t": 99.0, "phase": "first_commit", "replica": "1", "rank": "0", "restart": "0"},  # before the kill
        {"t": 100.01, "phase": "worker_exit_seen", "replica": "0", "rank": None, "failed": False},  # not ours
        {"t": 100.02, "phase": "worker_exit_seen", "replica": "1", "rank": None, "failed": True},
        {"t": 103.0, "phase": "worker_exit_seen", "replica": "1", "rank": None, "failed": False},  # the end
        {"t": 100.5, "phase": "zygote_forked", "replica": "1", "rank": "0", "restart": "1"},
        {"t": 100.6, "phase": "zygote_forked", "replica": "1", "rank": "1", "restart": "1"},
        {"t": 101.0, "phase": "healed", "replica": "1", "rank": "0", "restart": "1"},
        {"t": 101.5, "phase": "first_commit", "replica": "1", "rank": "0", "restart": "1"},
        {"t": 101.75, "phase": "first_commit", "replica": "1", "rank": "1", "restart": "1"},
        {"t": 101.9, "phase": "first_commit", "replica": "0", "rank": "0", "restart": "0"},  # the survivor
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    ph = gpu_check.recovery_phases(log)
    assert ph["worker_exit_seen"] == pytest.approx(0.02)
    assert ph["zygote_forked"] == pytest.approx(0.6)
    assert ph["first_commit"] == pytest.approx(1.75)
    result = gpu_check._recovery_result("kill-to-commit", "DDP", ph)
    assert result.status == "PASS" and "kill -> first commit 1.75 s" in result.figure
    assert gpu_check._recovery_result("x", "DDP", {}).status == "FAIL"


def test_gpu_memory_left_behind_or_a_new_compute_process_fails_the_cleanup_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ctx = gpu_check.Ctx(True, gpu_check.GPU_SIZES, tmp_path, "run", {})
    ctx.deadline = 1e18
    ctx.info["memory_start"] = (500, {11: 100})
    monkeypatch.setattr(gpu_check, "settled_memory", lambda target, seconds: (520, {11: 100}))
    assert gpu_check.check_gpu_clean(ctx)[0].status == "PASS"
    monkeypatch.setattr(gpu_check, "settled_memory", lambda target, seconds: (1200, {11: 100}))
    with pytest.raises(gpu_check.CheckFailed, match=r"\+700 MiB"):
        gpu_check.check_gpu_clean(ctx)
    monkeypatch.setattr(gpu_check, "settled_memory", lambda target, seconds: (510, {11: 100, 12: None}))
    with pytest.raises(gpu_check.CheckFailed, match="still on the GPU"):
        gpu_check.check_gpu_clean(ctx)


def test_the_gpu_environment_line_names_the_device_and_its_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ctx = gpu_check.Ctx(True, gpu_check.GPU_SIZES, tmp_path, "run", {})
    ctx.info["probe"] = {
        "worker": "env",
        "torch": "2.11.0+cu130",
        "cuda_build": "13.0",
        "cuda": True,
        "cpus": 16,
        "devices": 1,
        "name": "NVIDIA H100 80GB HBM3",
        "total_mib": 81559,
        "capability": [9, 0],
        "nccl": "2.27.7",
    }
    monkeypatch.setattr(gpu_check, "gpu_memory", lambda: (600, {}))
    (result,) = gpu_check.check_env(ctx)
    assert result.status == "PASS"
    assert "NVIDIA H100 80GB HBM3 (sm_90, 81559 MiB, 600 MiB in use, 0 compute processes)" in result.figure
    assert ctx.info["memory_start"] == (600, {})


def test_results_are_read_with_and_without_the_launchers_prefix() -> None:
    text = (
        '[rg1/r0] GPUCHECK {"worker": "train", "restart": 2}\n'
        'GPUCHECK {"worker": "baby", "rank": 0}\n'
        "[rg0/r0] step=1 committed=True GPUCHECK not json\n"
    )
    got = gpu_check.results_in(text)
    assert got == [{"worker": "train", "restart": 2, "_group": 1, "_rank": 0}, {"worker": "baby", "rank": 0}]


def test_a_launcher_run_cut_short_says_where_it_stood(tmp_path: Path) -> None:
    log = tmp_path / "phases.jsonl"
    log.write_text(json.dumps({"t": 10.0, "phase": "chaos_kill", "replica": None}) + "\n")
    text = (
        "[rg0/r0] step=81 committed=True participants=2 loss=1.0 ms=3.0 t=9.5\n"
        "[rg0/r0] step=82 committed=False participants=2 loss=1.0 ms=3.0 t=10.2\n"
        "[rg1/r0] step=81 committed=True participants=2 loss=1.0 ms=3.0 t=9.5\n" + _probe(1, 0, 1) + "\n"
    )
    said = gpu_check.where_it_stood(text, log)
    assert said == (
        "rg0 last committed step 81 (-0.5 s from the kill); rg1 last committed step 81 (-0.5 s from the "
        "kill); 1 restarted worker(s) started; heals logged by rg1: 0"
    )
    assert "no kill injected yet" in gpu_check.where_it_stood("", tmp_path / "absent.jsonl")


# ------------------------------------------------------------------------------ the training scripts' GPU
def test_train_ddp_picks_its_gpu_from_local_rank(monkeypatch) -> None:
    """``--device cuda``, the path only a GPU runs: the worker takes GPU ``LOCAL_RANK`` modulo the GPUs
    visible (CUDA stood in for, so the lookup itself is exercised where there is no GPU)."""
    import argparse

    import torch
    import train_ddp

    chosen: list[int] = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert train_ddp.device_of(argparse.Namespace(device="cuda")) == torch.device("cuda", 1)
    assert chosen == [1]
    assert train_ddp.device_of(argparse.Namespace(device="cpu")) == torch.device("cpu")


def test_train_diloco_picks_its_gpu_from_local_rank(monkeypatch) -> None:
    """The same for scripts/train_diloco.py (the `diloco` and `durable` checks run it with CUDA)."""
    import argparse

    import torch
    import train_diloco

    chosen: list[int] = []
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert train_diloco.device_of(argparse.Namespace(device="cuda")) == torch.device("cuda", 0)
    assert chosen == [0]
    assert train_diloco.device_of(argparse.Namespace(device="cpu")) == torch.device("cpu")
    assert train_diloco.parse_args(["--device", "cuda"]).device == "cuda"
