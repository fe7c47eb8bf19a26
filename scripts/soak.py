#!/usr/bin/env python3
"""Chaos soak through the ``ftlaunch`` command: nothing is lost, nothing diverges, nothing is left.

Runs scripts/train_ddp.py under ``ftlaunch --replicas G`` twice, as a user would:

1. fault-free (the baseline of goodput), then
2. with ``--chaos every=E,signal=MIX,lighthouse=L,lighthouse_down=D``: every ~E seconds a random
   SIGKILL of a group's workers, SIGSTOP of them (for ``stop_for``) or SIGKILL of its elastic agent,
   and once, L seconds into training, a crash of the lighthouse the launcher hosts, which the
   launcher restarts on the same address D seconds later, then
3. the same chaos with a long lighthouse outage (``--long-outage``, 12 s), reported beside it.

**Which outage.** The soak has one lighthouse restart, and what ftlaunch does for a lighthouse that
dies is that the launcher restarts a lighthouse it hosts. That is what run 2 does
by default: the supervisor checks its lighthouse at every tick of its main loop
(`ftlaunch.launcher.supervisor.LIGHTHOUSE_CHECK_S`, 0.05 s) and restarts a dead one at once on the
same address, so D defaults to that check interval -- the outage the launcher's own restart gives.
A lighthouse restarted by someone else (a scheduler replacing its pod, systemd) may stay away much
longer: run 3 keeps it down 12 s, longer than the workers' 10 s connect timeout, so the outage path
of ftlaunch.lighthouse.reconnect and stepping through an outage (worker/outage.py) are exercised, and
its figures are always reported too (``--long-outage 0`` skips it). Faults injected inside a long
outage cannot be handled until the lighthouse is back (no membership change without it), so that
variant's goodput is lower; the issue's target is judged on run 2, the correctness targets (0
crashes, 0 divergence, 0 orphans, every step) on both.

and prints a report (``--json`` writes it too):

* injections by kind, and the lighthouse restart;
* committed steps (the steps every group ended at) and crashes (a worker that exited on its own with
  an error, not killed by the chaos; the job's exit code);
* goodput: fault-free training time / chaos training time for the same steps (training time = first
  step line to the last group's final line; start-up is not counted);
* longest survivor stall: the longest time no group committed a step;
* divergence: groups that finished with a final weights checksum other than the majority's;
  groups the launcher stopped because the training finished while they were down (nobody left
  to heal them) are listed apart;
* orphans: processes of the job alive 10 s after ``ftlaunch`` returned (found by a marker variable
  every process of the job inherits);
* log bytes: what ``ftlaunch`` printed plus its ``--log-dir``;
* where the lost time went (scripts/soak_breakdown.py): the chaos run's extra training time split
  per cause (lighthouse restart, SIGSTOPped groups, kills, rejoins, slower steps, end of run), the
  longest stalls, each injection's way back, and the median restart phases (from the job's
  ``FTLAUNCH_PHASE_LOG``, which the soak sets);
* the machine: CPUs and the 1-minute load average during each run.

``--spares K`` runs both with ``ftlaunch --spares K``: a failed group's slot goes to a hot spare.

Targets: 0 crashes, 0 divergence, 0 orphans, goodput >= 90 %.

Usage: python scripts/soak.py [--groups 4] [--steps 500] [--every 5] [--lighthouse-at 60]
       [--lighthouse-down 0.05] [--long-outage 12] [--step-sleep 0.1] [--seed 1] [--spares 0]
       [--json out.json] [--no-baseline]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from soak_breakdown import Timeline, breakdown, print_breakdown

from ftlaunch import phases
from ftlaunch.launcher.supervisor import LIGHTHOUSE_CHECK_S

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "scripts" / "train_ddp.py"
MARKER = "FTLAUNCH_SOAK_RUN"
TARGETS = {"crashes": 0, "divergent_groups": 0, "orphans": 0, "goodput_min": 0.90}

_STEP = re.compile(r"\[rg(\d+)/r0\][^\n]*?step=(\d+) committed=(True|False)")
_FINAL = re.compile(r"\[rg(\d+)/r0\][^\n]*?final_checksum=(\w+) step=(\d+)")
_INJECT = re.compile(r"\[ftlaunch\] chaos: (SIG\w+) -> replica group (\d+) (\w+)")
_EXITED = re.compile(r"\[ftlaunch\] replica group (\d+): [^\n]*exited with code (-?\d+)")


@dataclass
class Run:
    """What one ``ftlaunch`` run did, from its output lines (time-stamped as they arrived)."""

    code: int = -1
    wall: float = 0.0
    first_step_at: float | None = None
    last_final_at: float | None = None
    commits: list[tuple[float, int, int]] = field(default_factory=list)  # (time, group, step)
    finals: dict[int, tuple[str, int]] = field(default_factory=dict)  # group -> (checksum, step)
    injections: dict[str, int] = field(default_factory=dict)  # "SIGKILL workers" -> count
    injected: list[tuple[float, str, str, int]] = field(default_factory=list)  # (time, SIGx, target, group)
    lighthouse_crash_at: float | None = None
    lighthouse_back_at: float | None = None
    phases: list[dict] = field(default_factory=list)  # the phase log, "t" in this run's clock
    lighthouse_restarts: int = 0
    quorum_changes: int | None = None  # from the summary (the lighthouse's count; churn)
    stopped_groups: list[int] = field(default_factory=list)  # down when the training finished
    error_exits: list[str] = field(default_factory=list)
    tracebacks: int = 0
    log_bytes: int = 0
    orphans: list[str] = field(default_factory=list)
    load: list[float] = field(default_factory=list)  # 1-minute load average, sampled every 5 s
    tail: str = ""

    @property
    def training_time(self) -> float | None:
        if self.first_step_at is None or self.last_final_at is None:
            return None
        return self.last_final_at - self.first_step_at

    def timeline(self) -> Timeline:
        down = (
            (self.lighthouse_crash_at, self.lighthouse_back_at)
            if self.lighthouse_crash_at is not None
            else None
        )
        return Timeline(
            self.commits, self.first_step_at, self.last_final_at, self.injected, down, self.phases
        )

    def longest_stall(self) -> float:
        """Longest time, during training, in which no group committed a step."""
        times = sorted(t for t, _, _ in self.commits)
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


def run_ftlaunch(args: argparse.Namespace, chaos: str | None, label: str) -> Run:
    run = Run()
    log_dir = tempfile.mkdtemp(prefix=f"ftlaunch_soak_{label}_")
    marker = uuid.uuid4().hex
    cmd = [
        sys.executable,
        "-m",
        "ftlaunch.launcher.cli",
        "--replicas",
        str(args.groups),
        "--max-restarts",
        "1000",
        "--max-agent-restarts",
        "1000",
        "--log-dir",
        log_dir,
        "--no-status",
    ]
    if args.spares:
        cmd += ["--spares", str(args.spares)]
    cmd += args.ftlaunch_arg
    if chaos:
        cmd += ["--chaos", chaos]
    cmd += [
        str(TRAIN),
        "--steps",
        str(args.steps),
        "--step-sleep",
        str(args.step_sleep),
        "--max-seconds",
        str(args.max_seconds),
    ]
    phase_log = os.path.join(log_dir, "phases.jsonl")  # where each restart's seconds go (ftlaunch.phases)
    env = dict(os.environ, **{MARKER: marker, "FTLAUNCH_PHASE_LOG": phase_log})
    print(f"soak: {label}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    start = time.monotonic()
    wall_offset = time.time() - start
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace"
    )
    lock = threading.Lock()
    tail: list[str] = []
    keep = open(f"{args.keep_output}.{label}", "w") if args.keep_output else None  # noqa: SIM115

    def read(stream) -> None:  # noqa: ANN001 - a text pipe
        for line in stream:
            now = time.monotonic()
            with lock:
                if keep is not None:
                    keep.write(f"{now - start:9.3f} {line}")
                run.log_bytes += len(line.encode())
                tail.append(line)
                del tail[:-200]
                parse_line(run, line, now, args.verbose)

    readers = [threading.Thread(target=read, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)]
    for r in readers:
        r.start()
    done = threading.Event()

    def sample_load() -> None:
        while not done.wait(5.0):
            run.load.append(os.getloadavg()[0])

    threading.Thread(target=sample_load, daemon=True).start()
    try:
        run.code = proc.wait(timeout=args.max_seconds + 300)
    except subprocess.TimeoutExpired:
        proc.kill()
        run.code = proc.wait()
    done.set()
    for r in readers:
        r.join(30)
    if keep is not None:
        keep.close()
    run.wall = time.monotonic() - start
    run.tail = "".join(tail[-60:])
    run.orphans = orphans(marker, grace=10.0)
    run.phases = [
        {**r, "t": r["t"] - wall_offset,
         **({"process_start": r["process_start"] - wall_offset} if isinstance(r.get("process_start"),
                                                                              float) else {})}
        for r in phases.read(phase_log) if isinstance(r.get("t"), float)
    ]  # fmt: skip
    if args.keep_output:  # the phases too, timed as the kept output (--reanalyze reads them back)
        kept = [{**r, "t": r["t"] - start, **({"process_start": r["process_start"] - start}
                                               if isinstance(r.get("process_start"), float) else {})}
                for r in run.phases]  # fmt: skip
        Path(f"{args.keep_output}.{label}.phases").write_text("".join(json.dumps(r) + "\n" for r in kept))
    run.log_bytes += sum(f.stat().st_size for f in Path(log_dir).rglob("*") if f.is_file())
    shutil.rmtree(log_dir, ignore_errors=True)
    return run


def parse_line(run: Run, line: str, now: float, verbose: bool) -> None:
    if verbose and line.startswith("[ftlaunch]"):
        print(line, end="", file=sys.stderr)
    m = _STEP.search(line)
    if m is not None:
        if run.first_step_at is None:
            run.first_step_at = now
        if m.group(3) == "True":
            run.commits.append((now, int(m.group(1)), int(m.group(2))))
        return
    m = _FINAL.search(line)
    if m is not None:
        run.finals[int(m.group(1))] = (m.group(2), int(m.group(3)))
        run.last_final_at = now
        return
    m = _INJECT.search(line)
    if m is not None:
        kind = f"{m.group(1)} {m.group(3)}"
        run.injections[kind] = run.injections.get(kind, 0) + 1
        run.injected.append((now, m.group(1), m.group(3), int(m.group(2))))
        return
    if "[ftlaunch] chaos: lighthouse crashed" in line and "restarted" not in line:
        run.injections["lighthouse crash"] = run.injections.get("lighthouse crash", 0) + 1
        run.lighthouse_crash_at = now
    m = re.search(r"\[ftlaunch\] replica group (\d+): the training finished while it was recovering", line)
    if m is not None:
        run.stopped_groups.append(int(m.group(1)))
    m = re.search(r"\[ftlaunch\] lighthouse: (\d+) quorum change", line)
    if m is not None:
        run.quorum_changes = int(m.group(1))
    if "stopped serving; restarted on the same address" in line:
        run.lighthouse_restarts += 1
        run.lighthouse_back_at = now
    m = _EXITED.search(line)
    if m is not None and int(m.group(2)) != 0:
        run.error_exits.append(line.strip())
    if line.startswith("Traceback") or "] Traceback" in line:
        run.tracebacks += 1


def orphans(marker: str, grace: float) -> list[str]:
    """Processes carrying this run's marker, still alive ``grace`` seconds after it ended."""
    deadline = time.monotonic() + grace
    while True:
        found = []
        for p in psutil.process_iter(["pid"]):
            try:
                if p.environ().get(MARKER) == marker and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(f"{p.pid}:{' '.join(p.cmdline()[:4])}")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        if not found or time.monotonic() > deadline:
            for entry in found:  # leave nothing behind ourselves either
                try:
                    psutil.Process(int(entry.split(":")[0])).kill()
                except psutil.Error:
                    pass
            return found
        time.sleep(0.5)


