"""Reconfigurable process groups (torchft's API): membership changes in place via ``configure``.

Why a folder of its own: the cross-replica-group collectives of a training step run on these
groups, and a peer's death must become a `CommunicationError` and a reconfigure, never a hang.
They know nothing of the Manager or the lighthouse. The layout:

* `base` - `ProcessGroup`, torch's interface plus the lifecycle every group shares; `failures` -
  the error model (the first error of each configuration); `work` - the Work objects ops return;
  `_collectives`, `_composites`, `_overloads`, `_registry` - torch's op names, the composite ops,
  torch's call forms and tables.
* `wrappers` - `ProcessGroupWrapper` and the in-process `ProcessGroupGloo`/`ProcessGroupNCCL`;
  `error_swallowing` and `dummy` - groups that report instead of raising, or do nothing.
* `baby/` - `ProcessGroupBabyGloo`/`ProcessGroupBabyNCCL`, the backend in a child process so abort
  never hangs (`group`; `handle` is the parent's end, `child` the child, `shm` the shared tensors
  between them, `work` a request's Work).
* `_store` - store addresses and clients; `device_mesh` - plugging a group into a DeviceMesh.
* `reconfigure` - torchft's current set-up API (handles, `ReconfigureOptions`,
  `reconfigure_with_store`), which every group implements on top of its ``configure``.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from ftlaunch.addresses import parse_store_addr
from ftlaunch.process_group import _store
from ftlaunch.process_group.baby import ProcessGroupBaby, ProcessGroupBabyGloo, ProcessGroupBabyNCCL
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.process_group.device_mesh import extend_device_mesh
from ftlaunch.process_group.dummy import ProcessGroupDummy
from ftlaunch.process_group.error_swallowing import ErrorSwallowingProcessGroupWrapper

# torchft's name for the error-swallowing wrapper's Work (its tests check the type).
from ftlaunch.process_group.error_swallowing import SwallowingWork as _ErrorSwallowingWork  # noqa: F401
from ftlaunch.process_group.fake_wrapper import FakeProcessGroupWrapper
from ftlaunch.process_group.reconfigure import ReconfigureOptions, reconfigure_with_store

# torchft's private name for parsing a member's rendezvous from its options (its tests import it).
from ftlaunch.process_group.reconfigure import rendezvous_of as _rendezvous  # noqa: F401
from ftlaunch.process_group.wrappers import ProcessGroupGloo, ProcessGroupNCCL, ProcessGroupWrapper

__all__ = [
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupWrapper",
    "PrefixStore",
    "ReconfigureOptions",
    "TCPStore",
    "create_store_client",
    "extend_device_mesh",
    "parse_store_addr",
    "reconfigure_with_store",
]


def create_store_client(store_addr: str, timeout: timedelta | float = timedelta(seconds=60)) -> dist.Store:
    """A client of the TCPStore at ``store_addr`` ("host:port/prefix"), wrapped in a PrefixStore
    when a prefix is given; `CommunicationError` when it cannot connect, ValueError for a malformed
    address.

    ``TCPStore``/``PrefixStore`` are looked up in this module when called, as torchft's
    ``process_group.create_store_client`` does: tests written for torchft patch
    ``process_group.TCPStore`` to see how an address is taken apart.
    """
    return _store.create_store_client(store_addr, timeout, TCPStore, PrefixStore)


def __getattr__(name: str) -> object:
    # torchft's path (`from torchft.process_group import ManagedProcessGroup`). The class reduces
    # through the Manager, so it lives a layer above, in ftlaunch.worker.managed_pg; this alias is
    # resolved on attribute access only, never when this package is imported.
    if name == "ManagedProcessGroup":
        from ftlaunch.worker.managed_pg import ManagedProcessGroup

        return ManagedProcessGroup
    # torchft's path too (`from torchft.process_group import ft_init_device_mesh`): it builds a
    # ManagedProcessGroup, so it lives in ftlaunch.worker.hsdp.
    if name == "ft_init_device_mesh":
        from ftlaunch.worker.hsdp import ft_init_device_mesh

        return ft_init_device_mesh
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
