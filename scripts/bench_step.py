#!/usr/bin/env python
"""Step time of ftlaunch's two-line DDP form, for one or more source trees, interleaved in one run.

Each run is what a user types: ``ftlaunch --replicas 2 scripts/train_ddp.py --steps N`` (the
defaults: Baby Gloo, the PG transport, an in-process lighthouse), with ``PYTHONPATH`` pointing at
one tree. The step time is what ``train_ddp.py`` prints per step (``zero_grad`` to the optimizer's
commit: quorum, forward, backward with the allreduces, the votes), replica group 0's, its first
``--warmup`` steps left out. Trees are run in alternating order, round after round (A B, B A, ...),
so that the load of other processes on a shared machine falls on each alike; the ratio is the
median over rounds of the same round's ratio of medians.

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
    args = p.parse_args()
    trees = {name: Path(path).resolve() for name, path in (t.split("=", 1) for t in args.tree)}
    medians: dict[str, list[float]] = {name: [] for name in trees}
    names = list(trees)
    started = time.monotonic()
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times = one_run(trees[name], args.steps, args.warmup, args.width, args.timeout)
            medians[name].append(statistics.median(times))
        print(f"round {r + 1}: " + "  ".join(f"{n} {medians[n][-1]:.2f} ms" for n in names), flush=True)
    base = names[0]
    print(f"\nstep time of replica group 0 (median of {args.steps - args.warmup} steps per run, "
          f"{args.rounds} rounds, {time.monotonic() - started:.0f} s, load {os.getloadavg()[0]:.1f}):")  # fmt: skip
    for name in names:
        ratios = [m / b for m, b in zip(medians[name], medians[base], strict=True)]
        spread = f"{min(medians[name]):.2f}-{max(medians[name]):.2f}"
        print(f"  {name:>12}: median {statistics.median(medians[name]):.2f} ms (rounds {spread}), "
              f"÷ {base}: {statistics.median(ratios):.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
