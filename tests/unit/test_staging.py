"""Staging a state dict off the training tensors (ftlaunch.checkpointing.staging), in one process."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from ftlaunch.checkpointing.serialization.encode import encode
from ftlaunch.checkpointing.staging import stage
from ftlaunch.worker.progress import state_checksum


def model_state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model(torch.randn(8, 4))  # BatchNorm statistics and its counter change
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "pos": {"epoch": 2, "lr": 0.5}}


def test_the_copy_is_the_state_at_the_call_and_nothing_changes_it_later() -> None:
    live = model_state()
    before = state_checksum(live)
    staged = stage(live, step=7)
    assert staged.step == 7 and state_checksum(staged.state) == before
    assert staged.nbytes == sum(e.nbytes for e in encode(live, 0).header.tensors)  # every tensor once
    # The next forward pass changes the training tensors in place: the copy keeps the old state.
    for t in live["model"].values():
        t.add_(1)
    assert state_checksum(staged.state) == before != state_checksum(live)
    assert (
        staged.state["pos"] == {"epoch": 2, "lr": 0.5}
        and staged.state["optim"]["param_groups"][0]["lr"] == 0.1
    )
    staged.wait()  # nothing to wait for on CPU


def test_the_tree_types_tied_tensors_layout_and_requires_grad_are_kept() -> None:
    w = torch.arange(6.0).reshape(2, 3)
    p = nn.Parameter(torch.ones(3))
    tree = {
        "a": collections.OrderedDict(w=w, tied=w, t=w.t()),
        "b": [p, (1, "x", None)],
        "c": collections.defaultdict(list, k=[torch.zeros(2)]),
    }
    out = stage(tree, step=0).state
    assert type(out["a"]) is collections.OrderedDict and type(out["b"]) is list and type(out["b"][1]) is tuple
    assert type(out["c"]) is collections.defaultdict and out["c"].default_factory is list
    assert out["a"]["w"] is out["a"]["tied"] and out["a"]["w"] is not w  # tied weights stay tied, one copy
    assert out["a"]["t"].is_contiguous() and torch.equal(out["a"]["t"], w.t())  # what a transport sends
    assert out["b"][0].requires_grad and out["b"][0].is_leaf and out["b"][0].data_ptr() != p.data_ptr()
    assert encode(out, 0).header.body_nbytes == encode(tree, 0).header.body_nbytes  # the same payload


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: stages GPU tensors")
def test_gpu_tensors_are_copied_on_the_current_stream_and_waited_for() -> None:
    """The copy is queued on the training thread's stream, before the next forward's kernels; a
    reader on another thread waits for it (the event) before reading."""
    x = torch.randn(1 << 22, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        staged = stage({"x": x}, step=1)
        x.mul_(2)  # the next forward pass, on the same stream: after the copy
    staged.wait()
    assert staged.state["x"].device == x.device
    torch.cuda.synchronize()
    assert torch.equal(staged.state["x"] * 2, x)
