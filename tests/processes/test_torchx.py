"""torchx components ``ftlaunch:hsdp`` / ``ftlaunch:ddp``: the spec they build, dryruns for cluster
schedulers, ``.torchxconfig``'s default job, builtins still visible, and a real local_cwd run."""

from __future__ import annotations

import re
import shutil
import sys

import pytest
from workers.helpers import REPO, records, run

torchx = pytest.importorskip(
    "torchx", reason="torchx is an optional dependency (pip install ftlaunch[torchx])"
)

from torchx.specs.builders import materialize_appdef  # noqa: E402
from torchx.specs.finder import get_component  # noqa: E402

TORCHX = [sys.executable, "-m", "torchx.cli.main"]


def _app(name: str, args: list[str]):
    return materialize_appdef(get_component(name).fn, args)


def _group_args(role) -> tuple[list[str], list[str]]:
    """A group role's (group_role options, torchrun arguments)."""
    assert role.entrypoint == "python" and role.args[:2] == ["-m", "ftlaunch.launcher.group_role"], role.args
    split = role.args.index("--")
    return role.args[2:split], role.args[split + 1 :]


def _flat(text: str) -> str:
    """torchx prints an app's args one per line (``'--nnodes',\n  '2'``): as one command line."""
    return re.sub(r"',\s*'", " ", text)


