"""The torchx roles at run time: what each decides from its scheduler (`placement`, one process, env
dicts as each scheduler sets them), and a real job of a lighthouse role and two group roles started
the way Slurm starts them (``SLURM_JOB_ID``, the lighthouse's host in torchx's rank0 variable): a
group out of restarts keeps its task alive until the other group has finished."""

from __future__ import annotations

import glob
import os
import stat
import sys
import time

import pytest
from workers.helpers import REPO, WORKER, finish, kill_tree, records, start, wait_for

from ftlaunch.errors import ConfigurationError
from ftlaunch.launcher import placement
from ftlaunch.launcher.group_role import resolve_endpoint
from ftlaunch.launcher.placement import KUBERNETES, LOCAL, REMOTE, SLURM, Placement

# What each scheduler puts in a role's environment (torchx's ${rank0_env} and the scheduler's own).
LOCAL_CWD = {"TORCHX_RANK0_HOST": "localhost"}
LOCAL_DOCKER = {"TORCHX_RANK0_HOST": "ftjob-lighthouse-0"}
SLURM_ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu-node-17"}
K8S_LIGHTHOUSE_POD = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "TORCHX_RANK0_HOST": "localhost"}
K8S_GROUP_POD = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "VC_LIGHTHOUSE_0_HOSTS": "ftjob-lighthouse-0.ftjob"}


@pytest.mark.parametrize(
    "rank0_env, environ, expected",
    [
        ("TORCHX_RANK0_HOST", LOCAL_CWD, Placement(LOCAL)),
        ("TORCHX_RANK0_HOST", LOCAL_DOCKER, Placement(REMOTE, "ftjob-lighthouse-0")),
        ("SLURM_JOB_NODELIST_HET_GROUP_0", SLURM_ENV, Placement(SLURM, "gpu-node-17")),
        (
            "SLURM_JOB_NODELIST_HET_GROUP_0",
            {**SLURM_ENV, "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu[1-2]"},
            Placement(SLURM),
        ),  # a node list is no host name: the address file's host is used
        ("TORCHX_RANK0_HOST", K8S_LIGHTHOUSE_POD, Placement(KUBERNETES)),
        ("VC_LIGHTHOUSE_0_HOSTS", K8S_GROUP_POD, Placement(KUBERNETES, "ftjob-lighthouse-0.ftjob")),
        ("${rank0_env}", {}, Placement(LOCAL)),  # not substituted (run by hand): one machine
    ],
)
def test_detect(rank0_env: str, environ: dict[str, str], expected: Placement) -> None:
    assert placement.detect(rank0_env, environ) == expected


def test_job_dir_and_bind_per_scheduler(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    local, slurm, k8s = Placement(LOCAL), Placement(SLURM, "n1"), Placement(KUBERNETES, "lh")
    assert placement.job_dir("auto", "app1", local, needed=True) == "/tmp/ftlaunch-torchx/app1"
    assert placement.job_dir("auto", "4242", slurm, needed=True) == str(
        tmp_path / ".ftlaunch-torchx" / "4242"
    )
    assert placement.job_dir("/mnt/ft/job", "x", k8s, needed=True) == "/mnt/ft/job"
    assert (
        placement.job_dir("auto", "x", k8s, needed=False) is None
    )  # an external lighthouse, one-node groups
    with pytest.raises(
        ConfigurationError, match=r"Kubernetes pods share no directory: pass --job_dir .*--mounts"
    ):
        placement.job_dir("auto", "x", k8s, needed=True)
    assert placement.lighthouse_bind("auto", local) == "127.0.0.1:0"
    assert placement.lighthouse_bind("auto", slurm) == "0.0.0.0:0" == placement.lighthouse_bind("auto", k8s)
    assert placement.lighthouse_bind("10.0.0.5:29510", local) == "10.0.0.5:29510"


def test_group_role_torchrun_arguments() -> None:
    from ftlaunch.launcher.group_role import build_parser, torchrun_argv

    args = build_parser().parse_args(
        ["--group", "1", "--groups", "3", "--nnodes", "2", "--", "--nnodes", "2", "t.py"]
    )
    argv = torchrun_argv(args, "http://lh:1234", "/shared/job")
    assert argv[:2] == ["--rdzv-endpoint", "http://lh:1234"] and argv[-3:] == ["--nnodes", "2", "t.py"]
    conf = dict(kv.split("=", 1) for kv in argv[3].split(","))
    assert conf == {
        "replica_group_id": "1",
        "num_replica_groups": "3",
        "start_lighthouse": "false",
        "group_endpoint": "file:/shared/job/rg1.store",
    }
    # A job Slurm requeued keeps its id and job directory: its groups meet in fresh store files.
    requeued = torchrun_argv(args, "http://lh:1234", "/shared/job", requeued=2)
    assert "group_endpoint=file:/shared/job/rg1.r2.store" in requeued[3]


def test_group_roles_connect_to_the_schedulers_name_for_the_lighthouse() -> None:
    assert (
        resolve_endpoint("http://lighthouse-node:41234", Placement(SLURM, "gpu-node-17"))
        == "http://gpu-node-17:41234"
    )
    assert resolve_endpoint("http://127.0.0.1:41234", Placement(LOCAL)) == "http://127.0.0.1:41234"


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
        "LOGLEVEL": "INFO",
        **extra,
    }


