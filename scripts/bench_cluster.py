#!/usr/bin/env python3
"""Recovery on a Slurm cluster beside the same on one host, measured in the same run.

A real Slurm cluster of five nodes on this machine (`slurm_cluster.py`: one ``slurmd`` per
network namespace) runs torchx's ``ftlaunch:ddp`` (one-node groups) and ``ftlaunch:hsdp
--nnodes_per_replica 2`` (two-node groups) with two replica groups; group 1's worker is SIGKILLed
mid-training. The same jobs run on this machine with ``torchx run -s local_cwd``, interleaved with
the cluster runs. For each, from the kill:

* **first commit**: kill -> the restarted group's first committed step (it healed);
* **longest gap**: the survivor's (group 0) longest wait between two committed steps, from its last
  commit before the kill until 3 s after the restarted group's first commit;
* the restarted worker's start-up phases (``FTLAUNCH_PHASE_LOG``, `ftlaunch.phases`).

Then a lost node (its link down, every process killed, slurmd too), cluster only:

* **job array** (docs/launcher.md, *Lost nodes on Slurm*: one array task per group, README's way 2
  in each, the lighthouse on a node of its own): the survivor's longest gap, kill -> Slurm requeued
  the lost group's task, -> it runs again (on another node), -> its first committed step;
* **torchx's job**: kill -> Slurm ends and requeues the whole job (the survivor's last commit before).

The cluster declares a node down after ``SlurmdTimeout`` = 10 s and starts a requeued job after
``cred_expire`` = 10 s (Slurm's defaults: 300 s and 120 s; the lost-node figures move with them).
Training: ``scripts/train_ddp.py``, width 32, 0.05 s per step. Needs root (namespaces); a 2-core
machine shared with other jobs: the load average is printed with the figures.

Usage: sudo python scripts/bench_cluster.py [--runs 2] [--skip-lost-node] [--skip-one-host]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cluster_jobs as jobs  # noqa: E402
from slurm_cluster import Cluster, missing_capability, node_name  # noqa: E402

from ftlaunch import phases  # noqa: E402

TRAIN_ARGS = ["--steps", "1000000", "--width", "32", "--step-sleep", "0.05", "--timeout", "30"]
#: Commits of group 1 before the kill (the job is past its start-up).
WARM_COMMITS = 20
#: Phases of the restarted worker, in order (those present are printed).
PHASES = ("worker_exit_seen", "rendezvous_done", "init", "manager_up", "ready", "quorum", "configured",
          "healed", "first_commit")  # fmt: skip
COMPONENTS = {
    "one-node": ["ftlaunch:ddp", "--replicas", "2"],
    "two-node": ["ftlaunch:hsdp", "--replicas", "2", "--nnodes_per_replica", "2"],
}


def _episode_figures(survivor: str, victim: str, killed_at: float) -> dict[str, float]:
    first = jobs.first_commit_after(victim, killed_at)
    end = killed_at + (first if first is not None else 0.0) + 3.0
    gap = jobs.longest_gap(survivor, killed_at, until=end)
    return {
        "first": first if first is not None else float("inf"),
        "gap": gap if gap is not None else float("inf"),
    }


def _phases_after(log: Path, killed_at: float, group: str = "1") -> dict[str, float]:
    recs = phases.read(log)
    new_pids = {
        r["pid"] for r in recs if r["phase"] == "init" and r.get("replica") == group and r["t"] > killed_at
    }
    seen: dict[str, float] = {}
    for r in recs:
        if r["t"] < killed_at or r["phase"] in seen:
            continue
        agent_side = r["phase"] in ("worker_exit_seen", "rendezvous_start", "rendezvous_done")
        if (agent_side and r.get("replica") == group) or r["pid"] in new_pids:
            seen[r["phase"]] = r["t"] - killed_at
    return seen


def _wait_victim_back(text_of, killed_at: float, timeout: float) -> None:
    jobs.wait_until(
        lambda: jobs.first_commit_after(text_of(), killed_at) is not None, timeout, "the restarted group"
    )
    time.sleep(3.5)  # the survivor's window runs 3 s past it


def cluster_episode(c: Cluster, kind: str, tmp: Path) -> dict:
    cwd = tmp / f"{kind}-{time.monotonic_ns()}"
    cwd.mkdir()
    log = cwd / "phases.jsonl"
    env = {**c.env, "FTLAUNCH_PHASE_LOG": str(log)}
    job = jobs.submit_torchx(
        [*COMPONENTS[kind], "--script", jobs.TRAIN, "--", *TRAIN_ARGS], cwd=str(cwd), env=env
    )
    replicas = 2 if kind == "two-node" else 1

    def text(role: str) -> str:
        return "".join(jobs.read(cwd / f"slurm-{job}-{role}-{r}.out") for r in range(replicas))

    try:
        jobs.wait_until(lambda: len(jobs.commits(text("rg1"))) >= WARM_COMMITS, 400, f"{kind} job to train")
        rank = "1" if kind == "two-node" else "0"
        (worker,) = jobs.find_workers("train_ddp.py", c.node_pids, REPLICA_GROUP_ID="1", RANK=rank)
        killed_at = jobs.kill(worker)
        _wait_victim_back(lambda: text("rg1"), killed_at, 300)
    finally:
        c.slurm("scancel", job, check=False)
        jobs.wait_job_gone(c.env, job, 120)
    return {**_episode_figures(text("rg0"), text("rg1"), killed_at), "phases": _phases_after(log, killed_at)}


def _stop_tree(proc: subprocess.Popen[bytes]) -> None:
    """End ``torchx run -s local_cwd`` and everything it started (SIGTERM, then SIGKILL)."""
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=20)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    proc.wait()


def local_episode(kind: str, tmp: Path) -> dict:
    cwd = tmp / f"local-{kind}-{time.monotonic_ns()}"
    cwd.mkdir()
    log = cwd / "phases.jsonl"
    env = {**os.environ, "FTLAUNCH_PHASE_LOG": str(log), "PYTHONPATH": jobs.REPO}
    argv = ["torchx", "run", "-s", "local_cwd", "-cfg", f"log_dir={cwd / 'logs'}", *COMPONENTS[kind]]
    argv += ["--script", jobs.TRAIN, "--", *TRAIN_ARGS]
    proc = subprocess.Popen(argv, cwd=jobs.REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip

    def text(role: str) -> str:
        return "".join(
            jobs.read(p)
            for p in sorted(glob.glob(str(cwd / "logs" / "**" / role / "*" / "stdout.log"), recursive=True))
        )

    def tree() -> dict[int | None, list[int]]:
        try:
            return {None: [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]}
        except psutil.NoSuchProcess:
            return {None: []}

    try:
        jobs.wait_until(
            lambda: len(jobs.commits(text("rg1"))) >= WARM_COMMITS, 400, f"local {kind} job to train"
        )
        rank = "1" if kind == "two-node" else "0"
        (worker,) = jobs.find_workers("train_ddp.py", tree, REPLICA_GROUP_ID="1", RANK=rank)
        killed_at = jobs.kill(worker)
        _wait_victim_back(lambda: text("rg1"), killed_at, 300)
    finally:
        _stop_tree(proc)
    return {**_episode_figures(text("rg0"), text("rg1"), killed_at), "phases": _phases_after(log, killed_at)}


def lost_node_array(c: Cluster, tmp: Path) -> dict:
    """docs/launcher.md's job-array recipe on nodes 2..4, the lighthouse on node 1; group 1's node lost."""
    cwd = tmp / f"array-{time.monotonic_ns()}"
    cwd.mkdir()
    (cwd / "train.sbatch").write_text(jobs.docs_array_script(TRAIN_ARGS))
    env = {**c.env, "FTLAUNCH_TOKEN": "bench-array", "LIGHTHOUSE": f"{node_name(1)}:29513"}
    lh = jobs.start_lighthouse(c, 1, 29513, env, cwd / "lighthouse.log")
    job = ""
    try:
        job = jobs.sbatch(cwd / "train.sbatch", env)
        logs = [cwd / f"train-{g}.out" for g in range(2)]
        jobs.wait_until(
            lambda: len(jobs.commits(jobs.read(logs[1]))) >= WARM_COMMITS, 400, "the array to train"
        )
        (worker,) = jobs.find_workers("train_ddp.py", c.node_pids, REPLICA_GROUP_ID="1")
        assert worker.node is not None
        lost = worker.node
        killed_at = time.time()
        c.kill_node(lost)
        requeued_at = running_at = None
        while jobs.first_commit_after(jobs.read(logs[1]), killed_at) is None:
            states = {jid: (st, nodes) for jid, st, nodes in jobs.squeue(c.env, job)}
            st = states.get(f"{job}_1", ("", ""))
            if requeued_at is None and st[0] == "PENDING":
                requeued_at = time.time()
            if requeued_at is not None and running_at is None and st[0] == "RUNNING":
                running_at = time.time()
            if time.time() - killed_at > 400:
                raise jobs.JobError("the lost group never came back")
            time.sleep(0.2)
        time.sleep(3.5)
        figures = _episode_figures(jobs.read(logs[0]), jobs.read(logs[1]), killed_at)
    finally:
        if job:
            c.slurm("scancel", job, check=False)
            jobs.wait_job_gone(c.env, job, 120)
        lh.kill()
        lh.wait()
    c.restart_node(lost)
    return {
        **figures,
        "requeued": (requeued_at or float("inf")) - killed_at,
        "running": (running_at or float("inf")) - killed_at,
    }


def lost_node_torchx(c: Cluster, tmp: Path) -> dict:
    """torchx's ``ftlaunch:ddp`` job; group 1's node lost: kill -> Slurm requeued the whole job."""
    cwd = tmp / f"torchx-lost-{time.monotonic_ns()}"
    cwd.mkdir()
    job = jobs.submit_torchx(
        [*COMPONENTS["one-node"], "--script", jobs.TRAIN, "--", *TRAIN_ARGS], cwd=str(cwd), env=c.env
    )
    try:
        jobs.wait_until(lambda: len(jobs.commits(jobs.read(cwd / f"slurm-{job}-rg1-0.out"))) >= WARM_COMMITS,
                        400,
                        "the torchx job to train")  # fmt: skip
        (worker,) = jobs.find_workers("train_ddp.py", c.node_pids, REPLICA_GROUP_ID="1")
        assert worker.node is not None
        lost = worker.node
        killed_at = time.time()
        c.kill_node(lost)
        jobs.wait_until(
            lambda: any(st == "PENDING" for _, st, _ in jobs.squeue(c.env, job)), 300, "the requeue"
        )
        requeued = time.time() - killed_at
    finally:
        c.slurm("scancel", job, check=False)
        jobs.wait_job_gone(c.env, job, 120)
    survivor = jobs.commits(jobs.read(cwd / f"slurm-{job}-rg0-0.out"))
    last = max((t for _, t in survivor if t > killed_at), default=killed_at) - killed_at
    c.restart_node(lost)
    return {"requeued": requeued, "survivor_trained": last}


def _fmt(values: list[float]) -> str:
    finite = [v for v in values if v != float("inf")]
    if not finite:
        return "none"
    runs = " / ".join(f"{v:.2f}" for v in values)
    return f"{statistics.median(finite):.2f} s (runs: {runs})"


def _phase_line(runs: list[dict]) -> str:
    out = []
    for p in PHASES:
        vals = [r["phases"][p] for r in runs if p in r["phases"]]
        if vals:
            out.append(f"{p} {statistics.median(vals):.2f}")
    return ", ".join(out) or "no phase log"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2, help="episodes of each kind and place (median printed)")
    ap.add_argument("--skip-lost-node", action="store_true", help="only the killed-worker figures")
    ap.add_argument("--skip-one-host", action="store_true", help="only the cluster (no local_cwd baseline)")
    args = ap.parse_args()
    why = missing_capability()
    if why:
        print(f"bench_cluster: a Slurm cluster in namespaces {why}", file=sys.stderr)
        return 2
    results: dict[tuple[str, str], list[dict]] = {}
    lost: dict[str, list[dict]] = {"array": [], "torchx": []}
    loads = []
    with tempfile.TemporaryDirectory(prefix="ftlaunch-bench-cluster-") as d:
        tmp = Path(d)
        c = Cluster(nodes=5, root="/tmp/ftlaunch-slurm-bench", prefix="ftslb", subnet="10.233.0",
                    ctld_port=6837,
                    extra_env={"PYTHONPATH": jobs.REPO})  # fmt: skip
        with c:
            for run in range(args.runs):
                for kind in COMPONENTS:
                    places = ["cluster"] + ([] if args.skip_one_host else ["one host"])
                    for place in places if run % 2 == 0 else places[::-1]:  # interleaved
                        loads.append(os.getloadavg()[0])
                        r = cluster_episode(c, kind, tmp) if place == "cluster" else local_episode(kind, tmp)
                        results.setdefault((kind, place), []).append(r)
                        print(f"  {kind:8} {place:8} first commit {r['first']:.2f} s, longest gap "
                              f"{r['gap']:.2f} s",
                              flush=True)  # fmt: skip
                if not args.skip_lost_node:
                    loads.append(os.getloadavg()[0])
                    lost["torchx"].append(lost_node_torchx(c, tmp))
                    print("  lost node, torchx job: requeued whole after "
                          f"{lost['torchx'][-1]['requeued']:.1f} s",
                          flush=True)  # fmt: skip
            if not args.skip_lost_node:
                c.drain(1, "lighthouse")
                for _ in range(args.runs):
                    loads.append(os.getloadavg()[0])
                    lost["array"].append(lost_node_array(c, tmp))
                    a = lost["array"][-1]
                    print(f"  lost node, job array: back after {a['first']:.1f} s, survivor's gap "
                          f"{a['gap']:.2f} s",
                          flush=True)  # fmt: skip
    print("\nKill -> recovery, 2 replica groups, train_ddp.py width 32 (load average "
          f"{min(loads):.1f}-{max(loads):.1f}, "
          f"2-core machine shared with other jobs):")  # fmt: skip
    print(
        "| group | where | kill -> its first commit | survivor's longest gap | restarted worker's "
        "phases (s after the kill) |"
    )
    print("|---|---|---|---|---|")
    for (kind, place), runs in results.items():
        print(f"| {kind} | {place} | {_fmt([r['first'] for r in runs])} | {_fmt([r['gap'] for r in runs])} | "
              f"{_phase_line(runs)} |")  # fmt: skip
    if not args.skip_lost_node:
        arr, whole = lost["array"], lost["torchx"]
        print("\nA lost node (SlurmdTimeout 10 s, cred_expire 10 s):")
        print(
            "| job shape | survivor's longest gap | kill -> Slurm requeues | -> runs again | -> "
            "first commit |"
        )
        print("|---|---|---|---|---|")
        print(f"| job array (one task per group) | {_fmt([r['gap'] for r in arr])} | "
              f"{_fmt([r['requeued'] for r in arr])} | "
              f"{_fmt([r['running'] for r in arr])} | {_fmt([r['first'] for r in arr])} |")  # fmt: skip
        print(
            "| torchx's job | trains alone until the requeue "
            f"({_fmt([r['survivor_trained'] for r in whole])}) | "
            f"{_fmt([r['requeued'] for r in whole])}, the whole job | from the start | from step 0 |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
