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
    # ManagedProcessGroup lives with the Manager's code (ftlaunch.process_group.managed); it is
    # exported here lazily, as in torchft, without importing the Manager at package import.
    if name == "ManagedProcessGroup":
        from ftlaunch.process_group.managed import ManagedProcessGroup

        return ManagedProcessGroup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
