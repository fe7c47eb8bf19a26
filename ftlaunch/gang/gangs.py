"""`Gangs`: the gangs of each parallelism of a job, and the factories that lay them out.

The layout is fairseq2's. ``create_parallel_gangs(root, tp_size=T)`` puts process ``r`` at data
parallel index ``r // T`` and tensor parallel index ``r % T`` (adjacent ranks - one host - share a
tensor parallel gang); ``create_fsdp_gangs(gangs, intra_node_size=N)`` splits each data parallel
gang into sharded (``sdp``: N adjacent dp ranks) and replicated (``rdp``: every N-th dp rank)
gangs. A dimension of size 1 is a `FakeGang`; one of the root's whole size is the root itself.

Every sub-gang is created from the root gang, each by every process in the same order, because
torch creates process groups collectively over its default group. (fairseq2 creates the HSDP gangs
from the data parallel gang instead, which torch refuses on CPU when tensor parallelism is on.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ftlaunch.gang.base import Gang
from ftlaunch.gang.fake import FakeGang

__all__ = [
    "Gangs",
    "create_fake_gangs",
    "create_fsdp_gangs",
    "create_parallel_gangs",
    "maybe_get_current_gangs",
]


@dataclass(frozen=True, kw_only=True)
class Gangs:
    """The gangs of one process, one per parallelism. Use as a context manager to make them the
    calling thread's current gangs (`maybe_get_current_gangs`)."""

    #: Every process of the job.
    root: Gang
    #: Data parallelism: ``rdp`` x ``sdp``.
    dp: Gang
    #: Replicated data parallelism (DDP; HSDP's inter-node dimension). Under ftlaunch's
    #: ``ft.gangs()``: the fault-tolerant gang across replica groups, whose size is the live quorum's.
    rdp: Gang
    #: Sharded data parallelism (FSDP; HSDP's intra-node dimension).
    sdp: Gang
    #: Tensor parallelism.
    tp: Gang
    #: Pipeline parallelism.
    pp: Gang

    def __post_init__(self) -> None:
        # Rank 0 of the root coordinates (logs, checkpoints): it must lead every dimension too.
        if self.root.rank == 0 and (self.dp.rank, self.tp.rank, self.pp.rank) != (0, 0, 0):
            raise ValueError(
                "the coordinator process (root rank 0) must be rank 0 of the dp, tp and pp gangs, "
                f"got dp={self.dp.rank}, tp={self.tp.rank}, pp={self.pp.rank}"
            )

    @property
    def device(self) -> torch.device:
        return self.root.device

    def close(self) -> None:
        """Close every gang once: ``rdp`` first (a fault-tolerant one leaves its quorum while
        everything under it still works), the root last (its close destroys torch's default
        group, and with it any group left). Idempotent."""
        seen: set[int] = set()
        for gang in (self.rdp, self.pp, self.tp, self.sdp, self.dp, self.root):
            if id(gang) not in seen:
                seen.add(id(gang))
                gang.close()

    def __enter__(self) -> Gangs:
        _stack().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _stack().pop()


_current = threading.local()


def _stack() -> list[Gangs]:
    stack: list[Gangs] | None = getattr(_current, "stack", None)
    if stack is None:
        stack = _current.stack = []
    return stack


def maybe_get_current_gangs() -> Gangs | None:
    """The calling thread's current gangs (the innermost ``with gangs:``), or None."""
    stack = _stack()
    return stack[-1] if stack else None


def create_fake_gangs(device: torch.device) -> Gangs:
    """Gangs for one process alone: one `FakeGang` of size 1 in every role."""
    gang = FakeGang(device)
    return Gangs(root=gang, dp=gang, rdp=gang, sdp=gang, tp=gang, pp=gang)


def _split(root: Gang, groups: Iterable[list[int]], fake: Gang) -> Gang:
    """Create every group (root ranks) from ``root`` in order; return the one holding this process."""
    groups = list(groups)
    if len(groups[0]) == 1:
        return fake
    if len(groups[0]) == root.size:
        return root
    mine: Gang | None = None
    for ranks in groups:
        gang = root.create_gang(ranks)
        if gang is not None:
            mine = gang
    if mine is None:
        raise AssertionError(f"root rank {root.rank} is in none of the groups {groups}")
    return mine