def report(args: argparse.Namespace, chaos_run: Run, baseline: Run | None) -> dict:
    sums = {c for c, _ in chaos_run.finals.values()}
    majority = (
        max(sums, key=lambda s: sum(1 for c, _ in chaos_run.finals.values() if c == s)) if sums else None
    )
    divergent = sum(1 for c, _ in chaos_run.finals.values() if c != majority)
    missing = args.groups - len(chaos_run.finals) - len(chaos_run.stopped_groups)  # unexplained
    crashes = len(chaos_run.error_exits) + (0 if chaos_run.code == 0 else 1) + max(missing, 0)
    goodput = None
    if baseline is not None and baseline.training_time and chaos_run.training_time:
        goodput = baseline.training_time / chaos_run.training_time
    steps = sorted({s for _, s in chaos_run.finals.values()})
    out = {
        "groups": args.groups,
        "spares": args.spares,
        "ftlaunch_args": args.ftlaunch_arg,
        "cpus": os.cpu_count(),
        "load_avg_chaos": round(sum(chaos_run.load) / len(chaos_run.load), 2) if chaos_run.load else None,
        "load_avg_baseline": round(sum(baseline.load) / len(baseline.load), 2)
        if baseline and baseline.load
        else None,
        "steps_target": args.steps,
        "chaos": chaos_spec(args),
        "exit_code": chaos_run.code,
        "committed_steps": steps,
        "committed_group_steps": len(chaos_run.commits),
        "injections": chaos_run.injections,
        "injections_total": sum(chaos_run.injections.values()),
        "lighthouse_restarts": chaos_run.lighthouse_restarts,
        "quorum_changes": chaos_run.quorum_changes,
        "baseline_quorum_changes": baseline.quorum_changes if baseline else None,
        "crashes": crashes,
        "error_exits": chaos_run.error_exits,
        "tracebacks_in_output": chaos_run.tracebacks,
        "divergent_groups": divergent,
        "groups_stopped_after_the_end": chaos_run.stopped_groups,
        "final_checksums": {f"rg{g}": c for g, (c, _) in sorted(chaos_run.finals.items())},
        "training_time_s": chaos_run.training_time,
        "baseline_training_time_s": baseline.training_time if baseline else None,
        "goodput": goodput,
        "longest_survivor_stall_s": chaos_run.longest_stall(),
        "baseline_longest_stall_s": baseline.longest_stall() if baseline else None,
        "orphans": chaos_run.orphans + (baseline.orphans if baseline else []),
        "log_bytes": chaos_run.log_bytes,
        "baseline_log_bytes": baseline.log_bytes if baseline else None,
        "wall_s": chaos_run.wall,
        "breakdown": (
            breakdown(chaos_run.timeline(), baseline.timeline(), args.stop_for, args.lighthouse_down)
            if baseline
            else None
        ),
    }
    out["targets"] = TARGETS
    out["met"] = {
        "crashes": crashes == TARGETS["crashes"],
        "divergence": out["divergent_groups"] == TARGETS["divergent_groups"],
        "orphans": len(out["orphans"]) == TARGETS["orphans"],
        "goodput": goodput is not None and goodput >= TARGETS["goodput_min"],
        "steps": steps == [args.steps],
    }
    return out


