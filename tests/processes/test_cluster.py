"""ftlaunch on a real Slurm cluster: N nodes, each a network namespace with its own address and host
name, started and torn down by scripts/slurm_cluster.py (Debian's slurm-wlm and munge, installed with
apt-get when missing). Real jobs, real kills: torchx's components on Slurm, README's way 2 across
hosts, hot spares across hosts, a lighthouse on a node of its own, a lost node.

One representative test runs in CI (torchx's ``ftlaunch:ddp`` across three nodes, a worker killed);
the others are ``slow`` (``bash scripts/test_cluster.sh`` runs them all). Every test tears its
cluster down, also when it fails: no daemon, namespace, link or job process is left.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import cluster_jobs as jobs  # noqa: E402
from slurm_cluster import Cluster, missing_capability, node_name  # noqa: E402

REPO = jobs.REPO
#: A small, slow-stepping training: the kills land mid-training on a loaded 2-core machine.
TRAIN_ARGS = ["--width", "32", "--timeout", "30"]
#: Steps of a run with a kill, at ``STEP_SLEEP`` s each: the survivors train on for about a minute
#: after the kill, longer than a restarted worker takes to import torch on a loaded machine.
STEPS, STEP_SLEEP = 150, "0.4"

_WHY_NOT = missing_capability()
needs_cluster = pytest.mark.skipif(_WHY_NOT is not None, reason=f"a Slurm cluster in namespaces {_WHY_NOT}")


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator:
    """``make_cluster(n)`` starts an n-node cluster; it is torn down after the test, pass or fail."""
    started: list[Cluster] = []

    def make(nodes: int) -> Cluster:
        path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
        c = Cluster(
            nodes=nodes,
            root="/tmp/ftlaunch-slurm-test",
            prefix="ftslt",
            extra_env={"PYTHONPATH": path},
            subnet="10.232.0",  # not the default cluster's: one may run beside the tests
            ctld_port=6827,
        )
        started.append(c)
        c.up()
        return c

    yield make
    for c in started:
        c.down(remove_dir=True)
        assert not c.leftovers(), c.leftovers()


def _logs(cwd: Path, job: str, role: str, replicas: int = 1) -> str:
    return "".join(
        jobs.read(cwd / f"slurm-{job}-{role}-{r}.{ext}") for r in range(replicas) for ext in ("out", "err")
    )


def _tails(cwd: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(cwd.glob("slurm-*"))
    )


def _wait_commits(text_of, count: int, timeout: float, what: str) -> None:
    jobs.wait_until(lambda: len(jobs.commits(text_of())) >= count, timeout, what)


def _kill_worker(c: Cluster, group: int, rank: int = 0) -> tuple[float, int | None]:
    found = jobs.find_workers("train_ddp.py", c.node_pids, REPLICA_GROUP_ID=str(group), RANK=str(rank))
    assert len(found) == 1, found
    return jobs.kill(found[0]), found[0].node


def _processes_left(c: Cluster) -> list[int]:
    return c.job_pids()


# ------------------------------------------------------------------------------------------ CI
@needs_cluster
@pytest.mark.timeout(420)
def test_torchx_ddp_across_nodes_heals_a_killed_worker(make_cluster, tmp_path: Path) -> None:
    """``torchx run -s slurm ftlaunch:ddp --replicas 2``: the lighthouse and the two groups on three
    nodes. Every group publishes its node's address (not loopback), they train together, a worker
    SIGKILLed on one node is restarted by its agent and heals from the other node; both end equal."""
    c = make_cluster(3)
    steps = STEPS
    job = jobs.submit_torchx(
        ["ftlaunch:ddp", "--replicas", "2", "--script", jobs.TRAIN, "--", "--steps", str(steps),
         "--step-sleep", STEP_SLEEP, *TRAIN_ARGS],
        cwd=str(tmp_path), env=c.env,
    )  # fmt: skip
    try:
        _wait_commits(lambda: _logs(tmp_path, job, "rg1"), 5, 240, "rg1 to commit 5 steps")
        killed_at, node = _kill_worker(c, group=1)
        jobs.wait_job_gone(c.env, job, 240)
    except BaseException:
        print(_tails(tmp_path))
        raise
    rg0, rg1 = _logs(tmp_path, job, "rg0"), _logs(tmp_path, job, "rg1")
    # Each group's store was published under its own node's address, on another node than rg1's.
    stores = set(re.findall(r"manager up: group world_size=\d+ store=([\d.]+):", rg0 + rg1))
    assert stores and all(s.startswith("10.232.0.") for s in stores), stores
    assert node is not None and c.ip(node) in stores
    # The killed group came back and committed again; both groups ended with the same weights.
    assert jobs.first_commit_after(rg1, killed_at) is not None, _tails(tmp_path)
    ends = jobs.finals(rg0) + jobs.finals(rg1)
    assert len(ends) == 2 and len(set(ends)) == 1 and ends[0][1] == steps, ends
    assert not _processes_left(c)


# ---------------------------------------------------------------------------------------- slow
@needs_cluster
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchx_hsdp_two_node_groups_restart_across_hosts(make_cluster, tmp_path: Path) -> None:
    """``ftlaunch:hsdp --replicas 2 --nnodes_per_replica 2``: five nodes. A worker of group 1's second
    node is SIGKILLed: both nodes of the group restart -- each with its own torchelastic restart
    count -- and rejoin: every rank agrees on the group's incarnation."""
    c = make_cluster(5)
    steps = STEPS
    job = jobs.submit_torchx(
        ["ftlaunch:hsdp", "--replicas", "2", "--nnodes_per_replica", "2", "--script", jobs.TRAIN, "--",
         "--steps", str(steps), "--step-sleep", STEP_SLEEP, *TRAIN_ARGS],
        cwd=str(tmp_path), env=c.env,
    )  # fmt: skip
    try:
        _wait_commits(lambda: _logs(tmp_path, job, "rg1", 2), 10, 360, "rg1 to commit")
        killed_at, _ = _kill_worker(c, group=1, rank=1)
        jobs.wait_job_gone(c.env, job, 400)
    except BaseException:
        print(_tails(tmp_path))
        raise
    rg1 = [jobs.read(tmp_path / f"slurm-{job}-rg1-{r}.out") for r in range(2)]
    for text in rg1:  # both nodes of the restarted group committed again
        assert jobs.first_commit_after(text, killed_at) is not None, _tails(tmp_path)
    ends = [
        f
        for r in range(2)
        for g in ("rg0", "rg1")
        for f in jobs.finals(jobs.read(tmp_path / f"slurm-{job}-{g}-{r}.out"))
    ]
    assert len(ends) == 4 and len(set(ends)) == 1 and ends[0][1] == steps, ends


