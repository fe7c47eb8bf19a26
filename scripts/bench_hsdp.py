#!/usr/bin/env python3
"""Fault-tolerant HSDP against torch's own HSDP, on the same model and machine.

1. Step time. Four worker processes (2 replica groups x 2 workers, Gloo on loopback, one intra-op
   thread each) hold both setups side by side and take one step of each in turn (alternating the
   order), so a burst of load from elsewhere on a shared machine hits both alike:
   * plain: torch's ``fully_shard`` over a 2-D mesh (replicate x shard) of the four processes, no
     fault tolerance (torch's native HSDP);
   * ftlaunch: ``FaultTolerance.shard``/``wrap`` -- FSDP2 over each group's 2 workers, the gradient
     shards averaged across groups by the Manager over its cross-group process group (Baby Gloo,
     ``ftlaunch.init``'s default, or ``--backend gloo``), quorum per step, commit votes.
   The model is scripts/train_hsdp.py's byte-level GPT (same sizes, same batch), AdamW, clipping.
   Prints the median of the per-round ratios and a per-phase breakdown.
2. Kill -> commit. ``ftlaunch --replicas 2 --nproc-per-node 2 --chaos steps=K,group=1
   scripts/train_hsdp.py``: SIGKILL of group 1's workers, counted from the kill until group 1's next
   committed step line reaches the launcher (its agent restarts it, it heals its shards from group 0).

Usage: python scripts/bench_hsdp.py [--rounds 120] [--runs 1] [--backend baby-gloo|gloo] [--no-kill]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve()
TARGET = "<= 1.10"
PHASES = ("zero_grad/quorum", "forward", "backward (+ reduce)", "clip", "commit vote", "optimizer step")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ worker
def worker(
    group: int, rank: int, port: int, lighthouse: str, store_port: int, rounds: int, out: str, backend: str
) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(HERE.parent))
    import train_hsdp as th

    from ftlaunch.checkpointing import PGTransport
    from ftlaunch.timeouts import Timeouts
    from ftlaunch.worker import hsdp
    from ftlaunch.worker.entry import FaultTolerance, make_process_group
    from ftlaunch.worker.manager import Manager

    torch.set_num_threads(1)
    args = th.parse_args([])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=group * 2 + rank, world_size=4
    )
    intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][group]  # every rank creates both, in order

    # plain torch HSDP: one 2-D mesh over the four processes
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    plain = hsdp.shard(th.make_model(args), mesh2)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=args.lr)

    # ftlaunch: what ftlaunch.init() + ft.shard + ft.wrap build (init reads these from the launcher's env)
    timeouts = Timeouts.derive(30.0)
    pg = make_process_group(backend, timeouts.as_timedelta("collective"))
    transport: PGTransport = PGTransport(
        pg, timeout=timeouts.as_timedelta("heal"), device=torch.device("cpu")
    )
    manager = Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        timeouts=timeouts,
        rank=rank,
        world_size=2,
        store_addr="127.0.0.1",
        store_port=store_port,
        lighthouse_addr=lighthouse,
        replica_id=f"rg{group}",
        checkpoint_transport=transport,
    )
    ft = FaultTolerance(
        manager=manager,
        pg=pg,
        replica_group_id=group,
        num_replica_groups=2,
        rank=rank,
        world_size=2,
        device=torch.device("cpu"),
        backend=backend,
        transport="pg",
        timeouts=timeouts,
        intra_group=intra,
        checkpoint_transport=transport,
    )
    model = ft.shard(th.make_model(args))
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, _ = ft.wrap(model, inner)

    g = torch.Generator().manual_seed(group * 2 + rank)
    x = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=g)
    y = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=g)
    clock = time.perf_counter

    def step(m: torch.nn.Module, opt: torch.optim.Optimizer, ft_manager: Manager | None) -> list[float]:
        t0 = clock()
        if ft_manager is not None:
            ft_manager.start_quorum()  # what ftlaunch.Optimizer.zero_grad does
        opt.zero_grad()
        t1 = clock()
        loss = th.loss_of(m, x, y)
        t2 = clock()
        loss.backward()
        t3 = clock()
        torch.nn.utils.clip_grad_norm_(m.parameters(), args.clip_grad_norm)
        t4 = clock()
        ok = ft_manager.should_commit() if ft_manager is not None else True  # ftlaunch.Optimizer.step
        t5 = clock()
        if ok:
            opt.step()
        t6 = clock()
        return [t6 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5]

    results: dict[str, list[list[float]]] = {"plain": [], "ftlaunch": []}
    for r in range(rounds):
        order = [("plain", plain, plain_opt, None), ("ftlaunch", model, inner, manager)]
        for name, m, opt, mgr in order if r % 2 == 0 else order[::-1]:
            results[name].append(step(m, opt, mgr))
    ft.shutdown()
    dist.destroy_process_group()
    if group == 0 and rank == 0:
        Path(out).write_text(json.dumps(results))


def step_ratio(rounds: int, backend: str) -> dict[str, list[list[float]]]:
    from torch.distributed import TCPStore

    from ftlaunch.lighthouse.server import LighthouseServer

    port = _free_port()
    stores = [
        TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        for _ in range(2)
    ]
    with (
        tempfile.TemporaryDirectory() as d,
        LighthouseServer(min_replicas=2, join_timeout=30.0).start() as lh,
    ):
        out = Path(d) / "results.json"
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(HERE),
                    "--worker",
                    str(g),
                    str(r),
                    str(port),
                    lh.address,
                    str(stores[g].port),
                    str(rounds),
                    str(out),
                    backend,
                ],
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
            for g in range(2)
            for r in range(2)
        ]
        for p in procs:
            if p.wait(timeout=1800) != 0:
                raise RuntimeError(f"a worker failed (exit {p.returncode})")
        results = json.loads(out.read_text())
    return {k: v[rounds // 5 :] for k, v in results.items()}  # the first fifth warms up


# ------------------------------------------------------------------------------------------ kill -> commit
def kill_to_commit(steps: int, kill_at: int, step_sleep: float) -> tuple[float, str]:
    """(seconds from the kill to group 1's next committed step line, the launcher's own figure)."""
    cmd = [
        sys.executable,
        "-m",
        "ftlaunch.launcher.cli",
        "--replicas",
        "2",
        "--nproc-per-node",
        "2",
        "--no-status",
        "--chaos",
        f"steps={kill_at},group=1",
        str(HERE.parent / "train_hsdp.py"),
        "--steps",
        str(steps),
        "--step-sleep",
        str(step_sleep),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    step_line = re.compile(r"^\[rg1/r0\] step=\d+ committed=True")
    t_kill = rejoin = None
    healing = False  # the restarted incarnation's heal: lines of the killed one may still arrive before it
    told = "n/a"
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.monotonic()
        if t_kill is None and "chaos: SIGKILL" in line:
            t_kill = now
        elif t_kill is not None and line.startswith("[rg1/r0]") and "healing from rg0" in line:
            healing = True
        elif healing and rejoin is None and step_line.match(line):
            rejoin = now - t_kill
        m = re.search(r"group committed again ([\d.]+)s later", line)
        if m:
            told = f"{m.group(1)} s"
    if proc.wait(timeout=600) != 0:
        raise RuntimeError(f"the ftlaunch run failed (exit {proc.returncode})")
    if t_kill is None or rejoin is None:
        raise RuntimeError("the launcher never injected the failure, or group 1 never committed again")
    return rejoin, told


# ------------------------------------------------------------------------------------------ driver
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=120, help="steps of each setup, taken in turn")
    ap.add_argument("--runs", type=int, default=1, help="repeat the step-time measurement (median of runs)")
    ap.add_argument(
        "--backend",
        choices=["baby-gloo", "gloo"],
        default="baby-gloo",
        help="ftlaunch's cross-group process group (default: ftlaunch.init's, Baby Gloo)",
    )
    ap.add_argument("--no-kill", action="store_true", help="skip the kill -> commit measurement")
    ap.add_argument("--kill-only", action="store_true", help="only the kill -> commit measurement")
    ap.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        g, r, port, lh, store_port, rounds, out, backend = args.worker
        worker(int(g), int(r), int(port), lh, int(store_port), int(rounds), out, backend)
        return 0

    print(f"load before: {os.getloadavg()[0]:.2f} (1-min average; {os.cpu_count()} CPUs)", flush=True)
    if not args.kill_only:
        step_times(args)
    if not args.no_kill:
        rejoin, told = kill_to_commit(steps=150, kill_at=30, step_sleep=0.05)
        print(
            f"kill -> restarted group's first committed step {rejoin:6.2f} s through ftlaunch (its summary: "
            f"{told}); includes the agent's restart, Python/torch start-up, FSDP sharding and the heal"
        )
        print(f"load after: {os.getloadavg()[0]:.2f}", flush=True)
    return 0


def step_times(args: argparse.Namespace) -> None:
    ratios: list[float] = []
    phases: dict[str, list[list[float]]] = {"plain": [], "ftlaunch": []}
    for i in range(args.runs):
        res = step_ratio(args.rounds, args.backend)
        ratios.append(
            statistics.median(f[0] / p[0] for f, p in zip(res["ftlaunch"], res["plain"], strict=True))
        )
        for k in phases:
            phases[k].append([statistics.median(col) for col in zip(*res[k], strict=True)])
        print(
            f"run {i + 1}: FT-HSDP / plain HSDP step time, median over rounds: {ratios[-1]:.3f}", flush=True
        )
    print(
        f"setup: 2 groups x 2 workers, Gloo/loopback, train_hsdp.py's GPT, AdamW, clip 1.0; "
        f"{args.rounds} interleaved rounds x {args.runs} run(s); ftlaunch backend {args.backend}"
    )
    plain_ms = statistics.median(ph[0] for ph in phases["plain"]) * 1e3
    print(f"plain torch HSDP (fully_shard, 2-D mesh) step {plain_ms:8.2f} ms")
    print(
        f"FT-HSDP / plain HSDP step time          ratio {statistics.median(ratios):5.3f}  (target {TARGET})"
    )
    print("per-phase medians (ms)          " + "".join(f"{k:>12}" for k in phases))
    for j, name in enumerate(("step", *PHASES)):
        cols = [statistics.median(ph[j] for ph in phases[k]) * 1e3 for k in phases]
        print(f"  {name:<30}" + "".join(f"{c:12.2f}" for c in cols))
    print(f"load after: {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
