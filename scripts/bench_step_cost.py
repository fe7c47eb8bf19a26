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
import queue
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

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


Cmds = list[tuple[list[str], dict[str, str]]]


def _run(cmds: Cmds, timeout: float, log: Path) -> list[tuple[int, float]]:
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


def _commands(
    name: str, args: argparse.Namespace
) -> tuple[list[tuple[list[str], dict[str, str]]], list[str]]:
    """The processes of one job (command, environment), and a command to start before them (torchft's
    lighthouse) or an empty list."""
    common = ["--steps", str(args.steps)]
    train = [str(TRAIN), "--width", str(WIDTH), "--batch-size", str(BATCH), *common, "--max-seconds", "300"]
    launcher = [sys.executable, "-m", "ftlaunch.launcher.cli", "--replicas", "2"]
    me = str(Path(__file__).resolve())
    if name == "plain DDP":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               f"--master-port={_free_port()}", me, "--worker", "plain", *common]  # fmt: skip
        return [(cmd, _env(OMP_NUM_THREADS="1"))], []
    if name == "torchft":
        lh_port = _free_port()
        lighthouse = [
            args.torchft_python, "-c",
            "import sys,time; from torchft.coordination import LighthouseServer as L; "
            f"s=L(bind='[::]:{lh_port}', min_replicas=2, join_timeout_ms=1000); time.sleep(3600)",
        ]  # fmt: skip
        cmds = []
        for g in range(2):
            cmd = [args.torchft_python, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                   f"--master-port={_free_port()}", me, "--worker", "torchft", *common]  # fmt: skip
            e = _env(OMP_NUM_THREADS="1", REPLICA_GROUP_ID=str(g), NUM_REPLICA_GROUPS="2",
                     TORCHFT_LIGHTHOUSE=f"http://localhost:{lh_port}")  # fmt: skip
            cmds.append((cmd, e))
        return cmds, lighthouse
    extra = {"FTLAUNCH_HEAL_CLAIMS": "0"} if "CLAIMS=0" in name else {}
    if "BACKEND=gloo" in name:
        extra["FTLAUNCH_BACKEND"] = "gloo"
    return [([*launcher, *train], _env(**extra))], []


