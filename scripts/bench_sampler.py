#!/usr/bin/env python3
"""What exactly-once costs per step: ``ft.sampler`` (ExactlyOnceSampler) against the fixed shards
(``mode="shard"``, DistributedSampler), interleaved in one run so both see the same machine load.

1. **Through ftlaunch** (as a user counts it): ``ftlaunch --replicas 2 scripts/train_ddp.py
   --sampler exact|shard`` with the defaults (3-layer MLP of width 256, batch 32, Baby Gloo), the
   two modes alternating ``--rounds`` times. Per run: the median interval between a group's
   consecutive committed-step lines (the whole loop: drawing the batch, the step, the log line),
   after a warm-up.
2. **The sampler alone**, in one process: a DataLoader (``num_workers=0``) over the same dataset,
   ``next(loader)`` plus a commit per step (the Manager's step counter and plan, without a network),
   so the sampler's own microseconds show rather than drown in the step's noise.

Usage: python scripts/bench_sampler.py [--rounds 3] [--steps 300] [--micro-steps 3000]
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
from typing import Any

HERE = Path(__file__).resolve()
STEP_LINE = re.compile(r"^\[rg(\d+)/r0\] step=(\d+) committed=True .* t=([\d.]+)", re.M)
WARMUP = 20


def ftlaunch_run(mode: str, steps: int) -> float:
    """Median seconds between consecutive committed steps of a group, over both groups."""
    cmd = [sys.executable, "-m", "ftlaunch.launcher.cli", "--replicas", "2", "--no-status", "--no-summary",
           str(HERE.parent / "train_ddp.py"), "--steps", str(steps), "--sampler", mode]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if out.returncode != 0:
        raise SystemExit(f"ftlaunch failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    times: dict[int, list[tuple[int, float]]] = {}
    for m in STEP_LINE.finditer(out.stdout):
        times.setdefault(int(m[1]), []).append((int(m[2]), float(m[3])))
    gaps = []
    for seq in times.values():
        seq.sort()
        gaps += [
            b[1] - a[1] for a, b in zip(seq, seq[1:], strict=False) if a[0] >= WARMUP and b[0] == a[0] + 1
        ]
    return statistics.median(gaps)


class _Manager:
    """The Manager's step counter and plan, as the sampler reads them (no network)."""

    def __init__(self) -> None:
        from ftlaunch.worker.plan import StepPlan

        self.replica_id, self.step, self.attempt = "rg0", 0, 0
        self._plan = StepPlan(
            quorum_id=1, replica_rank=0, replica_world_size=2, max_step=0, num_sources=2, source_rank=0,
            recover_src_rank=None, recover_src_id=None, recover_dst_ranks=(), store_address="",
            num_participants=2, participant_rank=0, participant_ids=("rg0", "rg1"),
        )  # fmt: skip
        self.plan: Any = None

    def current_step(self) -> int:
        return self.step

    def latest_plan(self) -> tuple[int, Any]:
        return self.attempt, self.plan

    def register_state_dict_fn(self, *_: Any) -> None: ...

    def commit(self) -> None:  # start_quorum ... should_commit, committed
        from dataclasses import replace

        self.attempt += 1
        self.plan = replace(self._plan, max_step=self.step)
        self.step += 1


def micro_run(mode: str, steps: int, batch: int, size: int) -> float:
    """Median microseconds per step of ``next(loader)`` + a commit."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from ftlaunch.worker.data import DistributedSampler
    from ftlaunch.worker.exactly_once import ExactlyOnceSampler

    dataset = TensorDataset(torch.arange(size), torch.randn(size, 64), torch.randn(size, 8))
    manager = _Manager()
    sampler: Any = (
        ExactlyOnceSampler(dataset, manager, num_replica_groups=2)
        if mode == "exact"
        else DistributedSampler(dataset, 0, 2, 0, 1)
    )
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler)
    it = iter(loader)
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            if mode == "shard":
                sampler.set_epoch(sampler.epoch + 1)
            it = iter(loader)
            next(it)
        manager.commit()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="ftlaunch runs per mode, interleaved (default 3)")
    p.add_argument("--steps", type=int, default=300, help="committed steps per ftlaunch run (default 300)")
    p.add_argument("--micro-steps", type=int, default=3000, help="steps per in-process round (default 3000)")
    p.add_argument("--micro-rounds", type=int, default=5)
    args = p.parse_args()
    modes = ("shard", "exact")
    print(f"load average at start: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)", flush=True)

    micro: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.micro_rounds):
        for m in modes:
            micro[m].append(micro_run(m, args.micro_steps, 32, 4096))
    print("\nthe sampler alone: DataLoader(batch_size=32, num_workers=0) next() + a commit, per step")
    for m in modes:
        print(f"  {m:5s}  median {statistics.median(micro[m]):7.1f} us  (rounds: "
              + ", ".join(f"{v:.1f}" for v in micro[m]) + ")")  # fmt: skip
    diff = statistics.median(micro["exact"]) - statistics.median(micro["shard"])
    print(f"  exact - shard: {diff:+.1f} us per step")

    runs: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes:
            runs[m].append(ftlaunch_run(m, args.steps))
            print(f"  round {r + 1} {m:5s}: {runs[m][-1] * 1e3:.2f} ms/step", flush=True)
    print(
        f"\nftlaunch --replicas 2 scripts/train_ddp.py --steps {args.steps} (defaults), median step interval"
    )
    for m in modes:
        print(f"  {m:5s}  median {statistics.median(runs[m]) * 1e3:6.2f} ms  (runs: "
              + ", ".join(f"{v * 1e3:.2f}" for v in runs[m]) + ")")  # fmt: skip
    spread = max(max(v) - min(v) for v in runs.values()) * 1e3
    diff_ms = (statistics.median(runs["exact"]) - statistics.median(runs["shard"])) * 1e3
    print(f"  exact - shard: {diff_ms:+.2f} ms per step (run-to-run spread within a mode: {spread:.2f} ms)")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
