"""ftlaunch.env: the launcher->worker contract is written once and parsed once."""

from __future__ import annotations

import pytest

from ftlaunch import env
from ftlaunch.env import GroupEnv, JobEnv
from ftlaunch.errors import ConfigurationError


def test_round_trip() -> None:
    job = JobEnv(replica_group_id=1, num_replica_groups=3, lighthouse="127.0.0.1:29510", token="t")
    assert job.lighthouse == "http://127.0.0.1:29510" and job.replica_id == "rg1"
    assert JobEnv.from_environ(job.to_environ()) == job
    assert env.FTLAUNCH_TOKEN not in JobEnv(0, 1, "http://h:1").to_environ()


def test_explicit_values_win_and_torchft_name_is_accepted() -> None:
    environ = {
        env.REPLICA_GROUP_ID: "0",
        env.NUM_REPLICA_GROUPS: "2",
        env.TORCHFT_LIGHTHOUSE: "http://[::1]:5",
    }
    job = JobEnv.from_environ(environ, replica_group_id=1)
    assert (job.replica_group_id, job.num_replica_groups, job.lighthouse) == (1, 2, "http://[::1]:5")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "(?s)REPLICA_GROUP_ID and FTLAUNCH_LIGHTHOUSE not set.*ftlaunch --replicas"),
        ({env.REPLICA_GROUP_ID: "0", env.FTLAUNCH_LIGHTHOUSE: "h:1"}, "NUM_REPLICA_GROUPS is not set"),
        (
            {env.REPLICA_GROUP_ID: "abc", env.NUM_REPLICA_GROUPS: "2", env.FTLAUNCH_LIGHTHOUSE: "h:1"},
            "not an integer",
        ),
        (
            {env.REPLICA_GROUP_ID: "2", env.NUM_REPLICA_GROUPS: "2", env.FTLAUNCH_LIGHTHOUSE: "h:1"},
            r"outside 0\.\.1",
        ),
        (
            {env.REPLICA_GROUP_ID: "0", env.NUM_REPLICA_GROUPS: "0", env.FTLAUNCH_LIGHTHOUSE: "h:1"},
            "NUM_REPLICA_GROUPS='0' is out of range: use an integer 1 or more",
        ),
        (
            {env.REPLICA_GROUP_ID: "0", env.NUM_REPLICA_GROUPS: "1", env.FTLAUNCH_LIGHTHOUSE: "ftp://x"},
            "FTLAUNCH_LIGHTHOUSE='ftp://x' is not a lighthouse address",
        ),
    ],
)
def test_bad_environment_is_a_configuration_error(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        JobEnv.from_environ(environ)


def test_group_env() -> None:
    g = GroupEnv.from_environ(
        {
            env.RANK: "1",
            env.WORLD_SIZE: "2",
            env.MASTER_ADDR: "h",
            env.MASTER_PORT: "5",
            env.TORCHELASTIC_RESTART_COUNT: "3",
        }
    )
    assert g == GroupEnv(rank=1, world_size=2, master_addr="h", master_port=5, restart_count=3)
    assert GroupEnv.from_environ({}) == GroupEnv()
    with pytest.raises(ConfigurationError, match="outside WORLD_SIZE"):
        GroupEnv.from_environ({env.RANK: "2", env.WORLD_SIZE: "2"})


_INIT_SCRIPT = "import ftlaunch as ft\nft.init()\n"
_MANAGER_SCRIPT = (
    "from ftlaunch.manager import Manager\n"
    "Manager(pg=None, load_state_dict=None, state_dict=None, min_replica_size=1,\n"
    "        store_addr='127.0.0.1', store_port=1, rank=0, world_size=1, replica_id='x')\n"
)


@pytest.mark.parametrize(
    ("script", "environ", "message"),
    [
        (
            _INIT_SCRIPT,
            {env.REPLICA_GROUP_ID: "0", env.NUM_REPLICA_GROUPS: "1", env.FTLAUNCH_LIGHTHOUSE: "ftp://x"},
            "FTLAUNCH_LIGHTHOUSE='ftp://x' is not a lighthouse address",
        ),
        (
            _INIT_SCRIPT,
            {env.REPLICA_GROUP_ID: "abc", env.NUM_REPLICA_GROUPS: "1", env.FTLAUNCH_LIGHTHOUSE: "h:1"},
            "REPLICA_GROUP_ID='abc' is not an integer",
        ),
        # torchft's path: the Manager builds its own client (a plain ValueError escaped here before).
        (
            _MANAGER_SCRIPT,
            {env.FTLAUNCH_LIGHTHOUSE: "ftp://x"},
            "FTLAUNCH_LIGHTHOUSE='ftp://x' is not a lighthouse address",
        ),
    ],
    ids=["init-bad-lighthouse", "init-bad-group-id", "manager-bad-lighthouse"],
)
def test_bad_environment_ends_a_worker_with_one_line(
    script: str, environ: dict[str, str], message: str
) -> None:
    """Issue 17: a bad environment value is one line on stderr and exit 1, not a traceback wall."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k not in env.ALL_FTLAUNCH_VARS}
    proc = subprocess.run(
        [sys.executable, "-c", script], env={**clean, **environ}, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ftlaunch: configuration error: ") and message in lines[0], lines[0]
