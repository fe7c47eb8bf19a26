#!/usr/bin/env python3
"""Hot spares: kill -> first committed step of the replacement, as a user counts it (issue 11).

Runs ``ftlaunch --replicas 2 --spares 1 --chaos steps=K,group=1 scripts/train_ddp.py`` (default
settings: Baby Gloo, pg transport; a 3-layer MLP of width 1024, batch 32, as bench_recovery.py) and
timestamps every line as it arrives from the ``ftlaunch`` command. From the chaos line (printed
right after the signal) to the first committed step line of the spare (agent 2, promoted into the
failed group's slot), and the survivor's longest gap between committed steps over the episode.
``--hang`` sends SIGSTOP instead: the spare is promoted after the heartbeat timeout
(``--heartbeat-timeout``, default here 1 s), but the survivor leaves the collective it shares with
the stopped group only at the collective timeout (the script's ``timeout``, 60 s by default; give
``--script-timeout 2`` to see it) or when the group resumes (``stop_for`` = 30 s here), and the spare
joins the quorum after that: the figure is that wait plus the takeover.

Kept apart from bench_recovery.py (the no-spare figures) so either can change alone.

Usage: python scripts/bench_spares.py [--runs 3] [--kill-at 40] [--hang]
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

HERE = Path(__file__).resolve()
WIDTH = 1024
BATCH = 32
TARGET = "<= 1.0 s (goal 0.5 s)"
BASELINE = "no spares in torchft; without spares: see bench_recovery.py (8.7 s before issue 11)"

STEP_LINE = re.compile(r"^\[rg(\d+)/r0\] step=(\d+) committed=(True|False)")


def one_run(
    kill_at: int, steps: int, hang: bool, heartbeat_timeout: float, script_timeout: float | None = None
) -> tuple[float, float]:
    """(kill -> the spare's first committed step, the survivor's longest gap) in seconds."""
    script = HERE.parent / "train_ddp.py"
    chaos = f"steps={kill_at},group=1" + (",signal=STOP,stop_for=30" if hang else "")
    cmd = [sys.executable, "-m", "ftlaunch.launcher.cli", "--replicas", "2", "--spares", "1", "--no-status",
           "--chaos", chaos, *(["--heartbeat-timeout", str(heartbeat_timeout)] if hang else []),
           str(script), "--steps", str(steps), "--width", str(WIDTH), "--batch-size", str(BATCH),
           "--step-sleep", "0.02", *(["--timeout", str(script_timeout)] if script_timeout else [])]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    t_kill: float | None = None
    survivor: list[float] = []
    replaced: float | None = None
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            now = time.monotonic()
            if t_kill is None and "[ftlaunch] chaos: SIG" in line:
                t_kill = now
            m = STEP_LINE.match(line)
            if m is None or m.group(3) != "True":
                continue
            if m.group(1) == "0":
                survivor.append(now)
            elif m.group(1) == "2" and t_kill is not None and replaced is None:
                replaced = now - t_kill
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if t_kill is None or replaced is None:
        raise RuntimeError(f"no failure injected or no replacement step (exit {proc.returncode})")
    episode = [t for t in survivor if t_kill - 1.0 <= t <= t_kill + replaced + 1.0]
    gap = max((b - a for a, b in zip(episode, episode[1:], strict=False)), default=float("inf"))
    return replaced, gap


def bench_spares(
    runs: int, kill_at: int, steps: int, hang: bool, heartbeat_timeout: float, script_timeout: float | None = None
) -> list[tuple[float, float]]:
    """The spare's takeover, ``runs`` times (the function bench_recovery.py's --spares could call)."""
    results = []
    for i in range(runs):
        replaced, gap = one_run(kill_at, steps, hang, heartbeat_timeout, script_timeout)
        print(f"  run {i + 1}: kill -> replacement's first committed step {replaced:.3f} s, "
              f"survivor's longest gap {gap:.3f} s", flush=True)  # fmt: skip
        results.append((replaced, gap))
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=40, help="step at which group 1 is killed")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--hang", action="store_true", help="SIGSTOP instead of SIGKILL (promotion after the heartbeat timeout)")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0, help="with --hang (default 1 s)")
    p.add_argument("--script-timeout", type=float, default=None, help="the script's timeout knob (default: its 60 s)")
    args = p.parse_args()
    what = "SIGSTOP (hang)" if args.hang else "SIGKILL"
    print(f"ftlaunch --replicas 2 --spares 1, {what} of group 1 at step {args.kill_at}, {args.runs} run(s):", flush=True)
    results = bench_spares(args.runs, args.kill_at, args.steps, args.hang, args.heartbeat_timeout, args.script_timeout)
    replaced = [r for r, _ in results]
    gaps = [g for _, g in results]
    print(f"kill -> first committed step of the replacement: median {statistics.median(replaced):.3f} s "
          f"(min {min(replaced):.3f}, max {max(replaced):.3f}); target {TARGET}; baseline: {BASELINE}")  # fmt: skip
    print(f"survivor's longest gap over the episode: median {statistics.median(gaps):.3f} s (max {max(gaps):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
