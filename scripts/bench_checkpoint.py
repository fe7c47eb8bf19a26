#!/usr/bin/env python3
"""Durable checkpoints: what they cost while training, and what they save when the whole job dies.

1. **Overhead**: ``ftlaunch --replicas 2 scripts/train_ddp.py --width 1024`` (or ``--model gpt``:
   ``scripts/train_hsdp.py``'s GPT, 2 groups x 2 ranks) with ``--checkpoint-every 100`` and
   without, interleaved (A B A B ...) in one run of this script so that the machine's load hits
   both alike. The figure: mean time between group 0's committed steps (lines timestamped as they
   arrive), steps 10..end, checkpointing over none. Target <= 1.02.
   Baseline beside it: the same model under ``torchrun`` with torch's DDP and a hand-written
   synchronous ``torch.distributed.checkpoint.save`` every 100 steps, over the same loop without it.
2. **Whole-job loss**: the job with checkpoints, SIGKILLed whole (the ``ftlaunch`` supervisor and
   every process under it) at a random step, then the same command again: seconds from the command
   to its first committed step, against a fresh start's (same command, empty directory), and the
   steps lost (the step killed at minus the step resumed from; at most ``checkpoint_every``).

Usage: python scripts/bench_checkpoint.py [--model mlp|gpt] [--steps 400] [--rounds 2] [--kills 2]
Print ``uptime`` beside the figures: the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"^\[rg0/r0\] step=(\d+) committed=True")
BASELINE_STEP = re.compile(r"^baseline step=(\d+)")
EVERY = 100


def job_command(model: str, steps: int, ckpt: Path | None) -> list[str]:
    durable = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY)] if ckpt else []
    if model == "gpt":
        script = ["--nproc-per-node", "2", "scripts/train_hsdp.py", "--steps", str(steps)]
    else:
        script = ["scripts/train_ddp.py", "--width", "1024", "--steps", str(steps)]
    return [
        sys.executable,
        "-m",
        "ftlaunch.launcher.cli",
        "--replicas",
        "2",
        "--no-status",
        *durable,
        *script,
    ]


class Run:
    """A command whose stdout lines are timestamped as they arrive."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def steps(self, pattern: re.Pattern[str] = STEP) -> list[tuple[float, int]]:
        return [(t, int(m[1])) for t, line in list(self.lines) if (m := pattern.match(line))]

    def wait(self, timeout: float = 1800) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return rc

    def kill_all(self) -> None:
        procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        self.proc.wait()
        self.reader.join(timeout=10)


def mean_step_seconds(steps: list[tuple[float, int]], skip: int = 10) -> float:
    times = [t for t, s in steps if s > skip]
    if len(times) < 2:
        raise SystemExit(f"too few committed steps to time ({len(times)})")
    return (times[-1] - times[0]) / (len(times) - 1)


BASELINE_WORKER = r"""
import os, sys, time, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch import nn
steps, every, ckpt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 8))
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
g = torch.Generator().manual_seed(dist.get_rank())
for step in range(1, steps + 1):
    x = torch.randn(32, 64, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(ddp(x), x[:, :8]).backward()
    opt.step()
    if every and step % every == 0:  # what a user writes by hand: a synchronous DCP save
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                 checkpoint_id=f"{ckpt}/step-{step}")
    if dist.get_rank() == 0:
        print(f"baseline step={step}", flush=True)
dist.destroy_process_group()
"""


def baseline(steps: int, every: int, ckpt: Path) -> float:
    script = ckpt.parent / "baseline_worker.py"
    script.write_text(BASELINE_WORKER)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        str(script), str(steps), str(every), str(ckpt),
    ]  # fmt: skip
    run = Run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if run.wait() != 0:
        raise SystemExit("the torchrun baseline failed:\n" + "".join(line for _, line in run.lines[-30:]))
    return mean_step_seconds(run.steps(BASELINE_STEP))