@needs_cluster
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_torchx_job_loses_a_node_then_slurm_requeues_it_whole(make_cluster, tmp_path: Path) -> None:
    """A node of a torchx job is lost (its link down, every process killed, slurmd too): the other
    group trains on until Slurm declares the node down, then Slurm ends every component of the
    heterogeneous job and requeues it whole (torchx submits with ``--requeue``): what a lost node
    costs with torchx's job shape (docs/launcher.md, *Lost nodes*)."""
    c = make_cluster(3)
    job = jobs.submit_torchx(
        ["ftlaunch:ddp", "--replicas", "2", "--script", jobs.TRAIN, "--", "--steps", "100000",
         "--step-sleep", "0.2", *TRAIN_ARGS],
        cwd=str(tmp_path), env=c.env,
    )  # fmt: skip
    try:
        _wait_commits(lambda: _logs(tmp_path, job, "rg1"), 5, 240, "rg1 to commit")
        lost = jobs.find_workers("train_ddp.py", c.node_pids, REPLICA_GROUP_ID="1")[0].node
        assert lost is not None
        lost_at = time.time()
        c.kill_node(lost)
        jobs.wait_until(
            lambda: any(state == "PENDING" for _, state, _ in jobs.squeue(c.env, job)), 180, "the requeue"
        )
        requeued_at = time.time()
    except BaseException:
        print(_tails(tmp_path))
        raise
    finally:
        c.slurm("scancel", job, check=False)
    survivor = _logs(tmp_path, job, "rg0")
    # The survivor trained on after the loss, until Slurm ended the job at the node's timeout.
    after = [t for _, t in jobs.commits(survivor) if lost_at < t < requeued_at]
    assert after, _tails(tmp_path)
    jobs.wait_job_gone(c.env, job, 120)
    jobs.wait_until(lambda: not _processes_left(c), 60, "every job process to end")


@needs_cluster
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_torchx_job_node_processes_killed_and_scancel(make_cluster, tmp_path: Path) -> None:
    """Every job process of one node SIGKILLed (slurmd alive): Slurm's step ends every role
    (torchx's ``--kill-on-bad-exit=1``) and the job ends failed; a second job is ended by
    ``scancel``: no process of either is left on any node."""
    c = make_cluster(3)
    args = ["ftlaunch:ddp", "--replicas", "2", "--script", jobs.TRAIN, "--", "--steps", "100000",
            "--step-sleep", "0.2", *TRAIN_ARGS]  # fmt: skip
    job = jobs.submit_torchx(args, cwd=str(tmp_path), env=c.env)
    try:
        _wait_commits(lambda: _logs(tmp_path, job, "rg1"), 3, 240, "rg1 to commit")
        node = jobs.find_workers("train_ddp.py", c.node_pids, REPLICA_GROUP_ID="1")[0].node
        assert node is not None
        c.kill_node(node, slurmd=False)
        jobs.wait_job_gone(c.env, job, 180)
        jobs.wait_until(lambda: not _processes_left(c), 60, "every job process to end")
        second = jobs.submit_torchx(args, cwd=str(tmp_path), env=c.env)
        _wait_commits(lambda: _logs(tmp_path, second, "rg1"), 3, 240, "the second job to train")
        c.slurm("scancel", second)
        jobs.wait_job_gone(c.env, second, 120)
        jobs.wait_until(lambda: not _processes_left(c), 60, "every job process to end after scancel")
    except BaseException:
        print(_tails(tmp_path))
        raise


