"""Baby process groups: the real backend (Gloo, NCCL) runs in a child process, so that an abort is
"kill the child" and never hangs the training process.

`group` decides what to send the child and when to replace it (the process groups users build);
`work` is the Work of one request; `handle` is the parent's end of the child (process, socket,
requests in flight); `child` is the child program; `shm` shares CPU tensors with it.
"""

from __future__ import annotations

from ftlaunch.process_group.baby.group import ProcessGroupBaby, ProcessGroupBabyGloo, ProcessGroupBabyNCCL
from ftlaunch.process_group.baby.work import BabyWork, BabyWorkNCCL

__all__ = ["BabyWork", "BabyWorkNCCL", "ProcessGroupBaby", "ProcessGroupBabyGloo", "ProcessGroupBabyNCCL"]
