#!/usr/bin/env python
"""The step cost as a user pays it: ``scripts/train_ddp.py`` (README's two-line form) under
``ftlaunch --replicas 2`` with every default, against plain torch DDP of the same model under
``torchrun --nproc-per-node 2``, and torchft's Manager + DDP (2 groups × 1 worker, its own
lighthouse) when ``--torchft-python`` names an interpreter that imports torchft.

Every configuration is a whole job, started the way a user starts it; the jobs run one after the
other, in a rotating order, ``--rounds`` times, so each round compares jobs seconds apart under
the same load from other processes. A job's figure is the median ``ms=`` of its committed steps
after ``--warmup`` (the step as the script times it: zero_grad, forward, backward, the optimizer
step with its commit). The ratio to plain DDP is the median over rounds of the same-round ratio.

Besides the defaults, two variants attribute the cost: ``FTLAUNCH_HEAL_CLAIMS=0`` (no heal claims)
and ``FTLAUNCH_BACKEND=gloo`` (torch's Gloo in the worker instead of Baby Gloo's child process).

    python scripts/bench_step_cost.py [--rounds 3] [--steps 200] [--torchft-python VENV/bin/python]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "scripts" / "train_ddp.py"
WIDTH, BATCH = 1024, 32
STEP = re.compile(r"step=(\d+) committed=True .*? ms=([\d.]+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the workers of the two baselines (this file, run with --worker plain|torchft) ---------------


def _plain_worker(steps: int) -> None:
    """Plain torch DDP of train_ddp.py's model, data and optimizer, as a torchrun worker."""
    import torch
    import torch.distributed as dist
    from torch import nn

    sys.path.insert(0, str(ROOT / "scripts"))
    from train_ddp import make_dataset, make_model

    dist.init_process_group("gloo")
    model = make_model(WIDTH)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dataset = make_dataset(4096)
    sampler = torch.utils.data.DistributedSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    loss_fn = nn.MSELoss()
    step = 0
    while step < steps:
        for _idx, x, y in loader:
            if step >= steps:
                break
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            print(
                f"step={step} committed=True loss={loss.item():.5f} "
                f"ms={(time.perf_counter() - t0) * 1e3:.1f}",
                flush=True,
            )
            step += 1
    dist.destroy_process_group()


def _torchft_worker(steps: int) -> None:
    """torchft's Manager, DDP and OptimizerWrapper around the same model, one group per process."""
    from datetime import timedelta

    import torch
    from torch import nn
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    sys.path.insert(0, str(ROOT / "scripts"))
    from train_ddp import make_dataset, make_model

    gid = int(os.environ["REPLICA_GROUP_ID"])
    model = make_model(WIDTH)
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        min_replica_size=1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"bench_{gid}",
        timeout=timedelta(seconds=30),
    )
    ddp = DistributedDataParallel(manager, model)
    opt = OptimizerWrapper(manager, inner)
    dataset = make_dataset(4096)
    n = int(os.environ["NUM_REPLICA_GROUPS"])
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=n, rank=gid)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    loss_fn = nn.MSELoss()
    while manager.current_step() < steps:
        for _idx, x, y in loader:
            if manager.current_step() >= steps:
                break
            t0 = time.perf_counter()
            before = manager.current_step()
            opt.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()  # torchft's returns None: a committed step moves the step counter
            committed = manager.current_step() > before
            print(
                f"step={manager.current_step()} committed={committed} loss={loss.item():.5f} "
                f"ms={(time.perf_counter() - t0) * 1e3:.1f}",
                flush=True,
            )
    manager.shutdown()


# --- the jobs -------------------------------------------------------------------------------------


def _run(cmds: list[tuple[list[str], dict[str, str]]], timeout: float, log: Path) -> list[tuple[int, float]]:
    """Run the processes of one job together; the committed steps' ms of every one of them."""
    with log.open("w") as out:
        procs = [subprocess.Popen(c, env=e, stdout=out, stderr=subprocess.STDOUT) for c, e in cmds]
        try:
            for p in procs:
                p.wait(timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    text = log.read_text(errors="replace")
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"job failed (exit {[p.returncode for p in procs]}); last lines:\n{text[-3000:]}")
    return [(int(m[1]), float(m[2])) for m in STEP.finditer(text)]


def _env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("FTLAUNCH_", "TORCHFT_"))}
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    e.update(extra)
    return e