def create_parallel_gangs(root_gang: Gang, *, tp_size: int = 1) -> Gangs:
    """Data parallel and tensor parallel gangs over ``root_gang``: ``size // tp_size`` x ``tp_size``.

    With 8 processes and ``tp_size=2``: tp gangs [0, 1], [2, 3], [4, 5], [6, 7]; dp gangs
    [0, 2, 4, 6], [1, 3, 5, 7]. ``rdp`` is ``dp`` (plain data parallelism), ``sdp`` and ``pp`` are
    fakes of size 1. Every process of ``root_gang`` must call it.

    Raises ``ValueError`` if ``tp_size`` is not a positive divisor of ``root_gang.size``; `GangError`.
    """
    root = root_gang
    if not isinstance(tp_size, int) or tp_size < 1 or root.size % tp_size:
        raise ValueError(
            f"tp_size must be a positive divisor of the root gang's size {root.size}, got {tp_size!r}"
        )
    fake = FakeGang(root.device)
    dp_size = root.size // tp_size
    # Process d * tp_size + t is data parallel rank d of dp gang t, tensor parallel rank t of tp gang d.
    dp = _split(root, ([d * tp_size + t for d in range(dp_size)] for t in range(tp_size)), fake)
    tp = _split(root, ([d * tp_size + t for t in range(tp_size)] for d in range(dp_size)), fake)
    return Gangs(root=root, dp=dp, rdp=dp, sdp=fake, tp=tp, pp=fake)


def create_fsdp_gangs(gangs: Gangs, intra_node_size: int | None = None) -> Gangs:
    """``gangs`` with ``sdp`` and ``rdp`` set for fully (``intra_node_size`` None) or hybrid sharded
    data parallelism.

    None: ``sdp`` is ``dp`` and ``rdp`` a fake of size 1. An integer N > 1 splits every dp gang of
    size D into D / N sharded gangs of N adjacent dp ranks (``sdp``) and N replicated gangs of
    every N-th dp rank (``rdp``): with D = 8, N = 4: sdp [0..3], [4..7]; rdp [0, 4], [1, 5], [2, 6],
    [3, 7]. ``gangs`` must be laid out as `create_parallel_gangs` lays them out; every process of
    ``gangs.root`` must call it. Returns a new `Gangs` (the class is immutable).

    Raises ``ValueError`` if N is not an int > 1 dividing ``gangs.dp.size`` or the layout differs;
    `GangError`.
    """
    root, dp, tp = gangs.root, gangs.dp, gangs.tp
    if intra_node_size is None:
        return Gangs(root=root, dp=dp, rdp=FakeGang(gangs.device), sdp=dp, tp=tp, pp=gangs.pp)
    if not isinstance(intra_node_size, int) or intra_node_size <= 1 or dp.size % intra_node_size:
        raise ValueError(
            f"intra_node_size must be an int > 1 dividing the dp gang's size {dp.size}, got {intra_node_size!r}"
        )
    if root.size != dp.size * tp.size or root.rank != dp.rank * tp.size + tp.rank:
        raise ValueError("gangs must be laid out as create_parallel_gangs lays them out (root = dp x tp)")
    fake = FakeGang(gangs.device)
    n, tp_size = intra_node_size, tp.size
    inter = dp.size // n

    def root_rank(i: int, j: int, t: int) -> int:  # inter index i, intra index j, tp index t
        return (i * n + j) * tp_size + t

    rdp = _split(
        root, ([root_rank(i, j, t) for i in range(inter)] for t in range(tp_size) for j in range(n)), fake
    )
    if n == dp.size:
        sdp = dp
    else:
        sdp = _split(
            root, ([root_rank(i, j, t) for j in range(n)] for t in range(tp_size) for i in range(inter)), fake
        )
    return Gangs(root=root, dp=dp, rdp=rdp, sdp=sdp, tp=tp, pp=gangs.pp)
