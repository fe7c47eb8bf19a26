"""Fault-tolerant HSDP's pieces in one process: FSDP2 on a one-rank group mesh, the Manager on the
fakes of tests/unit/test_manager_protocol.py (a FakeProcessGroup is a world of identical peers: SUM
multiplies by its size), so the cross-group average is checked exactly.

The multi-process runs (2 groups x 2 workers, kills, healing) are in tests/processes/test_train_hsdp.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import test_manager_protocol
import torch
import torch.distributed as dist
from test_manager_protocol import Group, ScriptedLighthouse, peer, quorum
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ftlaunch.errors import ConfigurationError
from ftlaunch.lighthouse.quorum import QuorumMember
from ftlaunch.worker import hsdp

pytestmark = pytest.mark.timeout(60)

make = test_manager_protocol.make  # the fixture: a Manager on fakes


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    """The group's mesh of a one-worker replica group (its own one-rank process group)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield hsdp.group_mesh(dist.group.WORLD, "cpu")
    finally:
        dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, width)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


X = torch.arange(12.0).view(3, 4) / 10


def local_grads() -> list[torch.Tensor]:
    net = Net()
    net(X).sum().backward()
    return [p.grad for p in net.parameters()]


def behind_peers(g: Group) -> None:
    """We (rg0) and rg1 are at step 3, rg2 at step 1: two sources, three groups (rg2 heals)."""
    g.m.load_state_dict({"step": 3, "batches_committed": 3})


def test_units_are_the_blocks_then_the_root(mesh: DeviceMesh) -> None:
    net = Net()
    assert hsdp.default_units(net) == list(net.layers)
    hsdp.shard(net, mesh)
    assert hsdp.is_sharded(net) and not hsdp.is_sharded(Net())
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in net.parameters())
    assert len(list(net.parameters())) == 8
    assert hsdp.mesh_of(net) is mesh and not hsdp.replicates_across_groups(mesh)


def test_the_hook_averages_each_units_gradient_shard_over_the_up_to_date_groups(
    mesh: DeviceMesh, make: Callable[..., Group]
) -> None:
    g = make(ScriptedLighthouse(quorum(2, peer("rg1", 3), peer("rg2", 1))))
    behind_peers(g)
    net = hsdp.shard(Net(), mesh)
    assert hsdp.average_across_groups(g.m, net) == 3  # the two blocks and the root (embed, head)
    g.m.start_quorum()
    net(X).sum().backward()
    # Each shard is divided by the 2 sources, then summed over the 3 groups of identical peers.
    for p, want in zip(net.parameters(), local_grads(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), want * 3 / 2)
    assert [op.name for op in g.pg.ops] == ["allreduce"] * 3  # one per unit with parameters
    assert g.m.should_commit()


def test_the_long_form_mesh_gives_fsdp_the_managers_divisor(
    mesh: DeviceMesh, make: Callable[..., Group]
) -> None:
    g = make(ScriptedLighthouse(quorum(2, peer("rg1", 3), peer("rg2", 1))))
    behind_peers(g)
    mesh2 = hsdp.ft_init_device_mesh(
        device_type="cpu",
        mesh_shape=(3, 1),
        mesh_dim_names=("dp_replicate", "dp_shard"),
        replicate_dim=0,
        manager=g.m,
    )
    assert mesh2.mesh_dim_names == ("dp_replicate", "dp_shard") and hsdp.replicates_across_groups(mesh2)
    net = hsdp.shard(Net(), mesh2)  # torch's native HSDP, replicating over the Manager
    g.m.start_quorum()
    net(X).sum().backward()
    for p, want in zip(net.parameters(), local_grads(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), want * 3 / 2)
    with pytest.raises(ConfigurationError, match="FSDP averages across groups itself"):
        hsdp.average_across_groups(g.m, net)
    assert g.m.should_commit()


def test_an_optimizer_built_before_sharding_is_refused(mesh: DeviceMesh) -> None:
    net = Net()
    early = torch.optim.SGD(net.parameters(), lr=0.1)
    hsdp.shard(net, mesh)
    with pytest.raises(ConfigurationError, match="create the optimizer after sharding"):
        hsdp.check_optimizer(net, early)
    hsdp.check_optimizer(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ConfigurationError, match="nothing in the model is sharded"):
        hsdp.average_across_groups(None, Net())  # type: ignore[arg-type]