def chaos_spec(args: argparse.Namespace) -> str:
    spec = f"every={args.every:g},signal=MIX,stop_for={args.stop_for:g},seed={args.seed}"
    if args.lighthouse_at is not None:
        spec += f",lighthouse={args.lighthouse_at:g},lighthouse_down={args.lighthouse_down:g}"
    return spec


def print_report(r: dict) -> None:
    def fmt(v: object) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    print("soak report (scripts/soak.py, through the ftlaunch command)")
    for key in (
        "groups",
        "spares",
        "cpus",
        "load_avg_baseline",
        "load_avg_chaos",
        "steps_target",
        "chaos",
        "exit_code",
        "committed_steps",
        "committed_group_steps",
        "injections_total",
        "injections",
        "lighthouse_restarts",
        "quorum_changes",
        "baseline_quorum_changes",
        "crashes",
        "tracebacks_in_output",
        "divergent_groups",
        "groups_stopped_after_the_end",
        "final_checksums",
        "training_time_s",
        "baseline_training_time_s",
        "goodput",
        "longest_survivor_stall_s",
        "baseline_longest_stall_s",
        "orphans",
        "log_bytes",
        "baseline_log_bytes",
        "wall_s",
    ):
        print(f"  {key:28s} {fmt(r[key])}")
    print(f"  {'targets':28s} 0 crashes, 0 divergence, 0 orphans, goodput >= {TARGETS['goodput_min']:.0%}")
    print(f"  {'met':28s} {r['met']}")
    for line in r["error_exits"][:10]:
        print(f"  error exit: {line}")
    if r["breakdown"] is not None:
        print_breakdown(r["breakdown"])


