"""The ``ftlaunch`` rendezvous backend: configuration errors, registration through the entry point,
and real ``torchrun --rdzv-backend ftlaunch`` jobs (one torchrun per group node, a 2-node group, a
restart confined to one group, a lighthouse started by the node on the endpoint host; a worker run
as ``-m ftlaunch.run SCRIPT`` restarted from the node's warm standby, which dies with the agent)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import psutil
import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
from workers.helpers import WORKER, finish, free_port, kill_tree, records, run, start, wait_for

from ftlaunch.addresses import is_local_host
from ftlaunch.errors import ConfigurationError
from ftlaunch.launcher.rendezvous import FtRendezvousConfig, create_rdzv_handler

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _params(conf: dict, endpoint: str = "127.0.0.1:1", max_nodes: int = 1) -> RendezvousParameters:
    return RendezvousParameters(
        backend="ftlaunch", endpoint=endpoint, run_id="t", min_nodes=1, max_nodes=max_nodes, **conf
    )


@pytest.mark.parametrize(
    "conf, message",
    [
        ({}, "missing replica_group_id"),
        ({"replica_group_id": "0"}, "missing num_replica_groups"),
        ({"replica_group_id": "x", "num_replica_groups": "2"}, "replica_group_id='x' is not an integer"),
        ({"replica_group_id": "2", "num_replica_groups": "2"}, r"must be in 0\.\.1"),
        ({"replica_group_id": "0", "num_replica_groups": "0"}, "num_replica_groups=0 must be >= 1"),
        ({"replica_group_id": "0", "num_replica_groups": "1", "colour": "red"}, "unknown --rdzv-conf key"),
        ({"replica_group_id": "0", "num_replica_groups": "1", "start_lighthouse": "maybe"}, "not a boolean"),
        ({"replica_group_id": "0", "num_replica_groups": "1", "lighthouse_timeout": "-1"}, "is out of range"),
        (
            {"replica_group_id": "0", "num_replica_groups": "1", "lighthouse_heartbeat_timeout": "1e-9"},
            "lighthouse_heartbeat_timeout='1e-9' is out of range: use a duration of 50 ms to 24 h",
        ),
        (
            {"replica_group_id": "0", "num_replica_groups": "1", "lighthouse_join_timeout": "inf"},
            "not a duration",
        ),
        ({"replica_group_id": "0", "num_replica_groups": "1", "lighthouse_linger": "nan"}, "not a duration"),
        (
            {"replica_group_id": "0", "num_replica_groups": "1", "lighthouse_min_replicas": "0"},
            "must be >= 1",
        ),
        (
            {"replica_group_id": "0", "num_replica_groups": "1", "lighthouse_stragglers": "evict"},
            "lighthouse_stragglers='evict' must be one of report, replace",
        ),
    ],
)
def test_config_errors_name_the_key(conf: dict, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    monkeypatch.delenv("NUM_REPLICA_GROUPS", raising=False)
    with pytest.raises(ConfigurationError, match=message):
        FtRendezvousConfig.from_params(_params(conf))


def test_config_from_environment_and_passthrough_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "3")
    monkeypatch.setenv("FTLAUNCH_TOKEN", "tok")
    cfg = FtRendezvousConfig.from_params(
        _params({"join_timeout": "30", "timeout": "900", "start_lighthouse": "no"})
    )
    assert (cfg.replica_group_id, cfg.num_replica_groups, cfg.token, cfg.start_lighthouse) == (
        1,
        3,
        "tok",
        False,
    )


def test_the_straggler_policy_of_a_lighthouse_started_here(monkeypatch: pytest.MonkeyPatch) -> None:
    conf = {"replica_group_id": "0", "num_replica_groups": "2"}
    monkeypatch.delenv("FTLAUNCH_STRAGGLERS", raising=False)
    assert FtRendezvousConfig.from_params(_params(conf)).lighthouse_settings.stragglers == "report"
    monkeypatch.setenv("FTLAUNCH_STRAGGLERS", "replace")
    assert FtRendezvousConfig.from_params(_params(conf)).lighthouse_settings.stragglers == "replace"
    explicit = FtRendezvousConfig.from_params(_params({**conf, "lighthouse_stragglers": "Report"}))
    assert explicit.lighthouse_settings.stragglers == "report"  # the key wins over the environment


def test_multi_node_group_needs_a_meeting_point() -> None:
    with pytest.raises(ConfigurationError, match="group_endpoint=HOST:PORT"):
        create_rdzv_handler(_params({"replica_group_id": "0", "num_replica_groups": "2"}, max_nodes=2))


def test_is_local_host() -> None:
    assert is_local_host("localhost") and is_local_host("127.0.0.1") and is_local_host("::1")
    assert not is_local_host("192.0.2.1")  # TEST-NET-1, never assigned


@pytest.mark.timeout(60)
def test_no_lighthouse_is_a_clear_rendezvous_error() -> None:
    # Not the endpoint host (so it must not start one) and nothing answers: a bounded, clear failure.
    handler = create_rdzv_handler(
        _params(
            {"replica_group_id": "0", "num_replica_groups": "2", "lighthouse_timeout": "1"},
            endpoint="192.0.2.1:29999",
        )
    )
    try:
        with pytest.raises(
            RendezvousConnectionError, match="no lighthouse answered at http://192.0.2.1:29999"
        ):
            handler.next_rendezvous()
    finally:
        handler.shutdown()


@pytest.mark.timeout(60)
def test_hosting_a_reachable_lighthouse_without_token_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """the node on the endpoint host does not start a lighthouse anyone could join; it says
    which setting is missing instead of waiting for a lighthouse that never comes."""
    monkeypatch.delenv("FTLAUNCH_TOKEN", raising=False)
    monkeypatch.delenv("FTLAUNCH_LIGHTHOUSE_BIND", raising=False)
    port = free_port()
    handler = create_rdzv_handler(
        _params(
            {
                "replica_group_id": "0",
                "num_replica_groups": "2",
                "lighthouse_timeout": "5",
                "lighthouse_bind": f"0.0.0.0:{port}",
            },
            endpoint=f"127.0.0.1:{port}",
        )
    )
    try:
        with pytest.raises(ConfigurationError, match="without a job token.*token=... in --rdzv-conf"):
            handler.next_rendezvous()
    finally:
        handler.shutdown()


@pytest.mark.timeout(60)
def test_entry_point_registers_backend_in_a_fresh_interpreter() -> None:
    # Both import orders: torch first (as torchrun does) and ftlaunch first (as our agent does),
    # which used to be a circular import.
    code = (
        "import {first}\n"
        "from torch.distributed.elastic.rendezvous import RendezvousParameters\n"
        "from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler\n"
        "h = get_rendezvous_handler(RendezvousParameters('ftlaunch', '127.0.0.1:1', 'r', 1, 1,"
        " replica_group_id='0', num_replica_groups='1'))\n"
        "print(type(h).__name__, h.get_backend(), h.get_run_id())\n"
        "h.shutdown()\n"
    )
    for first in ("torch.distributed.run", "ftlaunch.launcher.rendezvous"):
        res = run([sys.executable, "-c", code.format(first=first)], timeout=50)
        assert res.returncode == 0, res.stderr
        assert res.stdout.split() == ["FtlaunchRendezvousHandler", "ftlaunch", "r-rg0"]
        assert "Exception while registering" not in res.stderr


@pytest.mark.timeout(150)
def test_torchrun_groups_one_of_them_two_nodes(tmp_path) -> None:
    """Three torchruns: group 0 (1 node) and group 1 (2 nodes, one worker each) against one endpoint.

    No lighthouse runs at the endpoint, so the node on the endpoint host starts one. Group 1's rank 1
    fails once: both of group 1's nodes restart (their own rendezvous), group 0 never does.
    """
    lighthouse_port, group_port = free_port(), free_port()
    out = str(tmp_path)
    endpoint = f"127.0.0.1:{lighthouse_port}"
    # Group 0 lingers until all 5 records exist (2 + 2 restarted in group 1, 1 of its own), so the
    # lighthouse, whoever hosts it, is up while every worker probes it.
    common = [
        "--rdzv-backend",
        "ftlaunch",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "rdzvtest",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.1",
    ]
    worker_args = [WORKER, "--out", out, "--probe-lighthouse", "--check-torch", "--step-time", "0.05"]
    # The job token (token= in --rdzv-conf): the hosted lighthouse requires it, every worker gets it.
    g0 = start(
        [
            *TORCHRUN,
            *common,
            "--rdzv-conf",
            "replica_group_id=0,num_replica_groups=2,lighthouse_linger=30,token=tok",
            *worker_args,
            "--steps",
            "3",
            "--wait-records",
            "5",
        ]
    )
    g1 = [
        start(
            [
                *TORCHRUN,
                *common,
                "--nnodes",
                "2",
                "--rdzv-conf",
                f"replica_group_id=1,num_replica_groups=2,group_endpoint=127.0.0.1:{group_port},"
                # rank 0 outlives rank 1's failure (as it would, blocked in a collective), so its
                # agent sees the new round and restarts too instead of finishing alone
                "lighthouse_linger=30,token=tok",
                *worker_args,
                "--steps",
                "40",
                "--fail-group",
                "1",
                "--fail-rank",
                "1",
                "--fail-step",
                "1",
                "--fail-restarts",
                "all",
                "--fail-once",
            ]
        )
        for _ in range(2)
    ]
    results = [finish(p, timeout=100) for p in (g0, *g1)]
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    recs = records(out)
    # Group 0 ran once. Group 1 ran twice on both nodes: the failing node restarts (restart count 1),
    # the other follows the new round (a membership change, which torchelastic does not count).
    assert [(r["rank"], r["restart"]) for r in recs if r["group"] == 0] == [(0, 0)]
    g1 = [r for r in recs if r["group"] == 1]
    assert len(g1) == 4 and sorted(r["rank"] for r in g1) == [0, 0, 1, 1], g1
    assert max(r["restart"] for r in g1) == 1
    assert len({r["pid"] for r in g1}) == 4
    lighthouse_urls = {r["env"]["FTLAUNCH_LIGHTHOUSE"] for r in recs}
    assert lighthouse_urls == {f"http://127.0.0.1:{lighthouse_port}"}
    assert {r["lighthouse_status_address"] for r in recs} == lighthouse_urls  # a lighthouse really answered
    for r in recs:
        e = r["env"]
        assert r["is_torchelastic_launched"] is True
        assert e["NUM_REPLICA_GROUPS"] == "2"
        assert e["TORCHELASTIC_RUN_ID"] == f"rdzvtest-rg{r['group']}"
        assert e["WORLD_SIZE"] == ("1" if r["group"] == 0 else "2")
        assert e["GROUP_RANK"] == e["RANK"]  # one worker per node
        assert e["FTLAUNCH_TOKEN"] == "tok" and r["lighthouse_token_accepted"] is True
    # Each group has its own store: group 1's two nodes share one, group 0's is different.
    g0_port = next(r["env"]["MASTER_PORT"] for r in recs if r["group"] == 0)
    assert g0_port not in {r["env"]["MASTER_PORT"] for r in g1}
    hosts = [r for r in results if "hosts one at" in r.stderr]
    assert len(hosts) == 1, "exactly one node must have started the lighthouse"
    assert os.path.isdir(out)


# ~30 s; a group started during an outage: tests/processes/test_group_starts_during_outage.py runs in CI
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_agent_the_supervisor_respawned_waits_out_a_lighthouse_outage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``FTLAUNCH_LIGHTHOUSE_REACHED=1`` (the supervisor reached the lighthouse before): an
    unreachable lighthouse is waited for up to ``FTLAUNCH_LIGHTHOUSE_OUTAGE``, not ``lighthouse_timeout``."""
    import threading
    import time

    from ftlaunch.lighthouse.server import LighthouseServer

    port = free_port()
    monkeypatch.setenv("FTLAUNCH_LIGHTHOUSE_REACHED", "1")
    monkeypatch.setenv("FTLAUNCH_LIGHTHOUSE_OUTAGE", "30")
    conf = {
        "replica_group_id": "0",
        "num_replica_groups": "1",
        "lighthouse_timeout": "1",
        "start_lighthouse": "false",
    }
    handler = create_rdzv_handler(_params(conf, endpoint=f"127.0.0.1:{port}"))
    servers: list[LighthouseServer] = []
    later = threading.Timer(3.0, lambda: servers.append(LighthouseServer(f"127.0.0.1:{port}").start()))
    later.start()
    started = time.monotonic()
    try:
        assert handler._ensure_lighthouse() == f"http://127.0.0.1:{port}"  # noqa: SLF001 - the wait itself
        assert time.monotonic() - started >= 2.5  # it did wait past lighthouse_timeout
    finally:
        later.join()
        for s in servers:
            s.shutdown()
        handler.shutdown()
    monkeypatch.delenv("FTLAUNCH_LIGHTHOUSE_REACHED")
    handler = create_rdzv_handler(_params(conf, endpoint=f"127.0.0.1:{free_port()}"))
    try:
        with pytest.raises(RendezvousConnectionError, match="within 1s"):
            handler._ensure_lighthouse()  # noqa: SLF001 - without the launcher's word: lighthouse_timeout
    finally:
        handler.shutdown()


