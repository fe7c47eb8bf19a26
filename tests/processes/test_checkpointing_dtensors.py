"""Sharded state (DTensors) in live recovery: local shards travel with a JSON spec and are rebuilt on
the receiver's mesh; a different sharding is refused, naming the tensor and both layouts.

The unit tests run in this process on a one-rank mesh; the last test heals real FSDP2 shards between
two groups of two ranks (four spawned processes, Gloo) over PGTransport.
"""

from __future__ import annotations

import collections
import hashlib
import os
import traceback
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_checkpointing_http import CTX, with_timeout_join
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ftlaunch.checkpointing import dtensors
from ftlaunch.checkpointing.dtensors import ShardSpec
from ftlaunch.errors import CheckpointTransportError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def _state(mesh: DeviceMesh) -> dict[str, Any]:
    w = distribute_tensor(torch.arange(12.0).view(4, 3), mesh, [Shard(0)])
    b = distribute_tensor(torch.ones(3), mesh, [Replicate()])
    return {
        "model": collections.OrderedDict(w=w, b=b),
        "optim": {"state": {0: {"exp_avg": w * 2, "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "pair": (w, 7),
    }


def test_split_then_join_rebuilds_the_dtensors_on_the_mesh(mesh: DeviceMesh) -> None:
    state = _state(mesh)
    plain, specs = dtensors.split(state)
    assert isinstance(state["model"]["w"], DTensor)  # the caller's state is not modified
    assert not any(
        isinstance(t, DTensor) for t in (plain["model"]["w"], plain["optim"]["state"][0]["exp_avg"])
    )
    assert [s.path for s in specs] == [
        ("model", "w"),
        ("model", "b"),
        ("optim", "state", 0, "exp_avg"),
        ("pair", 0),
    ]
    wire = dtensors.specs_to_json(specs)  # plain JSON values: what the serialization carries
    back = dtensors.join(plain, dtensors.specs_from_json(wire), mesh)
    assert type(back["model"]) is collections.OrderedDict and type(back["pair"]) is tuple
    for path in (("model", "w"), ("model", "b"), ("optim", "state", 0, "exp_avg")):
        got, want = _at(back, path), _at(state, path)
        assert isinstance(got, DTensor) and got.placements == want.placements and got.device_mesh is mesh
        assert torch.equal(got.full_tensor(), want.full_tensor())
    assert not isinstance(back["optim"]["state"][0]["step"], DTensor)


def _at(x: Any, path: tuple) -> Any:
    for k in path:
        x = x[k]
    return x


def test_without_a_mesh_the_template_gives_it(mesh: DeviceMesh) -> None:
    plain, specs = dtensors.split(_state(mesh))
    back = dtensors.join(plain, specs, None, template=_state(mesh))
    assert back["model"]["w"].device_mesh is mesh
    with pytest.raises(
        CheckpointTransportError, match=r"at state_dict\['model'\]\['w'\] but know no device mesh"
    ):
        dtensors.join(plain, specs, None)


def test_a_different_sharding_is_refused(mesh: DeviceMesh) -> None:
    plain, specs = dtensors.split(_state(mesh))
    template = _state(mesh)
    template["model"]["w"] = distribute_tensor(torch.zeros(4, 3), mesh, [Replicate()])
    with pytest.raises(
        CheckpointTransportError,
        match=r"refusing the DTensor at state_dict\['model'\]\['w'\]: the "
        r"replica groups shard it differently \(sender: mesh \[1\] \['dp_shard'\] at \[0\], "
        r"placements \[Shard\(dim=0\)\].*here: .*placements \[Replicate\(\)\]",
    ):
        dtensors.join(plain, specs, mesh, template=template)


@pytest.mark.parametrize(
    "change, what",
    [
        ({"mesh_shape": [2], "coordinate": [0]}, r"mesh \[1\] \['dp_shard'\] at \[0\]\)"),
        ({"mesh_dim_names": ["tp"]}, r"mesh \[1\] \['dp_shard'\] at \[0\]\)"),
        ({"shape": [6, 3], "stride": [3, 1]}, r"mesh .*, local shard \[6, 3\] \(received \[4, 3\]\)"),
    ],
    ids=["mesh shape", "dimension names", "global shape"],
)
def test_a_spec_from_another_layout_is_refused(mesh: DeviceMesh, change: dict, what: str) -> None:
    plain, specs = dtensors.split(_state(mesh))
    wire = dtensors.specs_to_json(specs)
    wire[0].update(change)
    with pytest.raises(CheckpointTransportError, match=f"shard it differently.*here: {what}"):
        dtensors.join(plain, dtensors.specs_from_json(wire), mesh)


def test_malformed_specs_are_transport_errors(mesh: DeviceMesh) -> None:
    plain, specs = dtensors.split(_state(mesh))
    for bad in (
        {"path": ["model", "w"]},
        {**specs[0].to_json(), "placements": [["partial"]]},
        {**specs[0].to_json(), "coordinate": [-1]},
        {**specs[0].to_json(), "path": ["nowhere"]},
    ):
        with pytest.raises(CheckpointTransportError):
            dtensors.join(plain, dtensors.specs_from_json([bad]), mesh)
    with pytest.raises(CheckpointTransportError, match="not a list of objects"):
        dtensors.specs_from_json([1])


def test_a_pending_reduction_cannot_be_sent(mesh: DeviceMesh) -> None:
    partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    with pytest.raises(TypeError, match=r"state_dict\['g'\]: placement P\(sum\) is not Shard or Replicate"):
        dtensors.split({"g": partial})
    assert (
        ShardSpec.of(distribute_tensor(torch.ones(2), mesh, [Shard(0)]), ("x",))
        .describe()
        .startswith("mesh [1]")
    )


# --------------------------------------------------------------------------------------------------
# real shards: two groups of two ranks, FSDP2 in each, PGTransport between rank r and rank r


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5))


def _trained(
    mesh: DeviceMesh, seed: int, shard_dim: int = 0
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    place = (lambda p: Shard(shard_dim if p.ndim > shard_dim else 0)) if shard_dim else None
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, shard_placement_fn=place)
    fully_shard(model, mesh=mesh, shard_placement_fn=place)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


def _digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.full_tensor().detach().numpy().tobytes())
    for s in opt.state.values():
        h.update(s["exp_avg"].full_tensor().numpy().tobytes() + s["step"].numpy().tobytes())
    return h.hexdigest()