#: The label (and ``--keep-output`` suffix) of the long-outage run.
LONG = "chaos_long"


def long_outage_args(args: argparse.Namespace) -> argparse.Namespace | None:
    """The arguments of the long-outage run (None: not wanted, or no lighthouse crash at all)."""
    if not args.long_outage or args.lighthouse_at is None or args.long_outage == args.lighthouse_down:
        return None
    return argparse.Namespace(**{**vars(args), "lighthouse_down": args.long_outage})


def print_long_outage(r: dict, r_long: dict) -> None:
    """The long-outage run's report, then both goodputs side by side (neither is shown alone)."""
    print()
    print(
        f"--- variant: the lighthouse kept down {r_long['chaos'].rsplit('lighthouse_down=', 1)[-1]} s "
        "(longer than the workers' connect timeout; faults inside it wait for the lighthouse) ---"
    )
    print_report(r_long)
    print()

    def pct(v: object) -> str:
        return f"{v:.1%}" if isinstance(v, float) else "n/a"

    print(
        f"soak goodput: {pct(r['goodput'])} with the launcher's own lighthouse restart (target >= "
        f"{TARGETS['goodput_min']:.0%}); {pct(r_long['goodput'])} with the long outage "
        f"(lighthouse_down={r_long['chaos'].rsplit('lighthouse_down=', 1)[-1]})"
    )


