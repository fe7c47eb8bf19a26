#!/usr/bin/env python3
"""Fault-tolerance cost and recovery speed, measured beside plain torch DDP in the same run.

Setup (BRIEF.md): 2 replica groups x 1 worker, Gloo on loopback, a 3-layer MLP of width 1024,
batch 32, SGD, one intra-op thread per worker. Prints:

* step time with fault tolerance / plain torch DDP step time (ftlaunch Gloo and BabyGloo);
* the survivor's longest stall after a SIGKILL of the other group;
* restarted group: process start -> first committed step (with healing);
* live-recovery transfer rate of a 256 MB state dict over HTTP (via scripts/bench_transport.py).

Usage: python scripts/bench_recovery.py [--steps 60] [--runs 2] [--launcher] [--overhead-only] [--breakdown]
       python scripts/bench_recovery.py --interleaved 150 [--runs 3]   (step-time ratios, robust to load)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve()
WIDTH = 1024
BATCH = 32

BASELINE = {  # torchft-nightly 2026.10.26, same machine class (BRIEF.md)
    "ratio_gloo": "1.28-1.52",
    "ratio_baby": "1.75-1.84",
    "stall": "5.0-5.1 s",
    "rejoin": "4.3-5.1 s",
    "transfer": "1.1 GB/s",
}
TARGET = {"ratio_gloo": "<= 1.10", "ratio_baby": "<= 1.25", "stall": "<= 0.5 s", "rejoin": "<= 2.5 s",
          "transfer": ">= 2 GB/s"}


# ------------------------------------------------------------------------------------------ workers
def _model():  # noqa: ANN202
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, WIDTH))


def worker_plain(rank: int, port: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, WIDTH)
    times, phases = [], []
    clock = time.perf_counter
    for _ in range(steps):
        t0 = clock()
        opt.zero_grad()
        t1 = clock()
        loss = model(x).pow(2).mean()
        t2 = clock()
        loss.backward()
        t3 = clock()
        opt.step()
        t4 = clock()
        times.append(t4 - t0)
        phases.append([t1 - t0, t2 - t1, t3 - t2, 0.0, t4 - t3])
    dist.barrier()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps({"times": times, "phases": phases}))


def worker_ft(group: int, lighthouse: str, steps: int, out: str, backend: str, step_sleep: float) -> None:
    import torch

    from ftlaunch import DistributedDataParallel, Manager, Optimizer
    from ftlaunch.process_group import ProcessGroupBabyGloo, ProcessGroupGloo

    torch.set_num_threads(1)
    pg = ProcessGroupBabyGloo(timeout=10.0) if backend == "baby" else ProcessGroupGloo(timedelta(seconds=10))
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    manager = Manager(
        pg=pg, load_state_dict=lambda sd: (model.load_state_dict(sd["m"]), inner.load_state_dict(sd["o"])),
        state_dict=lambda: {"m": model.state_dict(), "o": inner.state_dict()},
        replica_id=f"rg{group}", lighthouse_addr=lighthouse, timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
    )
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    x = torch.randn(BATCH, WIDTH)
    f = open(out, "w", buffering=1)
    f.write(json.dumps({"start": time.time()}) + "\n")
    clock = time.perf_counter
    try:
        while manager.current_step() < steps:
            t0 = clock()
            opt.zero_grad()  # starts the quorum
            t1 = clock()
            loss = ddp(x).pow(2).mean()
            t2 = clock()
            loss.backward()  # the gradient allreduce runs inside (DDP buckets)
            t3 = clock()
            ok = manager.should_commit()  # what opt.step() does, split in two for the breakdown
            t4 = clock()
            if ok:
                inner.step()
            t5 = clock()
            f.write(json.dumps({"t": time.time(), "dt": t5 - t0, "ok": ok,
                                "ph": [t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4]}) + "\n")
            if step_sleep:
                time.sleep(step_sleep)
    finally:
        manager.shutdown()


INTERLEAVED = ("plain", "plain_views", "gloo", "baby")


def worker_interleaved(group: int, port: int, lh_gloo: str, lh_baby: str, rounds: int, out: str) -> None:
    """Every configuration in the same two processes, one step each in turn (rotating the order).

    On a shared machine the load changes within seconds; measured one after the other, plain DDP
    and ftlaunch see different machines. Here each round's ratio compares steps taken moments apart.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ftlaunch import DistributedDataParallel, Manager
    from ftlaunch.process_group import ProcessGroupBabyGloo, ProcessGroupGloo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=group, world_size=2)
    configs: dict[str, tuple] = {}
    for name, views in (("plain", False), ("plain_views", True)):
        ddp = DDP(_model(), gradient_as_bucket_view=views)
        configs[name] = (None, ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
    for name, lighthouse in (("gloo", lh_gloo), ("baby", lh_baby)):
        pg = ProcessGroupBabyGloo(timeout=10.0) if name == "baby" else ProcessGroupGloo(timedelta(seconds=10))
        manager = Manager(pg=pg, load_state_dict=None, state_dict=None, replica_id=f"rg{group}",
                          lighthouse_addr=lighthouse, timeout=timedelta(seconds=10),
                          quorum_timeout=timedelta(seconds=30))
        model = _model()
        configs[name] = (manager, DistributedDataParallel(manager, model), torch.optim.SGD(model.parameters(), lr=1e-3))
    x = torch.randn(BATCH, WIDTH)
    clock = time.perf_counter
    results: dict[str, list[list[float]]] = {name: [] for name in INTERLEAVED}
    for r in range(rounds):
        for name in INTERLEAVED[r % 4:] + INTERLEAVED[:r % 4]:
            manager, ddp, opt = configs[name]
            t0 = clock()
            if manager is not None:
                manager.start_quorum()  # what ftlaunch.Optimizer.zero_grad does
            opt.zero_grad()
            t1 = clock()
            loss = ddp(x).pow(2).mean()
            t2 = clock()
            loss.backward()
            t3 = clock()
            ok = manager.should_commit() if manager is not None else True
            t4 = clock()
            if ok:
                opt.step()
            t5 = clock()
            results[name].append([t5 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4])
    dist.barrier()
    dist.destroy_process_group()
    for manager, _, _ in configs.values():
        if manager is not None:
            manager.shutdown()
    Path(out).write_text(json.dumps(results))


def interleaved(rounds: int, tmp: Path) -> dict[str, list[list[float]]]:
    from ftlaunch.lighthouse.server import LighthouseServer

    port = _free_port()
    with LighthouseServer(min_replicas=2, join_timeout=30.0).start() as lh_gloo, \
            LighthouseServer(min_replicas=2, join_timeout=30.0).start() as lh_baby:
        outs = [tmp / f"interleaved{g}.json" for g in range(2)]
        procs = [_spawn(["interleaved", str(g), str(port), lh_gloo.address, lh_baby.address, str(rounds),
                         str(outs[g])]) for g in range(2)]
        for p in procs:
            p.wait(timeout=1800)
    return {k: v[rounds // 5:] for k, v in json.loads(outs[0].read_text()).items()}


# ------------------------------------------------------------------------------------------ driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(HERE), "--worker", *args], stdout=subprocess.DEVNULL)


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


PHASES = ("zero_grad/start_quorum", "forward", "backward+allreduce", "commit vote", "optimizer step")


def _phase_medians(rows: list[list[float]]) -> list[float]:
    return [statistics.median(col) for col in zip(*rows, strict=True)]


def plain_step_time(steps: int, tmp: Path) -> tuple[float, list[float]]:
    """(median step time, median of each phase) of plain torch DDP, first fifth of the steps skipped."""
    port = _free_port()
    outs = [tmp / f"plain{r}.json" for r in range(2)]
    procs = [_spawn(["plain", str(r), str(port), str(steps), str(outs[r])]) for r in range(2)]
    for p in procs:
        p.wait(timeout=600)
    data = json.loads(outs[0].read_text())
    return statistics.median(data["times"][steps // 5:]), _phase_medians(data["phases"][steps // 5:])


def ft_step_time(steps: int, tmp: Path, backend: str) -> tuple[float, list[float]]:
    """Same for ftlaunch (2 groups x 1 worker) with the given cross-group process group."""
    from ftlaunch.lighthouse.server import LighthouseServer

    with LighthouseServer(min_replicas=2, join_timeout=30.0).start() as lh:
        outs = [tmp / f"ft_{backend}{g}.jsonl" for g in range(2)]
        procs = [_spawn(["ft", str(g), lh.address, str(steps), str(outs[g]), backend, "0"]) for g in range(2)]
        for p in procs:
            p.wait(timeout=600)
    recs = [r for r in _records(outs[0]) if "dt" in r][steps // 5:]
    return statistics.median(r["dt"] for r in recs), _phase_medians([r["ph"] for r in recs])


def kill_and_rejoin(tmp: Path, backend: str = "gloo") -> tuple[float, float, float]:
    """(survivor's longest stall after the kill, its median step, restart -> first committed step)."""
    from ftlaunch.lighthouse.server import LighthouseServer

    steps = 400
    with LighthouseServer(min_replicas=1, join_timeout=30.0).start() as lh:
        outs = [tmp / f"kill{g}.jsonl" for g in range(2)]
        procs = [_spawn(["ft", str(g), lh.address, str(steps), str(outs[g]), backend, "0.02"]) for g in range(2)]
        deadline = time.monotonic() + 120
        while sum(1 for r in _records(outs[1]) if r.get("ok")) < 20:
            if time.monotonic() > deadline:
                raise RuntimeError("group 1 did not get going")
            time.sleep(0.05)
        t_kill = time.time()
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        time.sleep(1.0)  # let the survivor run alone for a while
        out_restart = tmp / "kill1_restart.jsonl"
        t_start = time.time()
        procs[1] = _spawn(["ft", "1", lh.address, str(steps), str(out_restart), backend, "0.02"])
        deadline = time.monotonic() + 120
        first_commit = None
        while first_commit is None and time.monotonic() < deadline:
            first_commit = next((r["t"] for r in _records(out_restart) if r.get("ok")), None)
            time.sleep(0.01)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    surv = [r for r in _records(outs[0]) if "t" in r]
    ends = [r["t"] for r in surv]
    # Longest gap between the last step completed before the kill and the next ones, over the 1 s after.
    before = max(t for t in ends if t <= t_kill)
    after = [t for t in ends if t > t_kill and t < t_kill + 1.0]
    gaps = [b - a for a, b in zip([before, *after], after, strict=False)]
    stall = max(gaps) if gaps else float("inf")
    median = statistics.median(r["dt"] for r in surv[:50])
    rejoin = (first_commit - t_start) if first_commit else float("inf")
    return stall, median + 0.02, rejoin


def through_launcher(steps: int = 400, kill_at: int = 60) -> tuple[float, float]:
    """Measure through `ftlaunch --chaos`: (survivor's longest stall, kill -> first committed step
    of the restarted group). Lines are timestamped as they arrive."""
    import re

    script = HERE.parent / "train_ddp.py"
    cmd = [sys.executable, "-m", "ftlaunch.launcher.cli", "--replicas", "2", "--no-status",
           "--chaos", f"steps={kill_at},group=1", str(script), "--steps", str(steps), "--width", str(WIDTH),
           "--batch-size", str(BATCH), "--step-sleep", "0.02"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    step_line = re.compile(r"^\[rg(\d)/r0\] step=(\d+) committed=(True|False)")
    t_kill = None
    rg0: list[float] = []
    rejoin = None
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.time()
        if t_kill is None and "chaos: SIGKILL" in line:
            t_kill = now
        m = step_line.match(line)
        if m:
            if m.group(1) == "0":
                rg0.append(now)
            elif t_kill is not None and rejoin is None and m.group(3) == "True":
                rejoin = now - t_kill
    proc.wait(timeout=60)
    if t_kill is None:
        raise RuntimeError("the launcher never injected the failure")
    before = max(t for t in rg0 if t <= t_kill)
    after = [t for t in rg0 if t_kill < t < t_kill + 1.0]
    gaps = [b - a for a, b in zip([before, *after], after, strict=False)]
    return (max(gaps) if gaps else float("inf")), (rejoin if rejoin is not None else float("inf"))


def transfer_rate() -> str:
    bench = HERE.parent / "bench_transport.py"
    if not bench.exists():
        return "n/a (scripts/bench_transport.py missing)"
    proc = subprocess.run([sys.executable, str(bench), "--runs", "3", "--no-pg"], capture_output=True, text=True,
                          timeout=600)
    lines = [x for x in proc.stdout.splitlines() if "GB/s" in x]
    return lines[0].strip() if lines else f"n/a (bench_transport exit {proc.returncode})"


def main_interleaved(args: argparse.Namespace) -> int:
    ratios: dict[str, list[float]] = {"plain_views": [], "gloo": [], "baby": []}
    vs_views: dict[str, list[float]] = {"gloo": [], "baby": []}
    phases: dict[str, list[list[float]]] = {k: [] for k in INTERLEAVED}
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.runs):
            res = interleaved(args.interleaved, Path(d))
            line = []
            for k in ratios:
                ratios[k].append(statistics.median(a[0] / p[0] for a, p in zip(res[k], res["plain"], strict=True)))
                line.append(f"{k} {ratios[k][-1]:.3f}")
            for k in vs_views:
                vs_views[k].append(statistics.median(
                    a[0] / p[0] for a, p in zip(res[k], res["plain_views"], strict=True)))
            for k in INTERLEAVED:
                phases[k].append(_phase_medians(res[k]))
            print(f"run {i + 1}: step-time ratios to plain DDP (median over rounds): " + ", ".join(line), flush=True)
    med = {k: statistics.median(v) for k, v in ratios.items()}
    print(f"setup: 2 groups x 1 worker, gloo/loopback, MLP 3x{WIDTH}, batch {BATCH}, SGD; interleaved, "
          f"{args.interleaved} rounds x {args.runs} runs (medians)")
    plain_ms = statistics.median(ph[0] for ph in phases["plain"]) * 1e3
    print(f"plain torch DDP step              {plain_ms:8.2f} ms")
    print(f"ftlaunch Gloo                     ratio {med['gloo']:5.2f}  (torchft {BASELINE['ratio_gloo']}, "
          f"target {TARGET['ratio_gloo']})")
    print(f"ftlaunch BabyGloo                 ratio {med['baby']:5.2f}  (torchft {BASELINE['ratio_baby']}, "
          f"target {TARGET['ratio_baby']})")
    print(f"  (plain DDP with gradient_as_bucket_view, ftlaunch's default: ratio {med['plain_views']:.2f}; "
          f"ftlaunch against it: Gloo {statistics.median(vs_views['gloo']):.2f}, "
          f"Baby {statistics.median(vs_views['baby']):.2f})")
    print("per-phase medians (ms)                    " + "".join(f"{k:>12}" for k in INTERLEAVED))
    names = ("step", *PHASES)
    for j, name in enumerate(names):
        cols = [statistics.median(ph[j] for ph in phases[k]) * 1e3 for k in INTERLEAVED]
        print(f"  {name:<40}" + "".join(f"{c:12.2f}" for c in cols))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--runs", type=int, default=2, help="repeat the step-time measurement (median taken)")
    ap.add_argument("--skip-transfer", action="store_true")
    ap.add_argument("--overhead-only", action="store_true",
                    help="only the step-time ratios (no kill/rejoin, no transfer)")
    ap.add_argument("--breakdown", action="store_true",
                    help="print each run and the per-phase step breakdown of plain DDP and ftlaunch")
    ap.add_argument("--launcher", action="store_true",
                    help="measure stall and rejoin through `ftlaunch --chaos` instead of hand-run groups")
    ap.add_argument("--interleaved", type=int, metavar="ROUNDS", default=0,
                    help="step-time ratios only, robust to a shared machine: plain DDP, plain DDP with "
                         "gradient_as_bucket_view, ftlaunch Gloo and Baby take turns step by step in the "
                         "same two processes, ROUNDS steps each; --runs repeats it")
    ap.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "plain":
            worker_plain(int(rest[0]), int(rest[1]), int(rest[2]), rest[3])
        elif kind == "interleaved":
            worker_interleaved(int(rest[0]), int(rest[1]), rest[2], rest[3], int(rest[4]), rest[5])
        else:
            worker_ft(int(rest[0]), rest[1], int(rest[2]), rest[3], rest[4], float(rest[5]))
        return 0

    if args.interleaved:
        return main_interleaved(args)
    if args.launcher:
        stall, rejoin = through_launcher()
        print(f"through ftlaunch --replicas 2 --chaos (MLP 3x{WIDTH}, batch {BATCH}, 20 ms sleep per step)")
        print(f"survivor's longest stall on kill  {stall:8.3f} s    (an upper bound: lines reach the launcher "
              f"through torchelastic's log tailing, ~0.1 s resolution; torchft {BASELINE['stall']}, "
              f"target {TARGET['stall']})")
        print(f"kill -> restarted group's first committed step {rejoin:6.3f} s (includes the agent's restart "
              f"and Python/torch start-up; torchft restart->commit {BASELINE['rejoin']})")
        return 0

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        # Interleaved, so a burst of load from elsewhere on the machine hits all three alike; each
        # ratio is taken within a run (plain and ftlaunch measured back to back), then the median.
        runs: dict[str, list[tuple[float, list[float]]]] = {"plain": [], "gloo": [], "baby": []}
        for i in range(args.runs):
            runs["plain"].append(plain_step_time(args.steps, tmp))
            runs["gloo"].append(ft_step_time(args.steps, tmp, "gloo"))
            runs["baby"].append(ft_step_time(args.steps, tmp, "baby"))
            if args.breakdown:
                p_i, g_i, b_i = (runs[k][i][0] for k in ("plain", "gloo", "baby"))
                print(f"run {i + 1}: plain {p_i * 1e3:.2f} ms, Gloo {g_i * 1e3:.2f} ms ({g_i / p_i:.2f}), "
                      f"Baby {b_i * 1e3:.2f} ms ({b_i / p_i:.2f})", flush=True)
        p, g, b = (statistics.median(t for t, _ in runs[k]) for k in ("plain", "gloo", "baby"))
        rg = statistics.median(gt / pt for (gt, _), (pt, _) in zip(runs["gloo"], runs["plain"], strict=True))
        rb = statistics.median(bt / pt for (bt, _), (pt, _) in zip(runs["baby"], runs["plain"], strict=True))
        if not args.overhead_only:
            stall, step, rejoin = kill_and_rejoin(tmp)
    transfer = "skipped" if args.skip_transfer or args.overhead_only else transfer_rate()

    print(f"setup: 2 groups x 1 worker, gloo/loopback, MLP 3x{WIDTH}, batch {BATCH}, SGD; {args.runs} runs")
    print(f"plain torch DDP step              {p * 1e3:8.2f} ms")
    print(f"ftlaunch Gloo step                {g * 1e3:8.2f} ms   ratio {rg:5.2f}  "
          f"(torchft {BASELINE['ratio_gloo']}, target {TARGET['ratio_gloo']})")
    print(f"ftlaunch BabyGloo step            {b * 1e3:8.2f} ms   ratio {rb:5.2f}  "
          f"(torchft {BASELINE['ratio_baby']}, target {TARGET['ratio_baby']})")
    if args.breakdown:
        print("per-phase medians (ms; median over runs)   " + "  ".join(f"{k:>8}" for k in ("plain", "Gloo", "Baby")))
        for j, name in enumerate(PHASES):
            cols = [statistics.median(ph[j] for _, ph in runs[k]) * 1e3 for k in ("plain", "gloo", "baby")]
            print(f"  {name:<40} " + "  ".join(f"{c:8.2f}" for c in cols))
    if args.overhead_only:
        return 0
    print(f"survivor's longest stall on kill  {stall:8.3f} s    (step incl. 20 ms sleep {step:.3f} s; "
          f"torchft {BASELINE['stall']}, target {TARGET['stall']})")
    print(f"restart -> first committed step   {rejoin:8.3f} s    (torchft {BASELINE['rejoin']}, "
          f"target {TARGET['rejoin']})")
    print(f"live recovery transfer (256 MB)   {transfer}   (torchft {BASELINE['transfer']}, target {TARGET['transfer']})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
