#!/usr/bin/env python3
"""Stragglers: the job's steps per second while one group is slow, ``--stragglers report`` against
``replace``, and the time from the slowdown to the spare's first commit, as a user counts them.

Runs ``ftlaunch --replicas 3 --spares 1 --stragglers POLICY --chaos steps=K,group=1,slow=2,slow_for=60
scripts/train_ddp.py --compute-ms 30`` (default settings otherwise: Baby Gloo, pg transport, the
lighthouse's straggler rule as shipped) and timestamps every line as it arrives from the ``ftlaunch``
command. ``--compute-ms`` is CPU work per step (a stand-in for a larger model: a throttled worker
takes longer for it, as for real compute). The slowdown starts at the chaos line; the job's rate is
its furthest committed step's progress per second over the slowdown's ``slow_for`` seconds, beside
the rate over the ``--before`` seconds before it (unslowed). With ``replace`` the lighthouse replaces
group 1 once it has been a straggler for 10 steps and 15 s: from the chaos line to the first
committed step of the spare (agent 3, promoted into slot 1). The two policies run interleaved
(report, replace, report, ...) so that the machine's load weighs on both alike; each run is
stopped (SIGINT) once its slowdown is over.

The baseline is ``report`` in the same invocation: it only shows the straggler, so the job runs at
the slow group's pace for the whole slowdown (no straggler handling anywhere else: torchft has none).

Usage: python scripts/bench_stragglers.py [--pairs 2] [--factor 2] [--slow-for 60] [--compute-ms 30]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve()
REPLICAS, SPARES, SLOWED = 3, 1, 1
SPARE_AGENT = REPLICAS  # agents 0..N-1 train, N.. start as spares
STEP_LINE = re.compile(r"^\[rg(\d+)/r0\] step=(\d+) committed=True")
CHAOS_LINE = "[ftlaunch] chaos: replica group 1 workers slowed down"
REPLACED_LINE = re.compile(r"^\[ftlaunch\] replica group (\S+) replaced as a straggler")


@dataclass
class Run:
    policy: str
    before: float  # the job's steps/s in the window before the slowdown
    during: float  # ... and during it
    replaced_after: float | None  # chaos line -> the spare's first committed step (replace)
    replacements: list[str]


def one_run(
    policy: str, factor: float, slow_for: float, before: float, compute_ms: float, slow_at: int
) -> Run:
    script = HERE.parent / "train_ddp.py"
    cmd = [sys.executable, "-m", "ftlaunch.launcher.cli", "--replicas", str(REPLICAS), "--spares",
           str(SPARES),
           "--stragglers", policy, "--no-status",
           "--chaos", f"steps={slow_at},group={SLOWED},slow={factor:g},slow_for={slow_for:g}",
           str(script), "--steps", "1000000", "--compute-ms", str(compute_ms)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    frontier: list[tuple[float, int]] = []  # (arrival, the job's furthest committed step)
    t_slow: float | None = None
    replaced: float | None = None
    replacements: list[str] = []
    stopping = False
    assert proc.stdout is not None
    try:
        for line in proc.stdout:  # read to the end: a job stopping still prints its summary
            now = time.monotonic()
            if stopping:
                continue
            if t_slow is None and line.startswith(CHAOS_LINE):
                t_slow = now
            if (m := REPLACED_LINE.match(line)) is not None:
                replacements.append(m.group(1))
            m = STEP_LINE.match(line)
            if m is not None:
                step = int(m.group(2))
                if not frontier or step > frontier[-1][1]:
                    frontier.append((now, step))
                if int(m.group(1)) == SPARE_AGENT and t_slow is not None and replaced is None:
                    replaced = now - t_slow
            if t_slow is not None and now > t_slow + slow_for:
                proc.send_signal(signal.SIGINT)  # the slowdown is over: stop the job
                stopping = True
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if t_slow is None:
        raise RuntimeError(f"no slowdown injected ({policy}; exit {proc.returncode})")
    return Run(
        policy,
        _rate(frontier, t_slow - before, t_slow),
        _rate(frontier, t_slow, t_slow + slow_for),
        replaced,
        replacements,
    )


def _rate(frontier: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Steps per second of the job's furthest committed step between ``t0`` and ``t1``."""

    def step_at(t: float) -> int:
        return max((s for at, s in frontier if at <= t), default=0)

    return (step_at(t1) - step_at(t0)) / (t1 - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2, help="report/replace pairs, interleaved (default 2)")
    p.add_argument("--factor", type=float, default=2.0, help="--chaos slow= (default 2)")
    p.add_argument("--slow-for", type=float, default=60.0, help="--chaos slow_for= seconds (default 60)")
    p.add_argument(
        "--before", type=float, default=10.0, help="seconds before the slowdown measured (default 10)"
    )
    p.add_argument("--compute-ms", type=float, default=30.0, help="CPU work per step (default 30)")
    p.add_argument("--slow-at", type=int, default=60, help="the step at which group 1 is slowed (default 60)")
    args = p.parse_args()
    load = os.getloadavg()[0]
    print(f"ftlaunch --replicas {REPLICAS} --spares {SPARES}, group {SLOWED} slowed {args.factor:g}x for "
          f"{args.slow_for:g}s at step {args.slow_at}, {args.compute_ms:g} ms CPU work per step; "
          f"{args.pairs} pair(s), load {load:.1f} on {os.cpu_count()} CPUs:", flush=True)  # fmt: skip
    runs: dict[str, list[Run]] = {"report": [], "replace": []}
    for i in range(args.pairs):
        for policy in ("report", "replace"):
            r = one_run(policy, args.factor, args.slow_for, args.before, args.compute_ms, args.slow_at)
            runs[policy].append(r)
            took = (
                f", slowdown -> the spare's first commit {r.replaced_after:.1f} s"
                if r.replaced_after is not None
                else ""
            )
            print(f"  pair {i + 1} {policy:7s}: {r.before:.2f} steps/s before, {r.during:.2f} during the "
                  "slowdown"
                  f"{took}; replaced: {', '.join(r.replacements) or 'none'}", flush=True)  # fmt: skip
    print(f"load {os.getloadavg()[0]:.1f} at the end")
    for policy, rs in runs.items():
        print(f"{policy:7s}: job steps/s during the slowdown median "
              f"{statistics.median(r.during for r in rs):.2f} "
              f"(unslowed before it: {statistics.median(r.before for r in rs):.2f})")  # fmt: skip
    took = [r.replaced_after for r in runs["replace"] if r.replaced_after is not None]
    if took:
        print(f"replace: slowdown -> the spare's first committed step median {statistics.median(took):.1f} s "
              f"(min {min(took):.1f}, max {max(took):.1f}; {len(took)}/{len(runs['replace'])} runs "
              "replaced); "
              f"baseline: report never replaces")  # fmt: skip
    else:
        print("replace: the slowed group was never replaced")
    return 0


if __name__ == "__main__":
    sys.exit(main())
