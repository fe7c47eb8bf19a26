"""The launcher's one way to host or reach a lighthouse (ftlaunch.launcher.lighthouse_host), and the
agent's config, in one process: a real lighthouse on a loopback port, a real client."""

from __future__ import annotations

import json
import socket
import time

import pytest

from ftlaunch.errors import ConfigurationError, LighthouseError
from ftlaunch.launcher.agent import AgentConfig
from ftlaunch.launcher.lighthouse_host import HostedLighthouse, LighthouseSettings, RemoteLighthouse
from ftlaunch.launcher.options import ChaosSpec, LaunchOptions
from ftlaunch.lighthouse.client import LighthouseClient
from ftlaunch.lighthouse.quorum import Health, Quorum
from ftlaunch.lighthouse.status import GroupStatus, LighthouseStatus

pytestmark = pytest.mark.timeout(60)


def test_hosted_and_remote_share_one_surface() -> None:
    hosted = HostedLighthouse.start(LighthouseSettings(token="t"))
    try:
        assert hosted.address.startswith("http://127.0.0.1:") and hosted.quorum_id() is None
        remote = RemoteLighthouse.connect(hosted.address, token="t")
        with LighthouseClient(hosted.address, token="t") as group:  # a group carries the job token
            group.heartbeat("rg0")
            assert hosted.live_groups() == remote.live_groups() == 1
            remote.report_failure("rg0", "seen dead")  # the token-protected admin call
            history = hosted.status()["history"]
            assert any(h["event"] == "failed" and h["replica_id"] == "rg0" for h in history), history
            assert hosted.live_groups() == 0
        remote.close()
    finally:
        hosted.stop()
    hosted.stop()  # idempotent
    assert not RemoteLighthouse.answers(hosted.address)
    assert hosted.quorum_id() is None and hosted.live_groups() == 0  # reading a stopped one never raises
    with pytest.raises(LighthouseError, match="was stopped"):
        hosted.report_failure("rg0", "x")


def test_port_in_use_and_nothing_answering() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigurationError, match="cannot bind"):
            HostedLighthouse.start(LighthouseSettings(bind=f"127.0.0.1:{port}"))
    with pytest.raises((LighthouseError, OSError)):
        RemoteLighthouse.connect(f"127.0.0.1:{port}", timeout=1.0)
    with pytest.raises(ValueError):
        RemoteLighthouse.connect("no-port-here")
    assert not RemoteLighthouse.answers(f"127.0.0.1:{port}", timeout=0.5)


def test_linger_keeps_serving_while_a_group_is_live() -> None:
    idle = HostedLighthouse.start(LighthouseSettings())
    t0 = time.monotonic()
    idle.stop(linger=30.0)
    assert time.monotonic() - t0 < 5.0  # nobody uses it: it stops at once

    used = HostedLighthouse.start(LighthouseSettings(heartbeat_timeout=30.0))
    with LighthouseClient(used.address) as group:
        group.heartbeat("rg1")
        t0 = time.monotonic()
        used.stop(linger=0.6)
        assert time.monotonic() - t0 >= 0.6
    assert not RemoteLighthouse.answers(used.address, timeout=0.5)


def test_status_reading() -> None:
    """The launcher reads the typed status (the dict readers quorum_id_of/live_groups it replaced)."""
    assert LighthouseStatus(quorum=Quorum(3, (), 0.0)).quorum_id == 3
    assert LighthouseStatus().quorum_id is None
    groups = tuple(
        GroupStatus(f"rg{i}", health) for i, health in enumerate([Health.LIVE, Health.SILENT, Health.LIVE])
    )
    assert LighthouseStatus(groups=groups).live_count == 2 and LighthouseStatus().live_count == 0
    with pytest.raises(ValueError):
        LighthouseStatus.from_json("junk")
    with pytest.raises(ValueError, match="health"):
        LighthouseStatus.from_json(
            {**LighthouseStatus().to_json(), "groups": [{"replica_id": "rg0", "health": "asleep"}]}
        )


def test_agent_config_carries_the_options_but_no_secret() -> None:
    opts = LaunchOptions(
        entrypoint="python",
        args=["-u", "t.py"],
        nproc_per_node=2,
        token="secret",
        chaos=ChaosSpec(every=1),
        rdzv_conf={"join_timeout": "9"},
        grace_period=10,
    )
    cfg = AgentConfig.for_group(opts, run_id="r", log_dir="/l", event_fd=5, result_file="/l/res.json")
    text = cfg.to_json()
    assert "secret" not in text and json.loads(text)["options"]["chaos"] is None
    back = AgentConfig.from_json(text)
    assert (
        back == cfg and back.options.nproc_per_node == 2 and back.options.rdzv_conf == {"join_timeout": "9"}
    )
    assert back.options.agent_shutdown_timeout == 8  # --grace-period 10 minus 2
