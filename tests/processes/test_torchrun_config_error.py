"""``torchrun --rdzv-backend ftlaunch``: a worker that ends on a configuration error stops its agent.

A bad setting (``ftlaunch.ConfigurationError``, raised by ``ftlaunch.init``) is the same at every
restart, so torchelastic's ``--max-restarts`` would only repeat it. The worker records it for the
node's rendezvous (`ftlaunch.errors.install_brief_errors`); when torchrun's agent asks the ``ftlaunch``
rendezvous for the restart's round, the rendezvous closes it instead, naming the error, and the
agent exits non-zero without starting the workers again.
"""

from __future__ import annotations

import json
import os
import re
import sys

import psutil
import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousClosedError
from workers.helpers import finish, free_port, kill_tree, start

from ftlaunch import env
from ftlaunch.errors import ConfigurationError, error_record
from ftlaunch.launcher.rendezvous import FtlaunchRendezvousHandler, FtRendezvousConfig

pytestmark = pytest.mark.timeout(120)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

#: A training script whose ``ftlaunch.init`` refuses its setting; it counts its own starts.
_SCRIPT = """\
import os, sys

import ftlaunch

with open(os.path.join(sys.argv[1], f"start.{os.getpid()}"), "w"):
    pass
ftlaunch.init(backend="baby-mpi")
print("unreachable: init accepted the backend", flush=True)
"""


def test_torchrun_stops_at_a_workers_configuration_error_without_restarting(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    starts = tmp_path / "starts"
    starts.mkdir()
    scratch = tmp_path / "tmp"  # the agent's temporary files: the rendezvous removes its own
    scratch.mkdir()
    port = free_port()
    agent = start(
        [*TORCHRUN, "--rdzv-backend", "ftlaunch", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
         "cfgerr", "--rdzv-conf", "replica_group_id=0,num_replica_groups=1,lighthouse_linger=0",
         "--nproc-per-node", "2", "--max-restarts", "3", "--monitor-interval", "0.1",
         str(script), str(starts)],
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)},
    )  # fmt: skip
    try:
        res = finish(agent, timeout=60)
    finally:
        kill_tree(agent.pid)
    assert res.returncode != 0, res.stderr[-3000:]
    # One attempt: the two workers of the first round (the slower one may be stopped before it
    # counted itself), and no round after it.
    started = sorted(p.name for p in starts.iterdir())
    assert 1 <= len(started) <= 2, (started, res.stderr[-4000:])
    assert "will restart worker group" not in res.stderr, res.stderr[-4000:]
    said = res.stderr.count("ftlaunch: configuration error: backend='baby-mpi' is not one of")
    assert 1 <= said <= len(started), res.stderr[-4000:]
    # The agent's traceback ends on why it stopped, with the worker's one line.
    stop = (
        r"torch\.distributed\.elastic\.rendezvous\.api\.RendezvousClosedError: ftlaunch rendezvous: replica "
        r"group 0 stops instead of restarting: a worker ended on a configuration error, which a restart "
        r"cannot fix: backend='baby-mpi' is not one of .*"
    )
    assert any(re.fullmatch(stop, line) for line in res.stderr.splitlines()), res.stderr[-4000:]
    assert "unreachable" not in res.stdout
    assert not list(scratch.glob("ftlaunch-rdzv-*"))
    left = [p for p in psutil.process_iter(["cmdline"]) if str(starts) in " ".join(p.info["cmdline"] or [])]
    assert not left, left


class _Inner:
    """The group's inner (c10d dynamic) rendezvous, as far as the stop touches it."""

    def __init__(self) -> None:
        self.closed = False

    def set_closed(self) -> None:
        self.closed = True

    def next_rendezvous(self):  # the restart must not get here
        raise AssertionError("a round after the configuration error")


def test_a_nodes_configuration_error_closes_its_groups_rendezvous_for_every_node(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes of one group, sharing its rendezvous store: node 0's worker recorded a
    configuration error, so node 0's restart closes the group's rendezvous and raises with the
    error; node 1's restart raises with the same error, read from the group's store. A node whose
    group stopped on nothing is not stopped."""
    monkeypatch.delenv(env.FTLAUNCH_LIGHTHOUSE_REACHED, raising=False)
    monkeypatch.delenv(env.FTLAUNCH_RENDEZVOUS_ERROR_FILE, raising=False)
    cfg = FtRendezvousConfig(replica_group_id=1, num_replica_groups=2)
    rounds = dist.HashStore()
    inners = [_Inner(), _Inner()]
    nodes = [FtlaunchRendezvousHandler(cfg, inner, "", "r-rg1", rounds_store=rounds) for inner in inners]  # type: ignore[arg-type]
    for node in nodes:
        node._ask_for_configuration_errors()
        node._rounds = 1  # their first round ran
    error_file = env.rendezvous_error_file()
    assert error_file is not None and error_file == nodes[1]._error_file != nodes[0]._error_file
    try:
        nodes[0]._stop_if_misconfigured()  # no error recorded: the restart goes on
        assert not inners[0].closed
        record = error_record(ConfigurationError("backend='baby-mpi' is not one of gloo"), "", 0)
        with open(nodes[0]._error_file or "?", "w") as f:
            json.dump(record, f)
        for node in nodes:
            with pytest.raises(RendezvousClosedError) as got:
                node.next_rendezvous()
            assert str(got.value).endswith(
                "replica group 1 stops instead of restarting: a worker ended on a configuration error, "
                "which a restart cannot fix: backend='baby-mpi' is not one of gloo"
            ), got.value
        assert inners[0].closed and not inners[1].closed  # closed once, for the whole group
    finally:
        files = [node._error_file for node in nodes]
        for node in nodes:
            node._forget_configuration_errors()
    assert not any(os.path.exists(f or "") for f in files)
    assert env.rendezvous_error_file() is None


def test_under_the_ftlaunch_supervisor_the_rendezvous_leaves_errors_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An agent the ``ftlaunch`` supervisor started: the supervisor reads the torchelastic error
    files and stops the whole job, so the rendezvous asks the workers for nothing."""
    monkeypatch.setenv(env.FTLAUNCH_LIGHTHOUSE_REACHED, "1")
    monkeypatch.delenv(env.FTLAUNCH_RENDEZVOUS_ERROR_FILE, raising=False)
    node = FtlaunchRendezvousHandler(FtRendezvousConfig(0, 1), _Inner(), "", "r-rg0")  # type: ignore[arg-type]
    node._ask_for_configuration_errors()
    assert env.rendezvous_error_file() is None