def _opt(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_hsdp_spec_roles_env_resources_and_no_fixed_ports() -> None:
    app = _app(
        "ftlaunch:hsdp",
        [
            "--replicas",
            "3",
            "--workers_per_replica",
            "2",
            "--nnodes_per_replica",
            "2",
            "--gpu",
            "2",
            "--max_restarts",
            "5",
            "--script",
            "train.py",
            "--",
            "--lr",
            "0.1",
        ],
    )
    assert [r.name for r in app.roles] == [
        "lighthouse",
        "rg0",
        "rg1",
        "rg2",
    ]  # lighthouse first: ${rank0_env}
    lighthouse, *groups = app.roles
    assert lighthouse.resource.gpu == 0 and lighthouse.num_replicas == 1
    assert lighthouse.entrypoint == "python" and lighthouse.args[:2] == [
        "-m",
        "ftlaunch.launcher.lighthouse_role",
    ]
    assert _opt(lighthouse.args, "--bind") == "auto" and _opt(lighthouse.args, "--job-dir") == "auto"
    assert _opt(lighthouse.args, "--groups") == "6"  # 3 groups x 2 nodes report back
    assert _opt(lighthouse.args, "--rank0-env") == "${rank0_env}" and "--cleanup" in lighthouse.args
    for g, role in enumerate(groups):
        ours, torchrun = _group_args(role)
        assert role.num_replicas == 2 and role.resource.gpu == 2  # multi-node group, GPUs honoured
        assert role.env["REPLICA_GROUP_ID"] == str(g) and role.env["NUM_REPLICA_GROUPS"] == "3"
        assert (_opt(ours, "--group"), _opt(ours, "--groups"), _opt(ours, "--nnodes")) == (str(g), "3", "2")
        assert _opt(ours, "--node") == "${replica_id}" and _opt(ours, "--rank0-env") == "${rank0_env}"
        assert torchrun[:2] == ["--rdzv-backend", "ftlaunch"] and _opt(torchrun, "--rdzv-id") == "${app_id}"
        assert (
            _opt(torchrun, "--nnodes"),
            _opt(torchrun, "--nproc-per-node"),
            _opt(torchrun, "--max-restarts"),
        ) == ("2", "2", "5")
        # Every worker through ftlaunch.run: forked from its node's warm standby (torch imported).
        assert torchrun[-5:] == ["-m", "ftlaunch.run", "train.py", "--lr", "0.1"]
    # Nothing binds a fixed port.
    text = " ".join(" ".join(r.args) for r in app.roles)
    assert not re.findall(r"[\w.]+:(\d+)\b", text)


def test_ddp_with_external_lighthouse_has_no_lighthouse_role() -> None:
    app = _app("ftlaunch:ddp", ["--replicas", "2", "--lighthouse", "lh.example:29510", "-m", "pkg.train"])
    assert [r.name for r in app.roles] == ["rg0", "rg1"]
    ours, torchrun = _group_args(app.roles[0])
    assert _opt(ours, "--lighthouse") == "lh.example:29510" and _opt(torchrun, "--nnodes") == "1"
    assert torchrun[-4:] == ["-m", "ftlaunch.run", "-m", "pkg.train"]
    assert app.roles[0].env["FTLAUNCH_LIGHTHOUSE"] == "http://lh.example:29510"


def test_the_straggler_policy_goes_to_the_lighthouse_role() -> None:
    app = _app("ftlaunch:ddp", ["--replicas", "2", "--stragglers", "replace", "--script", "x.py"])
    assert _opt(app.roles[0].args, "--stragglers") == "replace"
    default = _app("ftlaunch:diloco", ["--replicas", "2", "--script", "x.py"])
    assert _opt(default.roles[0].args, "--stragglers") == "report"
    with pytest.raises(ValueError, match="--stragglers 'evict' must be one of report, replace"):
        _app("ftlaunch:hsdp", ["--replicas", "2", "--stragglers", "evict", "--script", "x.py"])
    with pytest.raises(ValueError, match="has its own"):
        _app("ftlaunch:ddp", ["--stragglers", "replace", "--lighthouse", "h:1", "--script", "x.py"])


def test_component_errors() -> None:
    with pytest.raises(ValueError, match="give --script or -m, not both"):
        _app("ftlaunch:hsdp", ["--replicas", "2", "--script", "x.py", "-m", "pkg.train"])
    with pytest.raises(ValueError, match="--min_replicas 3 > --replicas 2"):
        _app("ftlaunch:hsdp", ["--replicas", "2", "--min_replicas", "3", "--script", "x.py"])


def test_hsdp_runs_train_hsdp_by_default_with_the_workers_per_replica_given() -> None:
    app = _app("ftlaunch:hsdp", ["--replicas", "2", "--workers_per_replica", "4", "--", "--steps", "5"])
    for role in app.roles[1:]:
        _, torchrun = _group_args(role)
        assert _opt(torchrun, "--nproc-per-node") == "4"
        assert torchrun[-3].endswith("scripts/train_hsdp.py") and torchrun[-2:] == ["--steps", "5"]
    _, torchrun = _group_args(_app("ftlaunch:hsdp", ["-m", "pkg.train"]).roles[1])
    assert not any("train_hsdp.py" in a for a in torchrun)


@pytest.mark.timeout(120)
def test_builtins_are_not_hidden() -> None:
    res = run([*TORCHX, "builtins"], timeout=100)
    assert res.returncode == 0, res.stderr
    assert "dist.ddp" in res.stdout and "utils.echo" in res.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "scheduler, extra",
    [
        ("slurm", ["--nnodes_per_replica", "2"]),
        ("local_docker", ["--lighthouse", "ftlaunch-lighthouse.example:29510"]),
    ],
)
def test_dryrun_from_the_command_line(scheduler: str, extra: list[str], tmp_path) -> None:
    # Outside the repository (its .torchxconfig must not apply), no workspace image build.
    res = run(
        [
            *TORCHX,
            "run",
            "-s",
            scheduler,
            "--workspace",
            "",
            "--dryrun",
            "ftlaunch:hsdp",
            "--replicas",
            "2",
            "--workers_per_replica",
            "3",
            "--script",
            "train.py",
            *extra,
        ],
        timeout=100,
        cwd=str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    text = _flat(res.stdout + res.stderr)
    assert (
        "ftlaunch.launcher.group_role" in text and "--rdzv-backend ftlaunch" in text and "--group 1" in text
    )
    # One role per replica group, each running workers_per_replica workers.
    raw = res.stdout + res.stderr
    assert "'name': 'rg0'" in raw and "'name': 'rg1'" in raw and text.count("--nproc-per-node 3") >= 2
    if scheduler == "slurm":
        assert "ftlaunch.launcher.lighthouse_role" in text and "SLURM_JOB_NODELIST_HET_GROUP_0" in text
    else:
        assert "ftlaunch.launcher.lighthouse_role" not in text


@pytest.mark.timeout(120)
def test_torchxconfig_default_job() -> None:
    res = run([*TORCHX, "run", "--dryrun"], timeout=100, cwd=REPO)
    assert res.returncode == 0, res.stderr
    text = _flat(res.stdout + res.stderr)
    assert "components/ft.py:train_ddp" in text or "train_ddp" in text
    assert "scripts/train_ddp.py --steps 50" in text and "--rdzv-backend ftlaunch" in text


@pytest.mark.timeout(150)
def test_local_cwd_run_with_a_group_restart(tmp_path) -> None:
    """A real local_cwd job: a lighthouse role and two torchrun roles; rg1 fails once and torchelastic
    restarts it while rg0 keeps its first (and only) workers."""
    out = str(tmp_path / "records")
    (tmp_path / "records").mkdir()
    res = run(
        [
            *TORCHX,
            "run",
            "-s",
            "local_cwd",
            "ftlaunch:hsdp",
            "--replicas",
            "2",
            "--workers_per_replica",
            "2",
            "--script",
            "tests/workers/worker.py",
            "--",
            "--out",
            out,
            "--steps",
            "20",
            "--step-time",
            "0.05",
            "--check-torch",
            "--probe-lighthouse",
            "--fail-group",
            "1",
            "--fail-rank",
            "1",
            "--fail-step",
            "2",
        ],
        timeout=140,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "SUCCEEDED" in res.stdout + res.stderr
    # torchrun's "master_addr is only used for static rdzv_backend" came once per group with the empty
    # --rdzv-endpoint the spec used to pass.
    assert "master_addr is only used" not in res.stdout + res.stderr
    recs = records(out)
    assert sorted((r["rank"], r["restart"]) for r in recs if r["group"] == 0) == [(0, 0), (1, 0)]
    assert sorted((r["rank"], r["restart"]) for r in recs if r["group"] == 1) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    lighthouses = {r["env"]["FTLAUNCH_LIGHTHOUSE"] for r in recs}
    assert len(lighthouses) == 1 and {r["lighthouse_status_address"] for r in recs} == lighthouses
    for r in recs:
        assert r["is_torchelastic_launched"] is True
        assert r["env"]["NUM_REPLICA_GROUPS"] == "2" and r["env"]["WORLD_SIZE"] == "2"
        assert r["lighthouse_token_accepted"] is True  # a group request went through
        # Run as `-m ftlaunch.run`: each worker, restarted ones too, forked from its node's standby.
        assert r["env"].get("FTLAUNCH_WORKER_PID") == str(r["pid"]), r["env"].get("FTLAUNCH_ZYGOTE_SOCKET")
    app_ids = set(re.findall(r"local_cwd://torchx/(\S+)", res.stdout + res.stderr))
    assert app_ids and all(
        not shutil.os.path.exists(f"/tmp/ftlaunch-torchx/{a}") for a in app_ids
    )  # cleaned up


def test_the_health_check_goes_to_every_group_role() -> None:
    app = _app(
        "ftlaunch:ddp", ["--replicas", "2", "--health_check", "python -m ftlaunch.health", "--script", "x.py"]
    )
    groups = [r for r in app.roles if r.name != "lighthouse"]
    assert len(groups) == 2
    assert all(r.env["FTLAUNCH_HEALTH_CHECK"] == "python -m ftlaunch.health" for r in groups)
    assert "FTLAUNCH_HEALTH_CHECK" not in app.roles[0].env  # the lighthouse role runs no check
    default = _app("ftlaunch:hsdp", ["--replicas", "2", "--script", "x.py"])
    assert not any("FTLAUNCH_HEALTH_CHECK" in r.env for r in default.roles)
