"""Baby Gloo's shared-memory descriptors (`process_group.baby.shm`), parent and child side in one
process: a storage is shared and described once, not at every op; the child's view of a
descriptor is built once and never outlives the mapping it views."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from ftlaunch.process_group.baby.shm import ChildStorages, SharedTensors, StorageKey


class _Wire:
    """What the parent sends its child: registrations (with a duplicate of the fd) and unregistrations."""

    def __init__(self) -> None:
        self.regs: list[tuple[StorageKey, int, int]] = []
        self.unregs: list[StorageKey] = []

    def reg(self, key: StorageKey, nbytes: int, fd: int) -> None:
        self.regs.append((key, nbytes, os.dup(fd)))

    def unreg(self, keys: list[StorageKey]) -> None:
        self.unregs.extend(keys)

    def deliver(self, child: ChildStorages) -> None:
        for key, nbytes, fd in self.regs:
            child.add(key, nbytes, fd)  # closes fd
        self.regs.clear()
        child.drop(self.unregs)
        self.unregs.clear()


def test_a_storage_is_shared_and_looked_up_once_however_often_it_is_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    share = torch.UntypedStorage._share_fd_cpu_

    def counted(self: torch.UntypedStorage) -> tuple[int, int]:
        calls.append(1)
        return share(self)

    monkeypatch.setattr(torch.UntypedStorage, "_share_fd_cpu_", counted)
    wire = _Wire()
    parent = SharedTensors(wire.reg, wire.unreg)
    bucket = torch.arange(8, dtype=torch.float32)
    descs = [parent.encode(bucket[2:], [], True) for _ in range(5)]
    assert len(calls) == 1 and len(wire.regs) == 1 and len(set(descs)) == 1
    assert descs[0].offset == 2 and descs[0].shape == (6,)
    for _, _, fd in wire.regs:
        os.close(fd)


def test_the_child_reuses_a_descriptors_view_and_writes_land_in_the_parents_tensor() -> None:
    wire = _Wire()
    parent, child = SharedTensors(wire.reg, wire.unreg), ChildStorages()
    bucket = torch.zeros(6)
    desc = parent.encode(bucket[1:4], [], True)
    wire.deliver(child)
    view = child.tensor(desc)
    assert child.tensor(desc) is view  # built once
    view.fill_(7.0)  # what the child's collective writes
    assert bucket.tolist() == [0.0, 7.0, 7.0, 7.0, 0.0, 0.0]


def test_a_dead_storage_is_unregistered_and_its_views_go_with_it() -> None:
    wire = _Wire()
    parent, child = SharedTensors(wire.reg, wire.unreg), ChildStorages()
    bucket = torch.zeros(4)
    desc = parent.encode(bucket, [], True)
    wire.deliver(child)
    child.tensor(desc)
    del bucket
    gc.collect()
    parent.flush_dead()  # the next send does this
    assert wire.unregs == [desc.key]
    wire.deliver(child)
    assert len(child) == 0
    with pytest.raises(KeyError):
        child.tensor(desc)  # no view of an unmapped storage survives
    fresh = torch.ones(4)
    again = parent.encode(fresh, [], True)  # a new storage: registered anew, never a stale key
    assert len(wire.regs) == 1
    wire.deliver(child)
    assert child.tensor(again).tolist() == [1.0] * 4