def _readme_way_2() -> tuple[list[str], list[str]]:
    """README's way 2 as written: the lighthouse command and the torchrun command."""
    text = Path(REPO, "README.md").read_text()
    block = text.split("# 2. torchrun", 1)[1].split("# 3.", 1)[0]
    commands = " ".join(
        ln.strip() for ln in block.splitlines()[1:] if ln.strip() and not ln.lstrip().startswith("#")
    )
    lighthouse, torchrun = commands.replace("\\ ", " ").split(" torchrun ", 1)
    return lighthouse.split(), ["torchrun", *torchrun.split()]


def _fill(argv: list[str], values: dict[str, str]) -> list[str]:
    """README's placeholders (whole words: ``HOST`` is not in ``LIGHTHOUSE_HOST``) replaced."""
    out = []
    for a in argv:
        for k, v in values.items():
            a = re.sub(rf"\b{re.escape(k)}\b", v, a)
        out.append(a)
    return out


@needs_cluster
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_readme_way_2_across_hosts(make_cluster, tmp_path: Path) -> None:
    """README's way 2, as written: ``ftlaunch-lighthouse`` on node 1, ``torchrun --rdzv-backend
    ftlaunch`` on nodes 2 and 3 (only the worker count and the script differ). The groups train
    together, a killed worker is restarted by its torchrun and heals, both end equal."""
    c = make_cluster(3)
    lighthouse, torchrun = _readme_way_2()
    values = {"LIGHTHOUSE_HOST": node_name(1), "HOST": node_name(1), "PORT": "29510", "JOB": "way2",
              "TOKEN": "secret-token", "N": "2", "train.py": jobs.TRAIN}  # fmt: skip
    env = dict(c.env)
    logs = [tmp_path / f"g{g}.log" for g in range(2)]
    procs = []
    try:
        with open(tmp_path / "lighthouse.log", "wb") as out:
            procs.append(c.popen(1, _fill(lighthouse, values), env=env, stdout=out, stderr=out))
        for g in range(2):
            argv = _fill(torchrun, {**values, "G": str(g)})
            argv = [*argv[: argv.index("--nproc-per-node") + 1], "1", jobs.TRAIN]
            argv += ["--steps", str(STEPS), "--step-sleep", STEP_SLEEP, *TRAIN_ARGS]
            with open(logs[g], "wb") as out:
                procs.append(c.popen(2 + g, argv, env=env, stdout=out, stderr=out, cwd=str(tmp_path)))
        _wait_commits(lambda: jobs.read(logs[1]), 5, 240, "group 1 to commit")
        killed_at, _ = _kill_worker(c, group=1)
        for p in procs[1:]:
            p.wait(timeout=300)
    except BaseException:
        print("\n".join(jobs.read(p)[-3000:] for p in [*logs, tmp_path / "lighthouse.log"]))
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = [jobs.read(p) for p in logs]
    assert all(p.returncode == 0 for p in procs[1:]), [t[-2000:] for t in texts]
    assert jobs.first_commit_after(texts[1], killed_at) is not None
    ends = [f for t in texts for f in jobs.finals(t)]
    assert len(ends) == 2 and len(set(ends)) == 1, ends


@needs_cluster
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_hot_spare_across_hosts(make_cluster, tmp_path: Path) -> None:
    """``ftlaunch:ddp --replicas 2 --spares 1`` on four nodes: a killed group's slot goes to the
    spare on another node, which heals there and trains; every group ends equal."""
    c = make_cluster(4)
    job = jobs.submit_torchx(
        ["ftlaunch:ddp", "--replicas", "2", "--spares", "1", "--script", jobs.TRAIN, "--", "--steps",
         str(STEPS),
         "--step-sleep", STEP_SLEEP, *TRAIN_ARGS],
        cwd=str(tmp_path), env=c.env,
    )  # fmt: skip
    try:
        _wait_commits(lambda: _logs(tmp_path, job, "rg1"), 5, 300, "rg1 to commit")
        killed_at, _ = _kill_worker(c, group=1)
        jobs.wait_until(lambda: "took over replica group 1" in _logs(tmp_path, job, "rg2"), 120, "the spare")
        jobs.wait_job_gone(c.env, job, 300)
    except BaseException:
        print(_tails(tmp_path))
        raise
    spare = _logs(tmp_path, job, "rg2")
    assert jobs.first_commit_after(spare, killed_at) is not None
    ends = [f for g in ("rg0", "rg1", "rg2") for f in jobs.finals(_logs(tmp_path, job, g))]
    assert len(set(ends)) == 1 and len(ends) >= 2, ends


