#!/usr/bin/env python
"""Step time of ftlaunch's two-line DDP form, for one or more source trees, interleaved in one run.

Each run is what a user types: ``ftlaunch --replicas 2 scripts/train_ddp.py --steps N`` (the
defaults: Baby Gloo, the PG transport, an in-process lighthouse), with ``PYTHONPATH`` pointing at
one tree. The step time is what ``train_ddp.py`` prints per step (``zero_grad`` to the optimizer's
commit: quorum, forward, backward with the allreduces, the votes), replica group 0's, its first
``--warmup`` steps left out. Trees are run in alternating order, round after round (A B, B A, ...),
so that the load of other processes on a shared machine falls on each alike; the ratio is the
median over rounds of the same round's ratio of medians.

``--in-process`` measures the Manager's own cost instead: one process per tree runs the step
(``start_quorum``, one allreduce, ``should_commit``) against `FakeProcessGroup` (a world of identical
peers in one process) and a quorum client that answers at once, and reports the CPU time its
threads spent per step (``time.process_time``): what the Manager's code costs, which the wait for a
core on a loaded machine does not change (its wall time does, by an order of magnitude).

    python scripts/bench_step.py --tree main=/path/to/other/tree --tree this=. [--rounds 5] [--steps 300]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEP = re.compile(r"\[rg0/r0\].*step=(\d+) committed=True .*ms=([0-9.]+)")


#: The child of ``--in-process``: prints the CPU microseconds per step of the Manager's threads.
IN_PROCESS = r"""
import dataclasses, sys, time
import torch, torch.distributed as dist
from ftlaunch.lighthouse.quorum import Quorum
from ftlaunch.process_group.fake import FakeProcessGroup
from ftlaunch.worker.manager import Manager

class Client:
    def quorum(self, member, timeout):
        peer = dataclasses.replace(member, replica_id="rg1")
        return Quorum(quorum_id=1, participants=(member, peer), created=0.0)
    def start_heartbeat(self, replica_id, interval): return object()
    def leave(self, replica_id): pass
    def close(self): pass

torch.set_num_threads(1)  # no OpenMP spinning in the measurement
steps, warmup = int(sys.argv[1]), int(sys.argv[2])
grad = torch.ones(1 << 16)
m = Manager(pg=FakeProcessGroup(), load_state_dict=lambda s: None, state_dict=lambda: {}, replica_id="rg0",
            rank=0, world_size=1, group_store=dist.HashStore(), store_addr="127.0.0.1", store_port=1,
            quorum_client=Client(), init_sync=False, timeout=30.0)
cpu = 0.0
try:
    for i in range(steps):
        if i == warmup:
            cpu = time.process_time()
        m.start_quorum()
        m.allreduce(grad).wait()
        assert m.should_commit()
    cpu = time.process_time() - cpu
finally:
    m.shutdown()
print(f"us={cpu / (steps - warmup) * 1e6:.1f}")
"""


def one_in_process(tree: Path, steps: int, warmup: int, timeout: float) -> float:
    """The CPU milliseconds per step of the Manager, importing ``tree``'s ftlaunch."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", IN_PROCESS, str(steps), str(warmup)], env=env, cwd=tree,
                         capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
    found = re.search(r"us=([0-9.]+)", out.stdout)
    if out.returncode != 0 or found is None:
        raise SystemExit(f"{tree}: the in-process run exited {out.returncode}\n{out.stderr[-2000:]}")
    return float(found.group(1)) / 1e3


def one_run(tree: Path, steps: int, warmup: int, width: int, timeout: float) -> list[float]:
    """Replica group 0's committed step times (ms) of one ``ftlaunch --replicas 2`` run of ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "ftlaunch.launcher.cli", "--replicas", "2",
           str(tree / "scripts" / "train_ddp.py"), "--steps", str(steps), "--width", str(width)]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=timeout, check=False)
    times = [float(m.group(2)) for m in STEP.finditer(out.stdout + out.stderr) if int(m.group(1)) >= warmup]
    if out.returncode != 0 or not times:
        tail = (out.stdout + out.stderr)[-2000:]
        raise SystemExit(f"{tree}: ftlaunch exited {out.returncode} with {len(times)} step times\n{tail}")
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH of a source tree (repeat)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20, help="first steps left out (start-up, first heal)")
    p.add_argument("--width", type=int, default=256, help="hidden width of train_ddp.py's MLP")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument(
        "--in-process", action="store_true", help="time the Manager alone, in one process per tree"
    )
    args = p.parse_args()
    trees = {name: Path(path).resolve() for name, path in (t.split("=", 1) for t in args.tree)}
    medians: dict[str, list[float]] = {name: [] for name in trees}
    names = list(trees)
    started = time.monotonic()
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            if args.in_process:
                medians[name].append(one_in_process(trees[name], args.steps, args.warmup, args.timeout))
            else:
                times = one_run(trees[name], args.steps, args.warmup, args.width, args.timeout)
                medians[name].append(statistics.median(times))
        print(f"round {r + 1}: " + "  ".join(f"{n} {medians[n][-1]:.3f} ms" for n in names), flush=True)
    base = names[0]
    what = (
        "CPU time of the Manager's step in one process" if args.in_process else "replica group 0's step time"
    )
    print(
        f"\n{what} (median of {args.steps - args.warmup} steps per run, "
        f"{args.rounds} rounds, {time.monotonic() - started:.0f} s, load {os.getloadavg()[0]:.1f}):"
    )
    for name in names:
        ratios = [m / b for m, b in zip(medians[name], medians[base], strict=True)]
        spread = f"{min(medians[name]):.3f}-{max(medians[name]):.3f}"
        print(f"  {name:>12}: median {statistics.median(medians[name]):.3f} ms (rounds {spread}), "
              f"÷ {base}: {statistics.median(ratios):.3f} (rounds "
              f"{' '.join(f'{x:.2f}' for x in ratios)})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
