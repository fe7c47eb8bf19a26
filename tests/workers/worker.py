"""A stand-in training script for launcher tests (no torch import unless asked).

Prints ``step=N committed=True`` lines like scripts/train_ddp.py, records its environment, and fails
on command (exit code, exception, or hanging) at a given step of a given restart. Like a Manager's
group leader, rank 0 reports its progress to the lighthouse (the launcher's summary reads it there,
not from these lines): every step, and at a clean exit a final report with ``--checksum``. A
restarted incarnation reports that it healed (as a real group would, from a peer; it does not
train, so it has nothing to get wrong), unless ``--no-heal``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="", help="directory for one env record per worker incarnation")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--fail-group", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument(
        "--fail-restarts", default="0", help="restart counts (comma list) on which to fail; 'all' = every"
    )
    p.add_argument(
        "--fail-once",
        action="store_true",
        help="fail only the first time in the job (a marker file in --out), whatever the restart count",
    )
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--raise-error", action="store_true", help="fail by raising ValueError instead of exiting")
    p.add_argument("--check-torch", action="store_true")
    p.add_argument("--checksum", default="", help="print final_checksum=<this> at the end")
    p.add_argument("--probe-lighthouse", action="store_true", help="record the lighthouse's status address")
    p.add_argument(
        "--heartbeat", action="store_true", help="rank 0 heartbeats to the lighthouse as rg<group>"
    )
    p.add_argument("--wait-records", type=int, default=0, help="before exiting, wait for this many records")
    p.add_argument("--no-heal", action="store_true", help="a restarted incarnation does not claim it healed")
    p.add_argument("--no-progress", action="store_true", help="report nothing to the lighthouse")
    args = p.parse_args()

    group = int(os.environ.get("REPLICA_GROUP_ID", "-1"))
    rank = int(os.environ.get("RANK", "-1"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.out:
        # The pid torchelastic (and chaos) know this worker by: its proxy when it was forked from
        # the warm standby (ftlaunch.bootstrap.zygote), else its own.
        record = {"pid": int(os.environ.get("FTLAUNCH_WORKER_PID") or os.getpid()), "env": dict(os.environ)}
        if args.check_torch:
            import torch.distributed as dist

            record["is_torchelastic_launched"] = dist.is_torchelastic_launched()
        if args.probe_lighthouse:
            from ftlaunch.lighthouse.client import LighthouseClient

            token = os.environ.get("FTLAUNCH_TOKEN")
            with LighthouseClient(
                os.environ["FTLAUNCH_LIGHTHOUSE"], connect_timeout=10, token=token
            ) as client:
                record["lighthouse_status_address"] = client.status()["address"]
                # A request that needs the job token and changes nothing: the launch path handed it over.
                client.leave("probe-of-no-group")
                record["lighthouse_token_accepted"] = True
        path = os.path.join(args.out, f"rg{group}_r{rank}_restart{restart}_pid{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)

    beat = shared = None
    if args.heartbeat and rank == 0:
        from ftlaunch.lighthouse.client import LighthouseClient

        # One client per process: the lighthouse holds a replica id for one incarnation (client) at a time.
        shared = LighthouseClient(os.environ["FTLAUNCH_LIGHTHOUSE"], token=os.environ.get("FTLAUNCH_TOKEN"))
        beat = shared.start_heartbeat(f"rg{group}", 0.2)
    reporter = None
    if rank == 0 and not args.no_progress and os.environ.get("FTLAUNCH_LIGHTHOUSE"):
        from ftlaunch.lighthouse.client import LighthouseClient
        from ftlaunch.lighthouse.progress import ProgressReport

        if shared is None:
            reporter = LighthouseClient(
                os.environ["FTLAUNCH_LIGHTHOUSE"], connect_timeout=10, token=os.environ.get("FTLAUNCH_TOKEN")
            )
            # Like a Manager's leader: a heartbeat connection bound to the id, so the lighthouse sees
            # this process die at once and its restart may take the id (one incarnation at a time).
            reporter.start_heartbeat(f"rg{group}", 0.5)
        else:
            reporter = shared
        session = f"worker-{os.getpid()}"
        # A restart (torchelastic's, or a respawned agent's: the lighthouse knows the group already).
        again = restart > 0 or reporter.snapshot().group_progress(f"rg{group}") is not None
        heals = 1 if again and not args.no_heal else 0

        if not again:
            # Like a Manager's first quorum, which waits for the groups the launcher announced: start
            # stepping once every group's leader is known, or the first group could finish before a
            # slow-starting peer reported a step (and the summary would rightly call that peer unsynced).
            reporter.report_progress(f"rg{group}", ProgressReport(session, step=0, commits=0))
            groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
            deadline = time.monotonic() + 60
            while len(reporter.snapshot().progress) < groups and time.monotonic() < deadline:
                time.sleep(0.02)

        def report(step: int, **final: object) -> None:
            # Manager semantics: ``step`` is the group's step after the commit (steps done).
            reporter.report_progress(
                f"rg{group}", ProgressReport(session, step=step, commits=step, heals=heals, **final)
            )  # type: ignore[arg-type]

    fail_here = (
        group == args.fail_group
        and rank == args.fail_rank
        and (args.fail_restarts == "all" or str(restart) in args.fail_restarts.split(","))
    )
    for step in range(args.steps):
        if fail_here and step == args.fail_step and args.fail_once:
            try:
                os.close(os.open(os.path.join(args.out, f"failed-rg{group}"), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                fail_here = False
        if fail_here and step == args.fail_step:
            print(f"worker rg{group}/r{rank} failing on purpose at step {step}", file=sys.stderr, flush=True)
            if args.raise_error:
                raise ValueError(f"injected failure in rg{group}/r{rank} at step {step}")
            return args.exit_code
        print(f"step={step} committed=True participants=1", flush=True)
        if reporter is not None:
            report(step + 1)
        time.sleep(args.step_time)
    deadline = time.monotonic() + 60
    while args.out and len(glob.glob(os.path.join(args.out, "*.json"))) < args.wait_records:
        if time.monotonic() > deadline:
            return 4
        time.sleep(0.05)
    if beat is not None:
        beat.stop()
    if args.checksum:
        print(f"final_checksum={args.checksum} step={args.steps}", flush=True)
    if reporter is not None:  # the final report rides on the leave, as the Manager's does
        reporter.set_progress(
            f"rg{group}",
            ProgressReport(
                session,
                step=args.steps,
                commits=args.steps,
                heals=heals,
                checksum=args.checksum,
                finished=True,
            ),
        )
        reporter.leave(f"rg{group}")
        reporter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
