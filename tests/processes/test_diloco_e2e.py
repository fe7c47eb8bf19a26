"""scripts/train_diloco.py end to end: the README's ``ftlaunch --replicas 3 --chaos ...`` and the torchx
component ``ftlaunch:diloco`` (its spec, and a real local_cwd run with two workers per group)."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
from test_launcher_e2e import checksums
from workers.helpers import FTLAUNCH, REPO, run

TRAIN = "scripts/train_diloco.py"
TORCHX = [sys.executable, "-m", "torchx.cli.main"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ftlaunch_three_groups_with_chaos_end_bit_identical() -> None:
    # Kills at syncs 15 and 40 of 100 (chaos counts the Manager's steps: one per sync point): each
    # victim is back (process start, join, heal) long before the others finish.
    res = run([*FTLAUNCH, "--replicas", "3", "--max-restarts", "5", "--no-status", "--chaos",
               "steps=15/40,seed=3",
               TRAIN, "--steps", "2000", "--step-sleep", "0.01"], timeout=280)  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    sums = checksums(res.stdout)
    assert set(sums) == {0, 1, 2} and len(set(sums.values())) == 1, sums
    assert "3/3 groups ended bit-identical" in res.stdout
    assert "[ftlaunch] chaos: 2 injection(s)" in res.stdout and res.stdout.count("group committed again") == 2
    assert res.stderr.count("healed: loaded state") >= 2
    # Survivors went on without the victim: syncs with two participants committed.
    assert re.search(r"committed=True participants=2 ", res.stdout)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ["diloco", pytest.param("local_sgd", marks=pytest.mark.slow)])
def test_the_summary_compares_what_the_groups_share_not_their_inner_state(algorithm: str) -> None:
    """DiLoCo groups share their global parameters and outer optimizer state, LocalSGD groups their
    parameters at a sync point; each trains its own inner state (and optimizer moments) on its own
    data. The summary compares what they share: bit-identical, as the script's own checksums say --
    not "different weights" for inner state that legitimately differs. (Chaos steps count syncs: the
    Manager commits once per sync point.)"""
    res = run([*FTLAUNCH, "--replicas", "3", "--no-status", "--chaos", "steps=5,seed=3", TRAIN,
               "--algorithm", algorithm, "--steps", "400", "--step-sleep", "0.01"], timeout=280)  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    sums = checksums(res.stdout)
    assert set(sums) == {0, 1, 2} and len(set(sums.values())) == 1, sums
    assert "3/3 groups ended bit-identical" in res.stdout and "WARNING" not in res.stdout, res.stdout[-3000:]
    assert "[ftlaunch] chaos: 1 injection(s)" in res.stdout and "group committed again" in res.stdout


needs_torchx = pytest.mark.skipif(
    importlib.util.find_spec("torchx") is None,
    reason="torchx is an optional dependency (pip install ftlaunch[torchx])",
)


def _app(args: list[str]):
    from torchx.specs.builders import materialize_appdef
    from torchx.specs.finder import get_component

    return materialize_appdef(get_component("ftlaunch:diloco").fn, args)


@needs_torchx
def test_diloco_component_passes_the_algorithm_settings_to_every_group() -> None:
    app = _app(
        [
            "--replicas",
            "3",
            "--sync_every",
            "60",
            "--fragments",
            "3",
            "--fragment_sync_delay",
            "2",
            "--quantize",
            "4",
            "--env",
            "FTLAUNCH_TIMEOUT=30",
            "--script",
            TRAIN,
            "--",
            "--steps",
            "600",
        ]
    )
    assert [r.name for r in app.roles] == ["lighthouse", "rg0", "rg1", "rg2"]
    for g, role in enumerate(app.roles[1:]):
        assert role.env["REPLICA_GROUP_ID"] == str(g) and role.env["NUM_REPLICA_GROUPS"] == "3"
        assert role.env["FTLAUNCH_SYNC_EVERY"] == "60" and role.env["FTLAUNCH_FRAGMENTS"] == "3"
        assert role.env["FTLAUNCH_FRAGMENT_SYNC_DELAY"] == "2" and role.env["FTLAUNCH_QUANTIZE"] == "4"
        assert role.env["FTLAUNCH_FRAGMENT_UPDATE_ALPHA"] == "0.0" and role.env["FTLAUNCH_TIMEOUT"] == "30"
        cmd = " ".join(role.args)
        assert role.args[:2] == ["-m", "ftlaunch.launcher.group_role"], role.args
        assert f"{TRAIN} --steps 600" in cmd and "--rdzv-backend ftlaunch" in cmd


@pytest.mark.parametrize(
    "args, match",
    [
        (["--sync_every", "10", "--fragments", "3"], "multiple of --fragments"),
        (["--sync_every", "10", "--fragment_sync_delay", "10"], "fragment_sync_delay"),
        (["--quantize", "2"], "0, 4 or 8"),
        (["--fragment_update_alpha", "2"], r"in \[0, 1\]"),
    ],
)
@needs_torchx
def test_diloco_component_rejects_settings_that_cannot_work(args: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _app([*args, "--script", TRAIN])


@needs_torchx
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchx_local_cwd_streaming_diloco_two_workers_per_group_end_identical() -> None:
    res = run([*TORCHX, "run", "-s", "local_cwd", "ftlaunch:diloco", "--replicas", "2",
               "--workers_per_replica", "2",
               "--sync_every", "10", "--fragments", "2", "--fragment_sync_delay", "1", "--quantize", "8",
               "--script", TRAIN, "--", "--steps", "60", "--width", "32"], timeout=280, cwd=REPO)  # fmt: skip
    text = res.stdout + res.stderr
    assert res.returncode == 0 and "SUCCEEDED" in text, text[-4000:]
    # Both ranks of both groups print the same global parameters (rank 1 of a group too: its
    # workers start from rank 0's parameters and average their gradients).
    finals = set(re.findall(r"final_checksum=(\w+)", text))
    assert len(finals) == 1 and len(re.findall(r"final_checksum=", text)) == 4, text[-4000:]
    assert "sync of fragment 1 committed" in text  # the settings reached ft.diloco()
