"""``ftlaunch:hsdp`` as each scheduler renders it (torchx's own dry-run code for local_cwd, Slurm and
Kubernetes): roles, replicas, resources, env, entrypoints, and the scheduler's name for the
lighthouse role's host wired into every group role."""

from __future__ import annotations

import pytest

torchx = pytest.importorskip(
    "torchx", reason="torchx is an optional dependency (pip install ftlaunch[torchx])"
)

from torchx.runner import get_runner  # noqa: E402
from torchx.specs.builders import materialize_appdef  # noqa: E402
from torchx.specs.finder import get_component  # noqa: E402

ARGS = [
    "--replicas",
    "2",
    "--workers_per_replica",
    "4",
    "--nnodes_per_replica",
    "2",
    "--gpu",
    "8",
    "--cpu",
    "32",
    "--memMB",
    "65536",
    "--max_restarts",
    "5",
    "--script",
    "train.py",
    "--",
    "--lr",
    "0.1",
]
GROUP_ROLE = ["-m", "ftlaunch.launcher.group_role"]
LIGHTHOUSE_ROLE = ["-m", "ftlaunch.launcher.lighthouse_role"]
TORCHRUN = ["--rdzv-backend", "ftlaunch"]


def _app():
    return materialize_appdef(get_component("ftlaunch:hsdp").fn, ARGS)