def _heal_worker(rank: int, port: int, q: Any) -> None:
    from ftlaunch.checkpointing import PGTransport

    try:
        store = dist.TCPStore("127.0.0.1", port, 4, False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        crosses = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        g, r = divmod(rank, 2)
        mesh = DeviceMesh.from_group(groups[g], "cpu", mesh_dim_names=("dp_shard",))
        cross = crosses[r]
        timeout = timedelta(seconds=30)
        out: dict[str, str] = {}
        if g == 0:
            model, opt = _trained(mesh, seed=0)
            t: PGTransport = PGTransport(cross, timeout, torch.device("cpu"))
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            for _ in range(3):  # fresh, in place, to a group sharded differently
                t.send_checkpoint([1], 4, state, timeout)
            out["digest"] = _digest(model, opt)
        else:
            model, opt = _trained(mesh, seed=1)
            fresh: PGTransport = PGTransport(cross, timeout, torch.device("cpu"), device_mesh=mesh)
            got = fresh.recv_checkpoint(0, "<pg>", 4, timeout)
            out["fresh_is_dtensor"] = str(isinstance(got["model"]["0.weight"], DTensor))
            model.load_state_dict(got["model"])
            opt.load_state_dict(got["optim"])
            out["digest"] = _digest(model, opt)
            mine = {"model": model.state_dict(), "optim": opt.state_dict()}
            ptr = mine["model"]["0.weight"].to_local().data_ptr()
            in_place: PGTransport = PGTransport(cross, timeout, torch.device("cpu"), state_dict=lambda: mine)
            again = in_place.recv_checkpoint(0, "<pg>", 4, timeout)
            out["in_place"] = str(again["model"]["0.weight"].to_local().data_ptr() == ptr)
            other, _ = _trained(mesh, seed=1, shard_dim=1)
            theirs = {"model": other.state_dict(), "optim": opt.state_dict()}
            try:
                PGTransport(cross, timeout, torch.device("cpu"), state_dict=lambda: theirs).recv_checkpoint(
                    0, "<pg>", 4, timeout
                )
                out["mismatch"] = "accepted"
            except CheckpointTransportError as e:
                out["mismatch"] = str(e)
        dist.barrier()
        q.put((rank, out))
    except BaseException as e:  # reported to the test
        q.put((rank, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}))
    q.close()
    q.join_thread()
    os._exit(0)


@pytest.mark.timeout(240)
def test_fsdp2_shards_heal_rank_by_rank_over_pg_transport() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 4, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    q = CTX.Queue()
    procs = [CTX.Process(target=_heal_worker, args=(r, store.port, q), daemon=True) for r in range(4)]
    for p in procs:
        p.start()
    try:
        res = dict(q.get(timeout=200) for _ in range(4))
    finally:
        for p in procs:
            with_timeout_join(p)
    for rank, out in res.items():
        assert "error" not in out, (rank, out["error"])
    assert (
        res[0]["digest"] == res[1]["digest"] == res[2]["digest"] == res[3]["digest"]
    )  # full weights + Adam state
    assert res[2]["fresh_is_dtensor"] == res[3]["fresh_is_dtensor"] == "True"
    assert res[2]["in_place"] == res[3]["in_place"] == "True"
    for rank in (2, 3):
        assert "the replica groups shard it differently" in res[rank]["mismatch"], res[rank]["mismatch"]
        assert (
            "placements [Shard(dim=0)]" in res[rank]["mismatch"] and "Shard(dim=1)" in res[rank]["mismatch"]
        )