@needs_cluster
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_lighthouse_on_a_node_of_its_own(make_cluster, tmp_path: Path) -> None:
    """A lighthouse on node 1, outside the job (drained: no job lands there), and ``ftlaunch:ddp
    --lighthouse node1:PORT`` on the two other nodes: no role of the job coordinates it."""
    c = make_cluster(3)
    c.drain(1, "lighthouse")
    env = {**c.env, "FTLAUNCH_TOKEN": "tok-own-node"}
    lh = jobs.start_lighthouse(c, 1, 29511, env, tmp_path / "lighthouse.log")
    try:
        job = jobs.submit_torchx(
            ["ftlaunch:ddp", "--replicas", "2", "--lighthouse", f"{node_name(1)}:29511", "--script",
             jobs.TRAIN,
             "--", "--steps", "40", "--step-sleep", "0.2", *TRAIN_ARGS],
            cwd=str(tmp_path), env=env,
        )  # fmt: skip
        jobs.wait_job_gone(c.env, job, 300)
    except BaseException:
        print(_tails(tmp_path), jobs.read(tmp_path / "lighthouse.log")[-3000:])
        raise
    finally:
        lh.kill()
        lh.wait()
    nodes = {n for g in ("rg0", "rg1") for n in re.findall(r"store=([\d.]+):", _logs(tmp_path, job, g))}
    assert c.ip(1) not in nodes and len(nodes) == 2, nodes
    ends = [f for g in ("rg0", "rg1") for f in jobs.finals(_logs(tmp_path, job, g))]
    assert len(ends) == 2 and len(set(ends)) == 1, ends


@needs_cluster
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_job_array_a_lost_node_requeues_its_group_alone(make_cluster, tmp_path: Path) -> None:
    """docs/launcher.md's recipe for lost nodes: one array task per replica group (README's way 2 in
    each), the lighthouse on a node of its own. Node 3 is lost: the other group keeps committing, Slurm
    requeues the lost group's task alone onto node 4, where it heals from the survivor and trains."""
    c = make_cluster(4)
    c.drain(1, "lighthouse")
    script = jobs.docs_array_script(["--steps", "100000", "--step-sleep", "0.2", *TRAIN_ARGS])
    (tmp_path / "train.sbatch").write_text(script)
    env = {**c.env, "FTLAUNCH_TOKEN": "tok-array", "LIGHTHOUSE": f"{node_name(1)}:29512"}
    lh = jobs.start_lighthouse(c, 1, 29512, env, tmp_path / "lighthouse.log")
    job = ""
    try:
        job = jobs.sbatch(tmp_path / "train.sbatch", env)
        logs = [tmp_path / f"train-{g}.out" for g in range(2)]
        _wait_commits(lambda: jobs.read(logs[1]), 5, 300, "group 1 to commit")
        lost = jobs.find_workers("train_ddp.py", c.node_pids, REPLICA_GROUP_ID="1")[0].node
        assert lost is not None
        lost_at = time.time()
        c.kill_node(lost)
        jobs.wait_until(lambda: jobs.first_commit_after(jobs.read(logs[1]), lost_at) is not None, 300,
                        "the requeued group to commit")  # fmt: skip
        back_at = lost_at + (jobs.first_commit_after(jobs.read(logs[1]), lost_at) or 0)
    except BaseException:
        print("\n".join(f"--- {p.name}\n{jobs.read(p)[-2500:]}" for p in sorted(tmp_path.glob("*.out"))))
        print(jobs.read(tmp_path / "lighthouse.log")[-2000:], c.log_tail())
        raise
    finally:
        if job:
            c.slurm("scancel", job, check=False)
        lh.kill()
        lh.wait()
    survivor = jobs.read(logs[0])
    # The survivor never stopped for the lost group: it committed while the group was away.
    assert [t for _, t in jobs.commits(survivor) if lost_at + 5 < t < back_at], "survivor stalled"
    # Group 1 came back on another node than the lost one.
    nodes = set(re.findall(r"store=([\d.]+):", jobs.read(logs[1])))
    assert len(nodes) == 2 and c.ip(lost) in nodes, nodes
