"""Running ftlaunch jobs on a `slurm_cluster.Cluster` (or on this machine) and reading what they did.

Shared by the cluster tests (tests/processes/test_cluster.py) and the cluster figures
(scripts/bench_cluster.py): submit a torchx component, find a worker's process and node, kill it,
wait for the job's end, and read the committed steps ``scripts/train_ddp.py`` prints (each with
its wall-clock time, ``t=``) to tell when a group committed again and how long the others waited.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

REPO = str(Path(__file__).resolve().parent.parent)
TRAIN = os.path.join(REPO, "scripts", "train_ddp.py")
DOCS = Path(REPO, "docs", "launcher.md")

#: What ``torchx run -s slurm`` of torchx-nightly prints after it submitted the job on Slurm 22.05:
#: its status query right after the submission reads ``job_resources``, which 22.05's JSON lacks
#: for a pending job. The job is submitted and runs; only torchx's own status line fails.
TORCHX_22_05_STATUS_ERROR = "KeyError: 'job_resources'"

_COMMIT = re.compile(r"step=(\d+) committed=True .*? t=([\d.]+)")
_FINAL = re.compile(r"final_checksum=(\w+) step=(\d+)")


class JobError(AssertionError):
    """A job did not do what was expected (the message carries the logs' tails)."""


def commits(text: str) -> list[tuple[int, float]]:
    """``(step, wall time)`` of every committed step ``train_ddp.py`` printed."""
    return [(int(s), float(t)) for s, t in _COMMIT.findall(text)]


def finals(text: str) -> list[tuple[str, int]]:
    """``(checksum, step)`` of every worker of ``train_ddp.py`` that finished."""
    return [(c, int(s)) for c, s in _FINAL.findall(text)]


def first_commit_after(text: str, t0: float) -> float | None:
    """Seconds from ``t0`` to the first step committed after it (None: none was)."""
    after = [t for _, t in commits(text) if t > t0]
    return min(after) - t0 if after else None


def longest_gap(text: str, t0: float, until: float | None = None) -> float | None:
    """The longest wait between two commits around ``t0``: from the last commit before it, over
    the commits up to ``until`` (None: all). None when nothing was committed after ``t0``."""
    times = sorted(t for _, t in commits(text))
    before = [t for t in times if t <= t0]
    after = [t for t in times if t > t0 and (until is None or t <= until)]
    if not after:
        return None
    seq = ([before[-1]] if before else [t0]) + after
    return max(b - a for a, b in zip(seq, seq[1:], strict=False))


def submit_torchx(args: Sequence[str], *, cwd: str, env: dict[str, str], timeout: float = 120) -> str:
    """``torchx run -s slurm ARGS`` in ``cwd``; returns the Slurm job id.

    Accepts torchx-nightly's failing status query on Slurm 22.05 (`TORCHX_22_05_STATUS_ERROR`),
    and nothing else: docs/launcher.md, *torchx versions*, says why and what to use instead.
    """
    done = subprocess.run(
        ["torchx", "run", "-s", "slurm", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    found = re.search(r"slurm://[^/\s]*/(\d+)", done.stdout)
    if found is None or (done.returncode != 0 and TORCHX_22_05_STATUS_ERROR not in done.stderr):
        raise JobError(f"torchx run failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}")
    return found.group(1)


def docs_array_script(train_args: Sequence[str]) -> str:
    """docs/launcher.md's job-array script (*Lost nodes on Slurm*) as written there, with one worker
    per group running ``train_ddp.py train_args`` in place of ``train.py`` on 8 workers."""
    body = DOCS.read_text().split("```bash\n#!/bin/bash\n", 1)[1].split("```", 1)[0]
    body = body.replace("train.py", " ".join([TRAIN, *train_args])).replace(
        "--nproc-per-node 8", "--nproc-per-node 1"
    )
    return "#!/bin/bash\n" + body


def start_lighthouse(
    cluster: Any, node: int, port: int, env: dict[str, str], log: Path, expected: int = 2
) -> subprocess.Popen[bytes]:
    """``ftlaunch-lighthouse`` on all interfaces of ``cluster``'s node ``node`` (a
    `slurm_cluster.Cluster`), its output in ``log``; ``env`` carries the job token."""
    argv = ["ftlaunch-lighthouse", "--bind", f"0.0.0.0:{port}", "--expected-replicas", str(expected)]
    with open(log, "wb") as out:
        return cluster.popen(node, argv, env=env, stdout=out, stderr=out)  # type: ignore[no-any-return]


def sbatch(script: Path, env: dict[str, str]) -> str:
    """``sbatch`` ``script`` from its directory; returns the job id."""
    done = subprocess.run(
        ["sbatch", "--parsable", script.name], cwd=script.parent, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise JobError(f"sbatch {script}: {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]


def squeue(env: dict[str, str], job: str | None = None) -> list[tuple[str, str, str]]:
    """``(job id, state, nodes)`` of the queued and running jobs (of ``job`` only, when given)."""
    cmd = ["squeue", "-h", "-o", "%i %T %N"] + (["-j", job] if job else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    out = []
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            out.append((parts[0], parts[1], parts[2] if len(parts) > 2 else ""))
    return out


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise JobError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def wait_job_gone(env: dict[str, str], job: str, timeout: float) -> None:
    """Wait until Slurm lists nothing of ``job`` any more (finished, failed or cancelled)."""
    wait_until(lambda: not squeue(env, job), timeout, f"job {job} to end", interval=1.0)


@dataclass(frozen=True)
class Worker:
    pid: int
    #: The cluster node it runs on (None: this machine's own network).
    node: int | None


def find_workers(
    script: str, where: Callable[[], dict[int | None, list[int]]], **env_match: str
) -> list[Worker]:
    """Processes running ``script`` (not their torchrun agent) whose environment has every
    ``env_match`` value; ``where()`` maps each node (None: this machine) to its pids."""
    found = []
    for node, pids in where().items():
        for pid in pids:
            try:
                p = psutil.Process(pid)
                cmd = p.cmdline()
                if not any(c.endswith(script) for c in cmd) or "torch.distributed.run" in cmd:
                    continue
                if any(c.endswith(("torchrun", "group_role")) for c in cmd[:3]):
                    continue
                e = p.environ()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if all(e.get(k) == v for k, v in env_match.items()):
                found.append(Worker(pid, node))
    return found


def kill(worker: Worker) -> float:
    """SIGKILL ``worker``; returns the wall-clock time of the kill."""
    t = time.time()
    os.kill(worker.pid, signal.SIGKILL)
    return t


def read(path: str | Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""
