"""The torchft names and behaviours that torchft's own shipped tests (and users' tests written like
them) rely on, each checked here in one process against ftlaunch: the cases of
scripts/port_torchft_tests.py that matter, written anew."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
from collections.abc import Iterator
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ftlaunch.process_group as process_group
from ftlaunch.checkpointing import HTTPTransport
from ftlaunch.coordination import LighthouseClient, LighthouseServer, Quorum, QuorumMember
from ftlaunch.errors import CheckpointTransportError, CheckpointUnreachableError
from ftlaunch.local_sgd import extract_local_tensor
from ftlaunch.manager import _ManagedWork
from ftlaunch.process_group import (
    FakeProcessGroupWrapper,
    ProcessGroupGloo,
    ReconfigureOptions,
    create_store_client,
    reconfigure_with_store,
)
from ftlaunch.process_group.fake import FakeProcessGroup
from ftlaunch.process_group.reconfigure import rendezvous_of
from ftlaunch.work import _DummyWork
from ftlaunch.worker.allreduce import torchft_positional
from ftlaunch.worker.fragments import Fragment


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server
    del server


def test_fake_process_group_wrapper_fails_the_next_allreduce_only(store: dist.TCPStore) -> None:
    pg = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=timedelta(seconds=10)))
    reconfigure_with_store(pg, f"127.0.0.1:{store.port}/a", 0, 1)
    t = torch.ones(2)
    assert pg.allreduce([t], dist.AllreduceOptions()).wait()
    injected = RuntimeError("injected allreduce error")
    pg.report_future_error(injected)
    work = pg.allreduce([t], dist.AllreduceOptions())
    with pytest.raises(RuntimeError, match="injected allreduce error"):
        work.wait()
    with pytest.raises(RuntimeError, match="injected allreduce error"):
        work.get_future().wait()
    assert pg.allreduce([t], dist.AllreduceOptions()).wait()  # one error, one allreduce
    pg.report_future_error(injected)
    reconfigure_with_store(pg, f"127.0.0.1:{store.port}/b", 0, 1)  # a reconfigure forgets it
    assert pg.allreduce([t], dist.AllreduceOptions()).wait()
    pg.shutdown()


def test_an_errored_group_says_it_is_aborted() -> None:
    pg = FakeProcessGroup()
    pg.fail_next("allreduce", RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        pg.allreduce([torch.ones(1)], dist.AllreduceOptions()).wait()
    err = pg.errored()
    assert err is not None and "aborted" in str(err) and "Connection closed by peer" in str(err)


@pytest.mark.parametrize(
    ("addr", "host", "port", "prefix"),
    [
        ("localhost:1234/my/prefix", "localhost", 1234, "my/prefix"),
        ("[fdaa::6]:29521/ftlaunch/0/1", "fdaa::6", 29521, "ftlaunch/0/1"),
    ],
)
def test_create_store_client_uses_the_module_store_classes(
    addr: str, host: str, port: int, prefix: str
) -> None:
    with (
        mock.patch("ftlaunch.process_group.TCPStore") as tcp_store,
        mock.patch("ftlaunch.process_group.PrefixStore") as prefix_store,
    ):
        create_store_client(addr, timeout=timedelta(seconds=1))
    kwargs = tcp_store.call_args.kwargs
    assert (kwargs["host_name"], kwargs["port"]) == (host, port)
    assert prefix_store.call_args.args[0] == prefix
    assert process_group.TCPStore is dist.TCPStore


def test_reconfigure_with_store_uses_the_patchable_store_client() -> None:
    with mock.patch("ftlaunch.process_group.create_store_client") as create:
        create.return_value.multi_get.return_value = [b"42", b"peer", b"self"]
        pg = mock.Mock()
        pg.get_reconfigure_handle.return_value = "self"
        reconfigure_with_store(pg, "host:123/prefix", 1, 2, timedelta(seconds=7))
    create.assert_called_once_with("host:123/prefix", timedelta(seconds=7))
    (opts,) = pg.reconfigure.call_args.args
    assert (opts.uuid, opts.handles) == (42, ["peer", "self"])


def test_only_the_first_handle_names_a_store_that_is_used() -> None:
    mine = json.dumps({"id": "me", "store": "127.0.0.1:4000", "global_rank": None})
    placeholder = json.dumps({"id": "missing", "store": "unused", "global_rank": None})
    opts = ReconfigureOptions()
    opts.uuid = 1
    opts.handles = [mine, placeholder]
    r = rendezvous_of(opts, "me")
    assert (r.store_addr, r.rank, r.world_size) == ("127.0.0.1:4000/ftlaunch/reconfigure/1", 0, 2)
    opts.handles = [placeholder, mine]
    with pytest.raises(ValueError, match="unused"):
        rendezvous_of(opts, "me")


def test_an_unreachable_checkpoint_server_is_also_a_urlerror() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with HTTPTransport(timeout=timedelta(seconds=5), num_chunks=0) as transport:
        with pytest.raises(urllib.error.URLError, match="urlopen error") as info:
            transport.recv_checkpoint(src_rank=0, metadata=dead, step=1, timeout=timedelta(seconds=2))
    assert isinstance(info.value, CheckpointTransportError) and isinstance(
        info.value, CheckpointUnreachableError
    )


def test_dtensors_travel_over_http() -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("dp_shard",))
        state = {
            "w": distribute_tensor(torch.arange(6.0).view(3, 2), mesh, [Shard(0)]),
            "b": distribute_tensor(torch.ones(2), mesh, [Replicate()]),
            "plain": torch.tensor([1, 2]),
            "step": 3,
        }
        with HTTPTransport(timeout=timedelta(seconds=10), num_chunks=0, device_mesh=mesh) as transport:
            transport.send_checkpoint(dst_ranks=[1], step=5, state_dict=state)
            got = transport.recv_checkpoint(src_rank=0, metadata=transport.metadata(), step=5)
        assert isinstance(got["w"], DTensor) and got["w"].placements == (Shard(0),)
        assert torch.equal(got["w"].full_tensor(), state["w"].full_tensor())
        assert isinstance(got["b"], DTensor) and torch.equal(got["b"].to_local(), torch.ones(2))
        assert torch.equal(got["plain"], state["plain"]) and got["step"] == 3
    finally:
        dist.destroy_process_group()


def test_allreduce_takes_torchfts_positional_should_quantize() -> None:
    assert torchft_positional("avg", False) == ("avg", False)  # ftlaunch's order
    assert torchft_positional(True, dist.ReduceOp.SUM) == (dist.ReduceOp.SUM, True)  # torchft's
    assert torchft_positional(False, False) == ("avg", False)
    assert torchft_positional(4, "sum") == ("sum", 4)
    with pytest.raises(TypeError):
        torchft_positional("avg", "sum")


def test_local_sgd_helpers_users_reach() -> None:
    t = torch.ones(3, requires_grad=True)
    copy = extract_local_tensor(t)
    assert torch.equal(copy, t.detach()) and not copy.requires_grad and copy.data_ptr() != t.data_ptr()
    model = nn.Linear(2, 1)
    fragment = Fragment(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), False)
    fragment.save_parameters()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert torch.equal(fragment.original_parameters["weight"] + 1.0, model.weight.detach())


def test_managed_work_reports_a_failure_and_hands_a_finished_future() -> None:
    manager = mock.Mock()

    class Failing(dist.Work):
        def wait(self, timeout: timedelta | None = None) -> bool:
            raise RuntimeError("Connection closed by peer")

        def get_future(self) -> torch.futures.Future:
            return torch.futures.Future()  # never completes

    buf = torch.zeros(2)
    work = _ManagedWork(manager, Failing(), buf)
    assert work.wait() is False
    manager.report_error.assert_called_once()
    fut = work.get_future()
    assert fut.done() and fut.value() is buf
    ok = _ManagedWork(manager, _DummyWork(buf), None)
    assert ok.wait() and ok.get_future().wait() is buf


def test_coordination_lighthouse_client_speaks_torchfts_form() -> None:
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    try:
        client = LighthouseClient(addr=server.address(), connect_timeout=timedelta(seconds=5))
        q = client.quorum(
            replica_id="a", timeout=timedelta(seconds=5), address="x", step=3, world_size=1, data={"k": 1}
        )
        assert isinstance(q, Quorum) and [m.replica_id for m in q.participants] == ["a"]
        (member,) = q.participants
        assert isinstance(member, QuorumMember) and member.step == 3 and member.data == {"k": 1}
        client.heartbeat("a")
        client.close()
    finally:
        server.shutdown()


def test_a_short_heartbeat_timeout_is_accepted_with_a_warning_and_drops_a_silent_group(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="ftlaunch.lighthouse.server"):
        server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=300)
    assert "heartbeat_timeout=0.3s" in caplog.text and "fewer than 5 beats" in caplog.text
    try:
        client = LighthouseClient(addr=server.address(), connect_timeout=timedelta(seconds=5))
        client.heartbeat("quiet")
        q = client.quorum(replica_id="quiet", timeout=timedelta(seconds=5))
        assert [m.replica_id for m in q.participants] == ["quiet"]
        time.sleep(0.6)  # two timeouts without a beat from "quiet"
        probe = client.quorum(replica_id="probe", timeout=timedelta(seconds=5))
        assert [m.replica_id for m in probe.participants] == ["probe"]
        client.close()
    finally:
        server.shutdown()
    with pytest.raises(Exception, match="heartbeat_timeout"):
        LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=10)