def _opt(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _check_group_args(args: list[str], group: int, node: int, rank0_env: str) -> None:
    split = args.index("--")
    ours, torchrun = args[:split], args[split + 1 :]
    assert ours[:2] == GROUP_ROLE
    assert (_opt(ours, "--group"), _opt(ours, "--groups"), _opt(ours, "--nnodes")) == (str(group), "2", "2")
    assert _opt(ours, "--node") == str(node)  # torchx's ${replica_id}
    assert _opt(ours, "--rank0-env") == rank0_env  # where this scheduler keeps the lighthouse role's host
    assert _opt(ours, "--job-dir") == "auto" and "--lighthouse" not in ours
    assert torchrun[:2] == TORCHRUN and _opt(torchrun, "--nproc-per-node") == "4"
    assert _opt(torchrun, "--max-restarts") == "5" and torchrun[-3:] == ["train.py", "--lr", "0.1"]


@pytest.fixture(scope="module")
def runner():
    with get_runner() as r:
        yield r


def test_local_cwd(runner, tmp_path) -> None:
    req = runner.dryrun(_app(), "local_cwd", cfg={"log_dir": str(tmp_path)}).request
    assert list(req.role_params) == ["lighthouse", "rg0", "rg1"]
    (lh,) = req.role_params["lighthouse"]
    assert lh.args[:3] == ["python", *LIGHTHOUSE_ROLE] and _opt(lh.args, "--rank0-env") == "TORCHX_RANK0_HOST"
    assert lh.env["TORCHX_RANK0_HOST"] == "localhost"  # one machine: loopback lighthouse, /tmp job dir
    for g in (0, 1):
        replicas = req.role_params[f"rg{g}"]
        assert len(replicas) == 2  # one process per node of the group
        for node, replica in enumerate(replicas):
            assert replica.args[0] == "python"
            _check_group_args(replica.args[1:], g, node, "TORCHX_RANK0_HOST")
            assert replica.env["REPLICA_GROUP_ID"] == str(g) and replica.env["NUM_REPLICA_GROUPS"] == "2"
            assert replica.env["TORCHX_RANK0_HOST"] == "localhost"


def test_slurm(runner) -> None:
    req = runner.dryrun(_app(), "slurm", cfg={}).request
    # One heterogeneous-job component per role replica, the lighthouse first (het group 0, which
    # torchx's ${rank0_env} names: SLURM_JOB_NODELIST_HET_GROUP_0).
    assert list(req.replicas) == ["lighthouse-0", "rg0-0", "rg0-1", "rg1-0", "rg1-1"]
    lh = req.replicas["lighthouse-0"]
    assert lh.entrypoint == "python" and lh.args[:2] == LIGHTHOUSE_ROLE
    assert (
        _opt(lh.args, "--rank0-env") == "SLURM_JOB_NODELIST_HET_GROUP_0" and _opt(lh.args, "--bind") == "auto"
    )
    assert _opt(lh.args, "--groups") == "4" and lh.sbatch_opts["cpus-per-task"] == "1"
    assert "gpus-per-node" not in lh.sbatch_opts and "gpus-per-task" not in lh.sbatch_opts
    for g in (0, 1):
        for node in (0, 1):
            r = req.replicas[f"rg{g}-{node}"]
            assert r.entrypoint == "python"
            _check_group_args(r.args, g, node, "SLURM_JOB_NODELIST_HET_GROUP_0")
            assert r.env["REPLICA_GROUP_ID"] == str(g) and r.env["NUM_REPLICA_GROUPS"] == "2"
            assert r.sbatch_opts["cpus-per-task"] == "32" and r.sbatch_opts["mem"] == "65536"
            assert "8" in (r.sbatch_opts.get("gpus-per-node"), r.sbatch_opts.get("gpus-per-task"))
            # torchx's srun options end the whole step with a task: why each group role holds (group_role).
            assert r.srun_opts["kill-on-bad-exit"] == "1" and r.srun_opts["wait"] == "60"
    script = req.materialize()
    assert script.count("python -m ftlaunch.launcher.group_role") == 4


def test_kubernetes() -> None:
    pytest.importorskip("kubernetes", reason="torchx's Kubernetes pod specs need the kubernetes client")
    from torchx.schedulers.kubernetes_scheduler import app_to_resource

    job = app_to_resource(_app(), queue="default", service_account=None)
    tasks = {t["name"]: t["template"] for t in job["spec"]["tasks"]}
    assert list(tasks) == ["lighthouse-0", "rg0-0", "rg0-1", "rg1-0", "rg1-1"]  # one Volcano task per replica
    lh = tasks["lighthouse-0"].spec.containers[0]
    assert lh.command[:3] == ["python", *LIGHTHOUSE_ROLE]
    # torchx tells the first role itself that rank 0 is localhost; placement recognises Kubernetes by
    # KUBERNETES_SERVICE_HOST and still binds all interfaces with a token.
    assert _opt(lh.command, "--rank0-env") == "TORCHX_RANK0_HOST"
    assert {e.name: e.value for e in lh.env}["TORCHX_RANK0_HOST"] == "localhost"
    for g in (0, 1):
        for node in (0, 1):
            c = tasks[f"rg{g}-{node}"].spec.containers[0]
            assert c.command[0] == "python"
            _check_group_args(
                c.command[1:], g, node, "VC_LIGHTHOUSE_0_HOSTS"
            )  # the lighthouse pod's DNS name
            env = {e.name: e.value for e in c.env}
            assert env["REPLICA_GROUP_ID"] == str(g) and env["NUM_REPLICA_GROUPS"] == "2"
            limits = c.resources.limits
            assert limits["nvidia.com/gpu"] == "8" and limits["cpu"] == "32000m"


def test_kubernetes_with_a_shared_volume_and_job_dir() -> None:
    """What placement's refusal tells Kubernetes users to pass, rendered: the volume in every pod."""
    pytest.importorskip("kubernetes", reason="torchx's Kubernetes pod specs need the kubernetes client")
    from torchx.schedulers.kubernetes_scheduler import app_to_resource

    app = materialize_appdef(
        get_component("ftlaunch:hsdp").fn,
        [
            "--replicas",
            "2",
            "--mounts",
            "type=volume,src=ftjob-pvc,dst=/mnt/ft",
            "--job_dir",
            "/mnt/ft/job",
            "--script",
            "train.py",
        ],
    )
    job = app_to_resource(app, queue="default", service_account=None)
    for task in job["spec"]["tasks"]:
        pod = task["template"]
        c = pod.spec.containers[0]
        assert _opt(c.command, "--job-dir") == "/mnt/ft/job"
        assert any(
            v.persistent_volume_claim and v.persistent_volume_claim.claim_name == "ftjob-pvc"
            for v in pod.spec.volumes
        )
        assert any(m.mount_path == "/mnt/ft" for m in c.volume_mounts)
