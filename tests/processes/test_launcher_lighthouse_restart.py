"""The launcher's remedy for a lighthouse that dies, in one process: the hosted
lighthouse's crash and restart on the same address, ``--chaos signal=MIX`` and ``lighthouse=``, the
torchx lighthouse role's retry policy and its same-port/same-token restart. The run through the
``ftlaunch`` command is in tests/processes/test_lighthouse_restart_e2e.py."""

from __future__ import annotations

import io
import os
import signal
import time

import pytest
from test_launcher_chaos import Kills, training

from ftlaunch.errors import ConfigurationError
from ftlaunch.launcher import lighthouse_role
from ftlaunch.launcher.chaos import Chaos
from ftlaunch.launcher.lighthouse_host import HostedLighthouse, LighthouseSettings
from ftlaunch.launcher.options import CHAOS_MIX, ChaosSpec
from ftlaunch.launcher.output import Console
from ftlaunch.lighthouse.client import LighthouseClient
from ftlaunch.lighthouse.quorum import QuorumMember


def test_a_hosted_lighthouse_restarts_on_the_same_address_with_fresh_bookkeeping() -> None:
    lh = HostedLighthouse.start(LighthouseSettings(bind="127.0.0.1:0", token="t0k", heartbeat_timeout=2.0))
    client = LighthouseClient(lh.address, connect_timeout=1.0, token="t0k")
    try:
        assert lh.serving and not lh.needs_restart
        first = client.quorum(QuorumMember("rg0"), timeout=5.0).quorum_id
        address = lh.address
        lh.crash()
        assert not lh.serving and lh.needs_restart
        lh.restart()
        assert lh.serving and not lh.needs_restart and lh.address == address and lh.restarts == 1
        # the same address answers, knows nothing of rg0 yet, and hands out a higher id
        assert lh.snapshot().groups == ()
        client.start_heartbeat("rg0", 0.1)
        t0 = time.monotonic()
        assert client.quorum(QuorumMember("rg0"), timeout=10.0).quorum_id > first
        assert time.monotonic() - t0 >= 1.5, "a restarted lighthouse waits for reports (startup grace)"
        client.report_failure("rg0", "admin calls take the same token after a restart")
    finally:
        client.close()
        lh.stop()
    assert not lh.needs_restart, "a lighthouse stopped on purpose is not restarted"


def test_chaos_spec_mix_and_lighthouse() -> None:
    spec = ChaosSpec.parse("every=5,signal=mix,lighthouse=30,lighthouse_down=8,seed=3")
    assert spec.kinds == CHAOS_MIX and spec.lighthouse == 30 and spec.lighthouse_down == 8
    assert ChaosSpec.parse("lighthouse=0").every is None  # a lighthouse crash alone is a schedule
    assert ChaosSpec.parse("every=5,signal=STOP").kinds == (("STOP", "workers"),)
    with pytest.raises(ConfigurationError):
        ChaosSpec.parse("lighthouse_down=0,lighthouse=1")
    with pytest.raises(ConfigurationError):
        ChaosSpec.parse("every=5,lighthouse=-1")


def test_mix_picks_every_kind_and_the_lighthouse_crashes_once() -> None:
    groups, kills = training(4), Kills()
    crashes: list[float] = []
    err = io.StringIO()
    c = Chaos(
        ChaosSpec(every=1, signal="MIX", seed=7, lighthouse=20, lighthouse_down=4, stop_for=0.5),
        groups,
        Console(io.StringIO(), err, status=False),
        started=100.0,
        kill=kills,
        crash_lighthouse=lambda down: crashes.append(down) or True,
    )
    now = 105.0
    for _ in range(40):
        now += 1.0
        c.tick(now, 105.0, agent_pids={g.gid: 50 + g.gid for g in groups})
        groups[:] = training(4)  # every victim is back at once, so the chaos may hit again
    kinds = {(i.signal, i.target) for i in c.injections}
    assert kinds == {("SIGKILL", "workers"), ("SIGSTOP", "workers"), ("SIGKILL", "agent")}, kinds
    assert crashes == [4] and c.lighthouse_crash is not None and c.lighthouse_crash.at == 125.0
    assert "lighthouse crashed" in err.getvalue()
    c.lighthouse_restarted(129.5)
    assert c.lighthouse_crash.down_for == pytest.approx(4.5)
    assert any(sig == signal.SIGCONT for _, sig in kills.sent)


def test_lighthouse_chaos_without_a_hosted_lighthouse_says_so() -> None:
    err = io.StringIO()
    c = Chaos(
        ChaosSpec(lighthouse=0),
        training(2),
        Console(io.StringIO(), err, status=False),
        started=0.0,
        kill=Kills(),
        crash_lighthouse=lambda down: False,
    )
    c.tick(1.0, 0.5, {})
    assert "not injected" in err.getvalue() and c.injections == []


def test_the_torchx_lighthouse_role_is_replaced_alone_where_the_scheduler_can() -> None:
    import torchx.specs as specs
    from torchx.specs.builders import materialize_appdef
    from torchx.specs.finder import get_component

    from ftlaunch.launcher.torchx_components import LIGHTHOUSE_ROLE_RETRIES

    app = materialize_appdef(get_component("ftlaunch:ddp").fn, ["--replicas", "2", "-m", "pkg.train"])
    lighthouse = app.roles[0]
    assert lighthouse.name == "lighthouse" and lighthouse.max_retries >= LIGHTHOUSE_ROLE_RETRIES
    assert lighthouse.retry_policy == specs.RetryPolicy.REPLICA
    assert all(r.max_retries == 0 for r in app.roles[1:])


def test_a_restarted_lighthouse_role_serves_on_the_same_port_with_the_same_token(tmp_path) -> None:
    job_dir = str(tmp_path)
    assert lighthouse_role._same_port_as_before("0.0.0.0:0", job_dir) == "0.0.0.0:0"  # first incarnation
    with open(os.path.join(job_dir, "lighthouse.addr"), "w") as f:
        f.write("http://node-3:41234\n")
    assert lighthouse_role._same_port_as_before("0.0.0.0:0", job_dir) == "0.0.0.0:41234"
    assert lighthouse_role._same_port_as_before("127.0.0.1:29510", job_dir) == "127.0.0.1:29510"  # explicit
    assert lighthouse_role._read(os.path.join(job_dir, "lighthouse.token")) is None