def test_the_layout_names_what_differs_between_groups(mesh: DeviceMesh) -> None:
    a, b = hsdp.layout_of(hsdp.shard(Net(), mesh)), hsdp.layout_of(hsdp.shard(Net(), mesh))
    assert a == b
    assert a.text.startswith("8 parameters (") and "on mesh [1] ['dp_shard'], placements S(0) x8" in a.text
    assert hsdp.layout_of(hsdp.shard(Net(width=16), mesh)).digest != a.digest
    cols = hsdp.layout_of(hsdp.shard(Net(), mesh, shard_placement_fn=lambda p: Shard(p.ndim - 1)))
    assert cols.digest != a.digest and "S(1) x" in cols.text
    assert "on mesh local" in hsdp.layout_of(Net()).text


def test_a_group_laid_out_unlike_its_sources_refuses_after_reconfiguring(make: Callable[..., Group]) -> None:
    theirs = QuorumMember(
        replica_id="rg1",
        store_address="store-rg1:1",
        step=3,
        data={"ckpt": ["mem://rg1"], "layout": {"digest": "aaaa", "text": "2 parameters on [4]"}},
    )
    lighthouse = ScriptedLighthouse(quorum(5, theirs))
    g = make(lighthouse)
    g.m.require_same_layout("bbbb", "2 parameters on [2]")
    with pytest.raises(
        ConfigurationError,
        match=r"rg0 lays out its state differently from rg1: here 2 parameters on "
        r"\[2\]; there 2 parameters on \[4\]",
    ):
        g.m.start_quorum()  # a first step waits for its quorum: it may heal before its forward pass
    assert lighthouse.asked[0].data["layout"] == {"digest": "bbbb", "text": "2 parameters on [2]"}
    assert len(g.pg.configure_calls) == 1  # the others' rendezvous did not wait for us
    with pytest.raises(ConfigurationError):
        g.m.should_commit()


def test_gradient_accumulation_averages_across_groups_once(
    mesh: DeviceMesh, make: Callable[..., Group]
) -> None:
    """Micro-batches without gradient sync skip the reduce-scatter and so the cross-group average;
    the last one averages the accumulated gradient once."""
    g = make(ScriptedLighthouse(quorum(2, peer("rg1", 3), peer("rg2", 1))))
    behind_peers(g)
    net = hsdp.shard(Net(), mesh)
    hsdp.average_across_groups(g.m, net)
    g.m.start_quorum()
    net.set_requires_gradient_sync(False)
    net(X).sum().backward()
    assert g.pg.ops == []
    net.set_requires_gradient_sync(True)
    net(X).sum().backward()
    assert [op.name for op in g.pg.ops] == ["allreduce"] * 3
    for p, want in zip(net.parameters(), local_grads(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), 2 * want * 3 / 2)
    assert g.m.should_commit()


def test_the_sharded_state_is_read_without_resharding_what_the_forward_pass_uses(mesh: DeviceMesh) -> None:
    """The Manager snapshots the state on its quorum thread during the forward pass: the snapshot
    must not touch FSDP's parameters (``model.state_dict()`` reshards them: the hazard)."""
    net = hsdp.shard(Net(), mesh, reshard_after_forward=False)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(X).sum().backward()
    opt.step()
    state = hsdp.ShardedState(net, opt)
    net(X)  # the forward pass leaves every unit unsharded (reshard_after_forward=False)
    gathered = net.embed.weight
    assert not isinstance(gathered, DTensor)
    snap = state.state_dict()
    assert net.embed.weight is gathered  # untouched
    assert set(snap["model"]) == set(Net().state_dict()) and isinstance(
        snap["model"]["embed.weight"], DTensor
    )
    assert torch.equal(snap["model"]["embed.weight"].full_tensor(), gathered)
    assert snap["optim"]["state"][0]["step"] == 1
    net.state_dict()
    assert net.embed.weight is not gathered  # what state_dict() does, and the snapshot must not
    state.load_state_dict(snap)  # on the training thread, after the vote