def read_kept(path: str) -> Run:
    """One run back from its ``--keep-output`` files (the time-stamped output, the phase log)."""
    run = Run(code=0)
    with open(path, errors="replace") as f:
        for raw in f:
            stamp, _, line = raw.lstrip().partition(" ")
            try:
                parse_line(run, line, float(stamp), False)
            except ValueError:
                continue
    kept = Path(f"{path}.phases")
    if kept.exists():
        run.phases = [json.loads(line) for line in kept.read_text().splitlines() if line.strip()]
    m = re.search(r"summary: exit (\d+)", Path(path).read_text(errors="replace"))
    run.code = int(m.group(1)) if m else -1
    return run


def reanalyze(args: argparse.Namespace) -> int:
    """The report of a kept run (``--keep-output PREFIX``) from its time-stamped output."""
    runs = [read_kept(f"{args.reanalyze}.{label}") for label in ("baseline", "chaos")]
    r = report(args, runs[1], runs[0])
    print_report(r)
    long_args = long_outage_args(args)
    if long_args is not None and Path(f"{args.reanalyze}.{LONG}").exists():
        print_long_outage(r, report(long_args, read_kept(f"{args.reanalyze}.{LONG}"), runs[0]))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--every", type=float, default=5.0, help="seconds between injections")
    p.add_argument("--stop-for", type=float, default=3.0, help="seconds a SIGSTOPped group stays stopped")
    p.add_argument(
        "--lighthouse-at",
        type=float,
        default=60.0,
        help="crash the hosted lighthouse this long into training (negative: never)",
    )
    p.add_argument(
        "--lighthouse-down",
        type=float,
        default=LIGHTHOUSE_CHECK_S,
        help="seconds before the launcher restarts it (default: the supervisor's check interval, "
        "what the launcher does when its lighthouse dies)",
    )
    p.add_argument(
        "--long-outage",
        type=float,
        default=12.0,
        metavar="SECONDS",
        help="also run the chaos with the lighthouse kept down this long, reported beside (0: skip)",
    )
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument(
        "--spares",
        type=int,
        default=0,
        help="hot spares (ftlaunch --spares K) in both runs: a failed group's slot is taken over by a spare",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--ftlaunch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more ftlaunch option for both runs, e.g. --ftlaunch-arg=--heartbeat-timeout=1 (repeatable)",
    )
    p.add_argument("--max-seconds", type=float, default=3000.0, help="give up after this long per run")
    p.add_argument("--no-baseline", action="store_true", help="skip the fault-free run (no goodput)")
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument("--verbose", action="store_true", help="echo the launcher's own lines")
    p.add_argument(
        "--keep-output",
        default=None,
        metavar="PREFIX",
        help="write each run's whole output, time-stamped, to PREFIX.baseline / PREFIX.chaos "
        "(and its phase log to PREFIX.<run>.phases)",
    )
    p.add_argument(
        "--reanalyze",
        default=None,
        metavar="PREFIX",
        help="no runs: report again from the output (and phase log) a --keep-output PREFIX run kept",
    )
    args = p.parse_args(argv)
    if args.reanalyze:
        return reanalyze(args)
    if args.lighthouse_at is not None and args.lighthouse_at < 0:
        args.lighthouse_at = None
    baseline = None if args.no_baseline else run_ftlaunch(args, None, "baseline")
    if baseline is not None and baseline.code != 0:
        print(f"soak: the fault-free run failed (exit {baseline.code}):\n{baseline.tail}", file=sys.stderr)
        return 1
    chaos_run = run_ftlaunch(args, chaos_spec(args), "chaos")
    r = report(args, chaos_run, baseline)
    print_report(r)
    out = {**r, "tail": chaos_run.tail}
    ok = all(r["met"].values())
    if chaos_run.code != 0:
        print(
            f"soak: the chaos run failed (exit {chaos_run.code}); its last lines:\n{chaos_run.tail}",
            file=sys.stderr,
        )
    long_args = long_outage_args(args)
    if long_args is not None:
        long_run = run_ftlaunch(long_args, chaos_spec(long_args), LONG)
        r_long = report(long_args, long_run, baseline)
        print_long_outage(r, r_long)
        out["long_outage"] = {**r_long, "tail": long_run.tail}
        ok = ok and all(v for k, v in r_long["met"].items() if k != "goodput")
        if long_run.code != 0:
            print(
                f"soak: the long-outage run failed (exit {long_run.code}); its last lines:\n{long_run.tail}",
                file=sys.stderr,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