def job(name: str, args: argparse.Namespace, tmp: Path) -> list[float]:
    common = ["--steps", str(args.steps)]
    train = [str(TRAIN), "--width", str(WIDTH), "--batch-size", str(BATCH), *common, "--max-seconds", "300"]
    launcher = [sys.executable, "-m", "ftlaunch.launcher.cli", "--replicas", "2"]
    me = str(Path(__file__).resolve())
    if name == "plain DDP":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               f"--master-port={_free_port()}", me, "--worker", "plain", *common]  # fmt: skip
        cmds = [(cmd, _env(OMP_NUM_THREADS="1"))]
    elif name == "torchft":
        lh_port = _free_port()
        lh = subprocess.Popen(
            [args.torchft_python, "-c",
             "import sys,time; from torchft.coordination import LighthouseServer as L; "
             f"s=L(bind='[::]:{lh_port}', min_replicas=2, join_timeout_ms=1000); time.sleep(3600)"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            time.sleep(1.0)
            cmds = []
            for g in range(2):
                cmd = [args.torchft_python, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                       f"--master-port={_free_port()}", me, "--worker", "torchft", *common]  # fmt: skip
                e = _env(OMP_NUM_THREADS="1", REPLICA_GROUP_ID=str(g), NUM_REPLICA_GROUPS="2",
                         TORCHFT_LIGHTHOUSE=f"http://localhost:{lh_port}")  # fmt: skip
                cmds.append((cmd, e))
            log = tmp / "torchft.log"
            steps = _steps(_run(cmds, 600, log), args.warmup)
            if not steps:
                raise RuntimeError(f"torchft committed no step; last lines:\n{log.read_text()[-3000:]}")
            return steps
        finally:
            lh.kill()
            lh.wait()
    else:
        extra = {"FTLAUNCH_HEAL_CLAIMS": "0"} if "CLAIMS=0" in name else {}
        if "BACKEND=gloo" in name:
            extra["FTLAUNCH_BACKEND"] = "gloo"
        cmds = [([*launcher, *train], _env(**extra))]
    return _steps(_run(cmds, 600, tmp / (re.sub(r"\W+", "_", name) + ".log")), args.warmup)


def _steps(pairs: list[tuple[int, float]], warmup: int) -> list[float]:
    return [ms for step, ms in pairs if step >= warmup]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200, help="committed steps per job")
    p.add_argument("--warmup", type=int, default=30, help="steps left out at the start of each job")
    p.add_argument("--torchft-python", default=None, help="an interpreter that imports torchft (a venv)")
    p.add_argument("--only", default=None, help="comma-separated configurations to run")
    p.add_argument("--worker", choices=["plain", "torchft"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "plain":
        return _plain_worker(args.steps)
    if args.worker == "torchft":
        return _torchft_worker(args.steps)

    names = [
        "plain DDP",
        "ftlaunch (defaults)",
        "ftlaunch FTLAUNCH_HEAL_CLAIMS=0",
        "ftlaunch FTLAUNCH_BACKEND=gloo",
    ]
    if args.torchft_python:
        names.append("torchft")
    if args.only:
        names = [n for n in names if n == "plain DDP" or any(o in n for o in args.only.split(","))]
    med: dict[str, list[float]] = {n: [] for n in names}
    tmp = Path(tempfile.mkdtemp(prefix="bench_step_cost_"))
    try:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for n in order:
                ms = job(n, args, tmp)
                med[n].append(statistics.median(ms))
            load = os.getloadavg()[0]
            print(
                f"round {r + 1} (load {load:.1f}): " + ", ".join(f"{n} {med[n][-1]:.2f} ms" for n in names),
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"\nstep cost: 2 groups x 1 worker (plain DDP: 2 ranks), MLP 3x{WIDTH}, batch {BATCH}, SGD, gloo on "
        f"loopback; {args.rounds} rounds x {args.steps} steps (first {args.warmup} left out); "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'configuration':<34}{'ms/step':>10}{'ratio to DDP':>14}   [per round]")
    for n in names:
        ratios = [a / b for a, b in zip(med[n], med["plain DDP"], strict=True)]
        print(
            f"{n:<34}{statistics.median(med[n]):>10.2f}{statistics.median(ratios):>13.2f}x   "
            f"[{', '.join(f'{x:.2f}' for x in ratios)}]"
        )


if __name__ == "__main__":
    main()
