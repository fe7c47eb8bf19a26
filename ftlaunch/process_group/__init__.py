"""Reconfigurable process groups (torchft's API): membership changes in place via ``configure``."""

from __future__ import annotations

from ftlaunch.process_group._store import create_store_client, parse_store_addr
from ftlaunch.process_group.baby import ProcessGroupBaby, ProcessGroupBabyGloo, ProcessGroupBabyNCCL
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.process_group.device_mesh import extend_device_mesh
from ftlaunch.process_group.wrappers import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupWrapper,
)

__all__ = [
    "ErrorSwallowingProcessGroupWrapper",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupWrapper",
    "create_store_client",
    "extend_device_mesh",
    "parse_store_addr",
]


def __getattr__(name: str) -> object:
    # torchft's path (`from torchft.process_group import ManagedProcessGroup`). The class reduces
    # through the Manager, so it lives a layer above, in ftlaunch.worker.managed_pg; this alias is
    # resolved on attribute access only, never when this package is imported.
    if name == "ManagedProcessGroup":
        from ftlaunch.worker.managed_pg import ManagedProcessGroup

        return ManagedProcessGroup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