@pytest.mark.timeout(180)
def test_slurm_like_job_a_failed_group_holds_its_task_until_the_others_finish(tmp_path) -> None:
    """Slurm runs every role as one srun step with --kill-on-bad-exit and --wait=60: a group role must
    not end before the job does. Here rg1 runs out of restarts at once, rg0 trains on; rg1's task
    stays up (exit file written, process alive) until rg0 has finished, then exits with torchrun's
    status. The lighthouse listens on all interfaces with a token; the groups reach it on the host the
    scheduler names (127.0.0.2 here, while the lighthouse writes its own host name)."""
    out = tmp_path / "records"
    out.mkdir()
    cwd = tmp_path / "submit"  # Slurm's submission directory: the automatic job directory goes there
    cwd.mkdir()
    env = _env(SLURM_JOB_ID="4242", FAKE_HET_GROUP_0="127.0.0.2")
    where = ["--app-id", "4242", "--rank0-env", "FAKE_HET_GROUP_0", "--job-dir", "auto"]
    job_dir = str(cwd / ".ftlaunch-torchx" / "4242")

    def group(g: int, *worker_args: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "ftlaunch.launcher.group_role",
            *where,
            "--group",
            str(g),
            "--groups",
            "2",
            "--node",
            "0",
            "--hold-timeout",
            "60",
            "--",
            "--rdzv-backend",
            "ftlaunch",
            "--rdzv-id",
            "4242",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "0",
            "--tee",
            "3",
            WORKER,
            "--out",
            str(out),
            *worker_args,
        ]

    lighthouse = start(
        [
            sys.executable,
            "-m",
            "ftlaunch.launcher.lighthouse_role",
            *where,
            "--groups",
            "2",
            "--bind",
            "auto",
            "--join-timeout",
            "1",
            "--cleanup",
        ],
        cwd=str(cwd),
        env=env,
    )
    rg0 = start(group(0, "--steps", "100", "--step-time", "0.1"), cwd=str(cwd), env=env)
    rg1 = start(
        group(1, "--steps", "100", "--step-time", "0.1", "--fail-group", "1", "--fail-step", "2"),
        cwd=str(cwd),
        env=env,
    )
    procs = [lighthouse, rg0, rg1]
    try:
        token_file = os.path.join(job_dir, "lighthouse.token")
        wait_for(lambda: os.path.exists(token_file), 60, "the lighthouse role's token file")
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        with open(token_file) as f:
            token = f.read().strip()
        with open(os.path.join(job_dir, "lighthouse.addr")) as f:
            address = f.read().strip()
        assert not address.startswith("http://127.0.0.1:")  # bound on all interfaces: its host name
        wait_for(lambda: os.path.exists(os.path.join(job_dir, "rg1.0.exit")), 90, "rg1's torchrun to give up")
        rg0_exit = os.path.join(job_dir, "rg0.0.exit")
        # rg1 is out of restarts; while rg0 trains (about 10 s more), rg1's task must stay.
        held_from = time.monotonic()
        while not os.path.exists(rg0_exit) and os.path.isdir(job_dir):
            if rg1.poll() is not None:
                raise AssertionError(
                    f"rg1's task ended while rg0 was still training:\n{finish(rg1, 10).stderr[-3000:]}"
                )
            time.sleep(0.05)
        assert time.monotonic() - held_from > 3.0  # it really held while rg0 trained
        res1, res0, res_lh = finish(rg1, 60), finish(rg0, 60), finish(lighthouse, 60)
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert res1.returncode == 1, res1.stderr[-3000:]  # torchrun's status (ChildFailedError), passed on
    assert res0.returncode == 0 and res_lh.returncode == 0, res0.stderr[-3000:] + res_lh.stderr[-3000:]
    assert "waits for the other groups to finish" in res1.stderr
    assert "every group role has finished" in res1.stderr or "job directory was removed" in res1.stderr
    assert not os.path.exists(job_dir) and not glob.glob(str(cwd / ".ftlaunch-torchx" / "*"))  # cleaned up
    recs = records(str(out))
    port = address.rsplit(":", 1)[1]
    assert {r["env"]["FTLAUNCH_LIGHTHOUSE"] for r in recs} == {f"http://127.0.0.2:{port}"}
    assert {r["env"].get("FTLAUNCH_TOKEN") for r in recs} == {token}
    assert any(r["rank"] == 0 and r["group"] == 0 for r in recs) and any(r["group"] == 1 for r in recs)