def overhead(args: argparse.Namespace, work: Path) -> None:
    print(
        f"== overhead: checkpoint every {EVERY} vs none, {args.model}, {args.steps} steps, "
        f"{args.rounds} rounds"
    )
    ours: dict[str, list[float]] = {"none": [], "every": []}
    base: dict[str, list[float]] = {"none": [], "every": []}
    for r in range(args.rounds):
        for kind in ("none", "every"):
            ckpt = work / f"ovh-{r}-{kind}"
            run = Run(job_command(args.model, args.steps, ckpt if kind == "every" else None))
            if run.wait() != 0:
                raise SystemExit("".join(line for _, line in run.lines[-40:]))
            ours[kind].append(mean_step_seconds(run.steps()))
            saved = sorted(os.listdir(ckpt)) if kind == "every" else []
            print(f"  ftlaunch {kind:5s} round {r}: {ours[kind][-1] * 1e3:.1f} ms/step {saved}", flush=True)
            if args.model == "mlp" and not args.no_baseline:
                bdir = work / f"base-{r}-{kind}"
                bdir.mkdir()
                base[kind].append(baseline(args.steps, EVERY if kind == "every" else 0, bdir))
                print(f"  torchrun {kind:5s} round {r}: {base[kind][-1] * 1e3:.1f} ms/step", flush=True)
    ratio = statistics.mean(ours["every"]) / statistics.mean(ours["none"])
    print(f"ftlaunch, async checkpoint every {EVERY}: step-time ratio {ratio:.3f} (target <= 1.02)")
    if base["none"]:
        bratio = statistics.mean(base["every"]) / statistics.mean(base["none"])
        print(
            f"baseline, torchrun + hand-written synchronous DCP every {EVERY}: step-time ratio {bratio:.3f}"
        )


def whole_job_loss(args: argparse.Namespace, work: Path) -> None:
    print(f"== whole-job SIGKILL at a random step, then the same command ({args.model})")
    rng = random.Random(args.seed)
    for k in range(args.kills):
        ckpt = work / f"kill-{k}"
        kill_at = rng.randrange(EVERY + 5, args.steps - 20)
        run = Run(job_command(args.model, args.steps, ckpt))
        while not any(s >= kill_at for _, s in run.steps()):
            if run.proc.poll() is not None:
                raise SystemExit("the job ended before the kill:\n" + "".join(x for _, x in run.lines[-30:]))
            time.sleep(0.01)
        killed = max(s for _, s in run.steps())
        run.kill_all()
        again = Run(job_command(args.model, args.steps, ckpt))
        while not again.steps():
            if again.proc.poll() is not None:
                raise SystemExit("the resumed job ended early:\n" + "".join(x for _, x in again.lines[-30:]))
            time.sleep(0.005)
        t_first, first = again.steps()[0]
        resumed_first = t_first - again.t0
        again.kill_all()
        fresh = Run(job_command(args.model, args.steps, work / f"fresh-{k}"))
        while not fresh.steps():
            if fresh.proc.poll() is not None:
                raise SystemExit("the fresh job ended early:\n" + "".join(x for _, x in fresh.lines[-30:]))
            time.sleep(0.005)
        fresh_first = fresh.steps()[0][0] - fresh.t0
        fresh.kill_all()
        lost = killed - (first - 1)
        print(
            f"  kill at step {killed}: resumed at step {first - 1}, steps lost {lost} (<= {EVERY}); "
            f"first committed step {resumed_first:.2f} s after the command (fresh start: "
            f"{fresh_first:.2f} s, "
            f"difference {resumed_first - fresh_first:+.2f} s)",
            flush=True,
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kills", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", action="store_true", help="skip the torchrun baseline")
    p.add_argument("--only", choices=["overhead", "loss"], default=None)
    args = p.parse_args()
    print(f"uptime: {os.getloadavg()} (1, 5, 15 min load), {os.cpu_count()} CPUs", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    try:
        if args.only in (None, "overhead"):
            overhead(args, work)
        if args.only in (None, "loss"):
            whole_job_loss(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"uptime: {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
