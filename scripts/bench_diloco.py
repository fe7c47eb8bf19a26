#!/usr/bin/env python3
"""Communication and time per inner step: DDP vs LocalSGD vs DiLoCo vs Streaming DiLoCo.

Every configuration trains the same model on the same data (scripts/train_diloco.py: a 3-layer MLP
learning a fixed teacher, 2 replica groups x 1 worker, Baby Gloo on loopback, an in-process
lighthouse that puts every group in every quorum) for the same number of inner steps, and reports
for replica group 0's worker:

* bytes sent per inner step through the cross-group process group (every collective counted by its
  standard algorithm: ring all-reduce 2 (W-1)/W x size, all-to-all (W-1)/W, all-gather (W-1) x
  input), the join, the per-sync agreement and the commit votes included;
* the reduction against DDP;
* wall time per inner step (the syncs and their waits included);
* the held-out loss after N inner steps (DiLoCo: of the global parameters), beside the loss of DDP
  with the same inner optimizer.

Streaming DiLoCo here: 5 fragments, one inner step of overlap (tau = 1), 4-bit pseudo-gradients.
DiLoCo and Streaming DiLoCo use the paper's optimizers (inner AdamW, outer Nesterov SGD lr 0.7,
momentum 0.9) and are compared with DDP + AdamW; LocalSGD uses SGD with momentum and is compared
with DDP + SGD. Bytes are compared with DDP's (the same for both optimizers).

Usage: python scripts/bench_diloco.py [--steps 600] [--groups 2] [--width 256] [--sync-every 10 50 100]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, str(REPO / "scripts" / "train_diloco.py")]


#: The DDP run each configuration's loss is compared with: the same inner optimizer.
BASELINE_OF = {"sgd": "DDP (SGD)", "adamw": "DDP (AdamW)"}


def configurations(sync_every: list[int]) -> list[tuple[str, list[str]]]:
    found = [
        ("DDP (SGD)", ["--algorithm", "ddp", "--lr", "0.02"]),
        ("DDP (AdamW)", ["--algorithm", "ddp", "--inner", "adamw", "--lr", "3e-3"]),
    ]
    for h in sync_every:
        found += [
            (f"LocalSGD H={h}", ["--algorithm", "local_sgd", "--lr", "0.02", "--sync-every", str(h)]),
            (f"DiLoCo H={h}", ["--algorithm", "diloco", "--sync-every", str(h)]),
            (
                f"Streaming H={h}",
                [
                    "--algorithm",
                    "diloco",
                    "--sync-every",
                    str(h),
                    "--fragments",
                    "5",
                    "--fragment-sync-delay",
                    "1",
                    "--quantize",
                    "4",
                ],
            ),
        ]
    return found


def run(args: list[str], groups: int, steps: int, width: int) -> dict[str, float]:
    from ftlaunch import env
    from ftlaunch.lighthouse.server import LighthouseServer

    base = {
        k: v
        for k, v in os.environ.items()
        if k not in (env.RANK, env.WORLD_SIZE, env.MASTER_ADDR, env.MASTER_PORT)
    }
    base["OMP_NUM_THREADS"] = "1"
    cmd = [*TRAIN, *args, "--steps", str(steps), "--width", str(width), "--count-bytes", "--same-init"]
    with LighthouseServer("127.0.0.1:0", min_replicas=groups, join_timeout=30.0, heartbeat_timeout=10.0,
                          quorum_tick=0.05).start() as lh:  # fmt: skip
        procs = []
        for g in range(groups):
            e = dict(base)
            e.update({env.REPLICA_GROUP_ID: str(g), env.NUM_REPLICA_GROUPS: str(groups),
                      env.FTLAUNCH_LIGHTHOUSE: lh.address})  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=e, cwd=REPO, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE,
                                          text=True))  # fmt: skip
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=900)
            if p.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
            outs.append(out)
    m = re.search(r"eval_loss=(\S+) inner_steps=(\d+) ms_per_inner_step=(\S+) bytes_sent=(\d+)", outs[0])
    if m is None:
        raise SystemExit(f"no result line in:\n{outs[0][-2000:]}")
    n = int(m.group(2))
    return {"loss": float(m.group(1)), "ms": float(m.group(3)), "bytes": int(m.group(4)) / n, "steps": n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600, help="inner steps per run (a multiple of every H)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--sync-every", type=int, nargs="+", default=[10, 50, 100])
    args = p.parse_args()
    if any(args.steps % h for h in args.sync_every):
        raise SystemExit("--steps must be a multiple of every --sync-every")
    load = os.getloadavg()
    print(
        f"# {args.groups} groups x 1 worker, MLP width {args.width}, {args.steps} inner steps; "
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    header = (
        f"{'configuration':<18} {'bytes/step':>12} {'vs DDP':>9} {'ms/step':>9} {'loss':>9} {'DDP loss':>9}"
    )
    print("# DDP loss: DDP with the same inner optimizer (SGD for LocalSGD, AdamW for DiLoCo)")
    print(header)
    print("-" * len(header))
    done: dict[str, dict[str, float]] = {}
    for name, cfg in configurations(args.sync_every):
        t0 = time.perf_counter()
        r = done[name] = run(cfg, args.groups, args.steps, args.width)
        ddp = done["DDP (SGD)"]
        inner = "adamw" if "diloco" in cfg or "adamw" in cfg else "sgd"
        baseline = done[BASELINE_OF[inner]]
        reduction = ddp["bytes"] / r["bytes"] if r["bytes"] else float("inf")
        print(
            f"{name:<18} {r['bytes']:>12,.0f} {reduction:>8.1f}x {r['ms']:>9.2f} {r['loss']:>9.5f} "
            f"{baseline['loss']:>9.5f}   ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