def test_every_node_of_a_round_gets_rank_0s_incarnation_and_workers_store() -> None:
    """Rank 0 counts the group's rounds in the store that outlives them and hands the count and
    its workers' store to the other nodes in the round's own store -- not under torch's
    MASTER_ADDR/MASTER_PORT keys, which the inner rendezvous already set to its own store."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

    from ftlaunch.launcher.rendezvous import FtlaunchRendezvousHandler

    cfg = FtRendezvousConfig(replica_group_id=1, num_replica_groups=2)
    rounds = dist.HashStore()
    nodes = [FtlaunchRendezvousHandler(cfg, None, "", "r-rg1", rounds_store=rounds) for _ in range(2)]  # type: ignore[arg-type]
    seen = []
    for _ in range(2):  # two rounds; the node that is rank 0 has its own round count, the other not
        store = dist.HashStore()
        store.set_timeout(timedelta(seconds=5))
        store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, "inner-store-host")  # the inner rendezvous's
        store.set(RendezvousStoreInfo.MASTER_PORT_KEY, "1")
        boot = RendezvousStoreInfo("unused", 0)
        got0 = nodes[0]._round(RendezvousInfo(store, 0, 2, boot), "127.0.0.1")  # its own address
        got1 = nodes[1]._round(RendezvousInfo(store, 1, 2, boot), "10.0.0.6")
        assert got0 == got1
        seen.append(got0)
    (inc_a, boot_a), (inc_b, boot_b) = seen
    assert (inc_a, inc_b) == (0, 1)
    assert boot_a.master_addr == boot_b.master_addr == "127.0.0.1"  # rank 0's, as published
    assert boot_b.master_port == nodes[0]._worker_store.port != boot_a.master_port  # a fresh store
    nodes[0]._worker_store = None


def test_the_health_check_runs_before_the_round_and_keeps_the_group_out_until_it_passes(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``health_check`` (or ``FTLAUNCH_HEALTH_CHECK``): the handler runs it before every round --
    torchelastic's agent rendezvouses before each start and restart of its workers -- and goes on
    to the group's own rendezvous only once it passed; the lighthouse has the reports."""
    import os

    from ftlaunch.launcher.rendezvous import FtlaunchRendezvousHandler
    from ftlaunch.lighthouse.server import LighthouseServer

    count = tmp_path / "count"
    check = (
        f"n=$(cat {count} 2>/dev/null || echo 0); echo $((n+1)) > {count}; [ $n -ge 1 ] || {{ echo "
        f"'disk full'; exit 1; }}"
    )
    monkeypatch.setenv("FTLAUNCH_HEALTH_CHECK", check)
    monkeypatch.setenv("FTLAUNCH_HEALTH_CHECK_TIMEOUT", "20s")
    # A standby announced already: the handler starts none of its own (not what this test is about).
    monkeypatch.setenv("FTLAUNCH_ZYGOTE_SOCKET", str(tmp_path / "standby.sock"))
    cfg = FtRendezvousConfig.from_params(_params({"replica_group_id": "1", "num_replica_groups": "2"}))
    assert (cfg.health_check, cfg.health_check_timeout) == (check, 20.0)
    explicit = FtRendezvousConfig.from_params(
        _params(
            {
                "replica_group_id": "1",
                "num_replica_groups": "2",
                "health_check": "true",
                "health_check_timeout": "1m",
            }
        )
    )
    assert (explicit.health_check, explicit.health_check_timeout) == ("true", 60.0)  # the keys win
    with pytest.raises(ConfigurationError, match="health_check_timeout='0' "):
        FtRendezvousConfig.from_params(
            _params({"replica_group_id": "1", "num_replica_groups": "2", "health_check_timeout": "0"})
        )

    class Inner:
        runs_seen: list[str] = []

        def next_rendezvous(self):  # type: ignore[no-untyped-def]
            self.runs_seen.append(count.read_text().strip())
            raise RuntimeError("stop here")  # the rest of the round is tested above

    saved = dict(os.environ)
    try:
        with LighthouseServer("127.0.0.1:0") as server:
            handler = FtlaunchRendezvousHandler(cfg, Inner(), "", "t", local_addr="127.0.0.1")  # type: ignore[arg-type]
            handler._lighthouse_addr = server.address
            with pytest.raises(RuntimeError, match="stop here"):
                handler.next_rendezvous()
            assert Inner.runs_seen == ["2"]  # failed once, passed the second time, then the round
            (health,) = server.snapshot().health
            assert (health.replica_id, health.ok, health.failures) == ("rg1", True, 1)
    finally:
        os.environ.clear()
        os.environ.update(saved)


