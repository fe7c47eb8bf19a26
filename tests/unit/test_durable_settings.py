"""Durable checkpoints' settings on every way in (the environment, ``ftlaunch``'s flags, the
rendezvous conf, the torchx components) and how the job reports them (the leaders' progress
reports, ``/status``, ``/metrics``, the launcher's status line and summary), in one process."""

from __future__ import annotations

import os

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

import ftlaunch
from ftlaunch import env
from ftlaunch.errors import ConfigurationError
from ftlaunch.launcher import cli
from ftlaunch.launcher.group import Group
from ftlaunch.launcher.rendezvous import FtRendezvousConfig
from ftlaunch.launcher.report import status_text, summary_lines
from ftlaunch.lighthouse.membership import Membership
from ftlaunch.lighthouse.metrics import families
from ftlaunch.lighthouse.progress import GroupProgress, ProgressBook, ProgressReport
from ftlaunch.lighthouse.quorum import QuorumIdAllocator, QuorumOptions
from ftlaunch.worker.durable import DurableStats


def test_checkpoint_env_reads_and_publishes() -> None:
    assert env.CheckpointEnv.from_environ({}) == env.CheckpointEnv(None, 100, 3)
    got = env.CheckpointEnv.from_environ(
        {
            env.FTLAUNCH_CHECKPOINT_DIR: "~/ck",
            env.FTLAUNCH_CHECKPOINT_EVERY: "50",
            env.FTLAUNCH_CHECKPOINT_KEEP: "0",
        }
    )
    assert got == env.CheckpointEnv(os.path.expanduser("~/ck"), 50, 0)
    assert env.CheckpointEnv.from_environ(got.to_environ()) == got
    assert env.CheckpointEnv(None).to_environ() == {}
    with pytest.raises(ConfigurationError, match="FTLAUNCH_CHECKPOINT_EVERY='-1'"):
        env.CheckpointEnv.from_environ({env.FTLAUNCH_CHECKPOINT_EVERY: "-1"})


def test_launcher_flags_publish_the_settings(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (env.FTLAUNCH_CHECKPOINT_DIR, env.FTLAUNCH_CHECKPOINT_EVERY, env.FTLAUNCH_CHECKPOINT_KEEP):
        monkeypatch.setenv(name, "")  # recorded as unset: removed again at teardown, whatever the CLI sets
        monkeypatch.delenv(name)
    script = tmp_path / "train.py"
    script.write_text("")
    target = tmp_path / "ckpt"
    cli.options_from_args(["--checkpoint-dir", str(target), "--checkpoint-every", "7", str(script)])
    assert env.CheckpointEnv.from_environ() == env.CheckpointEnv(str(target), 7, 3)
    assert target.is_dir()
    for name in (env.FTLAUNCH_CHECKPOINT_DIR, env.FTLAUNCH_CHECKPOINT_EVERY, env.FTLAUNCH_CHECKPOINT_KEEP):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):
        cli.options_from_args(["--checkpoint-every", "7", str(script)])


def test_rendezvous_conf_keys() -> None:
    params = RendezvousParameters(
        backend="ftlaunch", endpoint="127.0.0.1:1", run_id="t", min_nodes=1, max_nodes=1,
        replica_group_id="0", num_replica_groups="2", checkpoint_dir="/ck", checkpoint_every="20",
    )  # fmt: skip
    assert FtRendezvousConfig.from_params(params, {}).checkpoint == env.CheckpointEnv("/ck", 20, 3)
    bad = RendezvousParameters(
        backend="ftlaunch", endpoint="127.0.0.1:1", run_id="t", min_nodes=1, max_nodes=1,
        replica_group_id="0", num_replica_groups="2", checkpoint_every="20",
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match="need checkpoint_dir"):
        FtRendezvousConfig.from_params(bad, {})


def test_torchx_components_pass_the_directory() -> None:
    pytest.importorskip("torchx")
    app = ftlaunch.ddp(script="train.py", checkpoint_dir="/ck", checkpoint_every=50)
    groups = [r for r in app.roles if r.name.startswith("rg")]
    assert groups and all(r.env[env.FTLAUNCH_CHECKPOINT_DIR] == "/ck" for r in groups)
    assert all(r.env[env.FTLAUNCH_CHECKPOINT_EVERY] == "50" for r in groups)
    assert env.FTLAUNCH_CHECKPOINT_DIR not in ftlaunch.ddp(script="train.py").roles[-1].env


def test_reports_carry_durable_stats_to_status_metrics_and_launcher() -> None:
    stats = DurableStats(
        saves=3, skipped=1, failed=0, last_step=300, last_time=1000.0, last_seconds=0.25, resumed_from=100
    )
    report = ProgressReport(session="s", step=305, commits=205, **stats.report())
    assert ProgressReport.from_json(report.to_json()) == report
    book = ProgressBook()
    book.report("rg0", report, wall=1010.0)
    (progress,) = book.snapshot(1010.0)
    assert (progress.durable_step, progress.durable_saves, progress.resumed_from) == (300, 3, 100)
    assert GroupProgress.from_json(progress.to_json()) == progress

    m = Membership(QuorumOptions(expected_replicas=1), ids=QuorumIdAllocator(1_700_000_000_000))
    m.heartbeat("rg0", report)
    names = {family.name for family in families(m.snapshot())}
    assert {
        "ftlaunch_group_durable_step",
        "ftlaunch_group_durable_skipped",
        "ftlaunch_group_resumed_from",
    } <= names

    g = Group(0)
    g.lighthouse_progress(progress, now=0.0, wall_offset=0.0)
    assert status_text([g], 3, 12.0, wall_now=1012.0).endswith("| 12s | durable step 300 (12s ago)")
    lines = summary_lines(0, 12.0, [g], 3, None, started=0.0, log_dir="/logs")
    assert any(
        line.startswith("[ftlaunch] durable checkpoints: last at step 300 (written by rg0 in 0.25s")
        and "3 saved, 1 skipped" in line
        and line.endswith("resumed from step 100")
        for line in lines
    ), lines