def job(name: str, args: argparse.Namespace, tmp: Path) -> list[float]:
    """The committed steps' ms (after the warm-up) of one run of the job ``name``."""
    cmds, before = _commands(name, args)
    log = tmp / (re.sub(r"\W+", "_", name) + ".log")
    pre = subprocess.Popen(before, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if before else None
    try:
        if pre is not None:
            time.sleep(1.0)
        steps = _steps(_run(cmds, 600, log), args.warmup)
    finally:
        if pre is not None:
            pre.kill()
            pre.wait()
    if not steps:
        raise RuntimeError(f"{name} committed no step; last lines:\n{log.read_text()[-3000:]}")
    return steps


# --- CPU time: every process of the job, between two steps --------------------------------------

_TAIL = 20  # steps left out at the end of a job in --cpu mode
ROLES = ("workers", "baby children", "agents", "launcher+lighthouse", "other")


def _role(chain: list[str], has_children: bool) -> str:
    """A process's role from its command line and its ancestors' (``chain``: its own first). A
    process forked keeps its parent's command line: a fork of ftlaunch's warm standby
    (``bootstrap.zygote``) is a worker, a fork of that worker its Baby child or spare; a
    ``bootstrap.prestart`` process is a worker (it has children: its Baby child, its spare) or the
    proxy of one the standby runs (it has none)."""
    text = chain[0]
    if "process_group.baby.child" in text:
        return "baby children"
    for tag in ("bootstrap.zygote", "bootstrap.prestart"):
        if tag in text:
            depth = next((i for i, c in enumerate(chain) if tag not in c), len(chain))
            if depth >= 2 + (tag == "bootstrap.zygote"):
                return "baby children"
            if tag == "bootstrap.zygote":
                return "workers" if depth == 2 else "agents"
            return "workers" if has_children else "agents"
    if "lighthouse" in text.lower() or "launcher.cli" in text:
        return "launcher+lighthouse"  # ftlaunch's command hosts the lighthouse in its process
    if any(k in text for k in ("torch.distributed.run", "launcher.agent", "torchrun")):
        return "agents"  # before the worker check: torchrun's command line names the script too
    if str(TRAIN) in text or "--worker" in text:
        return "workers"
    return "other"


def _tree_cpu(roots: list[int]) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds: user + system, with its reaped children's) of every live process
    under ``roots``."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    for root in roots:
        try:
            top = psutil.Process(root)
            procs = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
                chain = [" ".join(q.cmdline()) for q in (p, *p.parents())]
                cpu = t.user + t.system + t.children_user + t.children_system
                out[p.pid] = (_role(chain, bool(p.children())), cpu)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
    return out


def cpu_job(name: str, args: argparse.Namespace, tmp: Path) -> tuple[dict[str, float], float]:
    """One run of the job ``name``: CPU ms per step of its processes by role, and wall ms per step,
    between the first step at or past ``--warmup`` and the first at or past ``--steps - _TAIL``
    (either worker's line, whichever comes first: they step together). The window ends well before
    the last step: a line reaches us through the launcher's relay, and by the time the last one
    arrives the workers may have started shutting down."""
    cmds, before = _commands(name, args)
    log = tmp / (re.sub(r"\W+", "_", name) + ".log")
    pre = subprocess.Popen(before, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if before else None
    procs: list[subprocess.Popen[str]] = []
    start: tuple[int, float, dict[int, tuple[str, float]]] | None = None
    end: tuple[int, float, dict[int, tuple[str, float]]] | None = None
    any_step = re.compile(r"step=(\d+) committed=True")
    try:
        if pre is not None:
            time.sleep(1.0)
        with log.open("w") as out:
            for c, e in cmds:
                procs.append(
                    subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                )
            roots = [p.pid for p in procs] + ([pre.pid] if pre is not None else [])
            timer = threading.Timer(600, lambda: [p.kill() for p in procs])
            timer.start()
            try:
                lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()

                def pump(stream: Any) -> None:
                    for line in stream:
                        lines.put(line)
                    lines.put(None)

                for p in procs:
                    threading.Thread(target=pump, args=(p.stdout,), daemon=True).start()
                open_streams = len(procs)
                while open_streams:
                    line = lines.get()
                    if line is None:
                        open_streams -= 1
                        continue
                    out.write(line)
                    m = any_step.search(line)
                    if m is None or end is not None:
                        continue
                    step = int(m[1])
                    if start is None and step >= args.warmup:
                        start = (step, time.perf_counter(), _tree_cpu(roots))
                    elif start is not None and step >= args.steps - _TAIL:
                        end = (step, time.perf_counter(), _tree_cpu(roots))
                for p in procs:
                    p.wait()
            finally:
                timer.cancel()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if pre is not None:
            pre.kill()
            pre.wait()
    if any(p.returncode != 0 for p in procs) or start is None or end is None or end[0] <= start[0]:
        raise RuntimeError(f"{name}: no measurable window; last lines:\n{log.read_text()[-3000:]}")
    n = end[0] - start[0]
    by_role = dict.fromkeys(ROLES, 0.0)
    for pid, (role, cpu) in end[2].items():
        before_cpu = start[2].get(pid, (role, 0.0))[1]
        by_role[role] += (cpu - before_cpu) * 1e3 / n
    return by_role, (end[1] - start[1]) * 1e3 / n


def cpu_main(names: list[str], args: argparse.Namespace, tmp: Path) -> None:
    """``--cpu``: CPU ms per step of every process of each job, beside plain DDP's, interleaved."""
    per: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            roles, ms = cpu_job(n, args, tmp)
            per[n].append(roles)
            wall[n].append(ms)
        load = os.getloadavg()[0]
        print(
            f"round {r + 1} (load {load:.1f}): "
            + ", ".join(f"{n} {sum(per[n][-1].values()):.1f} CPU ms" for n in names),
            flush=True,
        )
    print(
        f"\nCPU per step, all processes of the job: 2 groups x 1 worker (plain DDP: 2 ranks), MLP 3x{WIDTH}, "
        f"batch {BATCH}, SGD; {args.rounds} rounds, steps {args.warmup}..{args.steps - _TAIL}; "
        f"load {os.getloadavg()[0]:.1f}"
    )
    head = "".join(f"{r:>20}" for r in ROLES)
    print(f"{'configuration':<34}{'CPU ms/step':>12}{'ratio':>8}{head}{'wall ms/step':>14}")
    base = [sum(x.values()) for x in per["plain DDP"]]
    for n in names:
        totals = [sum(x.values()) for x in per[n]]
        ratio = statistics.median(a / b for a, b in zip(totals, base, strict=True))
        roles = "".join(f"{statistics.median(x[r] for x in per[n]):>20.2f}" for r in ROLES)
        print(
            f"{n:<34}{statistics.median(totals):>12.2f}{ratio:>7.2f}x{roles}{statistics.median(wall[n]):>14.2f}"
        )


def _steps(pairs: list[tuple[int, float]], warmup: int) -> list[float]:
    return [ms for step, ms in pairs if step >= warmup]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200, help="committed steps per job")
    p.add_argument("--warmup", type=int, default=30, help="steps left out at the start of each job")
    p.add_argument("--torchft-python", default=None, help="an interpreter that imports torchft (a venv)")
    p.add_argument("--only", default=None, help="comma-separated configurations to run")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="CPU time per step of every process of each job (workers, Baby children, agents, launcher, "
        "lighthouse) instead of the step's wall time: what the job costs the machine, steady under load",
    )
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
    if args.cpu:
        try:
            return cpu_main(names, args, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
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