STANDBY_SCRIPT = """
import json, os, sys, time
had_torch = "torch" in sys.modules  # before the script's first line: imported by whoever forked it
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
record = {"pid": os.getpid(), "ppid": os.getppid(), "had_torch": had_torch,
          "torchelastic_pid": int(os.environ.get("FTLAUNCH_WORKER_PID") or os.getpid())}
path = os.path.join(sys.argv[1], "restart" + restart + ".json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
while True:  # until killed
    time.sleep(0.05)
"""


@pytest.mark.timeout(240)
def test_torchrun_restarts_a_killed_worker_from_the_nodes_standby_which_dies_with_the_agent(
    tmp_path: Path,
) -> None:
    """``torchrun --rdzv-backend ftlaunch ... -m ftlaunch.run SCRIPT``: the rendezvous keeps a warm
    standby interpreter on the node (`ftlaunch.launcher.standby`); the worker torchelastic starts
    hands the script to it, so the script runs in a process the standby forked, torch imported
    before its first line. A SIGKILLed worker's replacement is forked from the same standby. Then
    torchrun's agent is SIGKILLed: the standby, the workers and their Baby children all end."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "sleeper.py"
    script.write_text(STANDBY_SCRIPT)
    port = free_port()
    agent = start(
        [*TORCHRUN, "--rdzv-backend", "ftlaunch", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
         "standby",
         "--rdzv-conf", "replica_group_id=0,num_replica_groups=1", "--nproc-per-node", "1", "--max-restarts",
         "2",
         "--monitor-interval", "0.1", "-m", "ftlaunch.run", str(script), str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:

        def record(n: int) -> dict:
            wait_for(
                lambda: (out / f"restart{n}.json").exists() or agent.poll() is not None, 150, f"worker {n}"
            )
            assert agent.poll() is None, agent.communicate()[1][-3000:]
            return json.loads((out / f"restart{n}.json").read_text())

        first = record(0)
        standby = psutil.Process(first["ppid"])
        assert "ftlaunch.bootstrap.zygote" in standby.cmdline() and standby.ppid() == agent.pid
        assert first["pid"] != first["torchelastic_pid"] and first["had_torch"]
        os.kill(first["torchelastic_pid"], signal.SIGKILL)  # the worker torchelastic knows

        second = record(1)
        # The replacement: forked by the same standby (torch imported before its first line), proxied
        # by the new process torchelastic started.
        assert second["ppid"] == standby.pid and second["had_torch"], second
        assert second["torchelastic_pid"] != first["torchelastic_pid"]
        assert psutil.Process(second["torchelastic_pid"]).ppid() == agent.pid

        socket_path = standby.cmdline()[standby.cmdline().index("ftlaunch.bootstrap.zygote") + 1]
        tree = psutil.Process(agent.pid).children(recursive=True)
        assert {standby.pid, second["pid"], second["torchelastic_pid"]} <= {p.pid for p in tree}
        assert psutil.Process(second["pid"]).children(), "the worker's Baby child, forked from it"
        os.kill(agent.pid, signal.SIGKILL)
        agent.communicate(timeout=30)
        _, left = psutil.wait_procs(tree, timeout=15)
        assert not left, [(p.pid, p.cmdline()[:5]) for p in left if p.is_running()]
        assert not os.path.exists(os.path.dirname(socket_path))  # the standby removed its socket
    finally:
        kill_tree(agent.pid)
        if agent.poll() is None:
            agent.communicate(timeout=30)
