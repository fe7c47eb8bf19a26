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
import warnings
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from ftlaunch.gang.base import Gang
from ftlaunch.gang.fake import FakeGang

__all__ = [
    "GangContext",
    "Gangs",
    "StandardGangContext",
    "create_fake_gangs",
    "create_fsdp_gangs",
    "create_parallel_gangs",
    "get_current_gangs",
    "get_default_gangs",
    "maybe_get_current_gangs",
    "set_default_gangs",
    "set_gangs",
]


@dataclass(frozen=True, kw_only=True)
class Gangs:
    """The gangs of one process, one per parallelism. Use as a context manager to make them the
    calling thread's current gangs of their device (`get_current_gangs`), as `set_gangs` does."""

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
        _push(self, meta=False)
        return self

    def __exit__(self, *exc: object) -> None:
        _pop(self.device, meta=False)


# -- the current gangs ----------------------------------------------------------------------------
#
# fairseq2's model: gangs are looked up per device. Each thread has a stack of gangs per device
# (`set_gangs`, ``with gangs:``); below the stack are the process's default gangs of the device
# (`set_default_gangs`), and below those one set of fake gangs of size 1 per device, so a lookup
# always answers. ``meta=True`` also files the gangs under the meta device, where models are
# built before being materialized.

_META = torch.device("meta")
_current = threading.local()
_defaults_lock = threading.Lock()
_defaults: dict[torch.device, Gangs] = {}
_fakes: dict[torch.device, Gangs] = {}


def _stacks() -> defaultdict[torch.device, list[Gangs]]:
    stacks: defaultdict[torch.device, list[Gangs]] | None = getattr(_current, "stacks", None)
    if stacks is None:
        stacks = _current.stacks = defaultdict(list)
    return stacks


def _order() -> list[Gangs]:
    """The calling thread's set gangs in the order they were set, whatever their device."""
    order: list[Gangs] | None = getattr(_current, "order", None)
    if order is None:
        order = _current.order = []
    return order


def _push(gangs: Gangs, meta: bool) -> None:
    stacks = _stacks()
    stacks[gangs.device].append(gangs)
    if meta:
        stacks[_META].append(gangs)
    _order().append(gangs)


def _pop(device: torch.device, meta: bool) -> None:
    stacks = _stacks()
    gangs = stacks[device].pop()
    if meta:
        stacks[_META].pop()
    order = _order()
    for i in range(len(order) - 1, -1, -1):
        if order[i] is gangs:
            del order[i]
            break


def _current_device() -> torch.device:
    """The device a lookup without one is for: this process's CUDA device if it has one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_default_gangs(device: torch.device | None = None) -> Gangs:
    """The process's default gangs of ``device`` (default: the current device); fake gangs of size 1
    when none were set (`set_default_gangs`)."""
    device = _current_device() if device is None else torch.device(device)
    with _defaults_lock:
        gangs = _defaults.get(device)
        if gangs is None:
            fake_device = torch.device("cpu") if device.type == "meta" else device
            gangs = _fakes.get(fake_device)
            if gangs is None:
                gangs = _fakes[fake_device] = create_fake_gangs(fake_device)
    return gangs


def set_default_gangs(gangs: Gangs, *, meta: bool = False) -> None:
    """Make ``gangs`` the process's default gangs of their device (and of the meta device, with
    ``meta=True``): what `get_current_gangs` answers in any thread that set none of its own."""
    with _defaults_lock:
        _defaults[gangs.device] = gangs
        if meta:
            _defaults[_META] = gangs


def set_gangs(gangs: Gangs, *, meta: bool = False) -> AbstractContextManager[None]:
    """A context manager: within it, `get_current_gangs` of the calling thread answers ``gangs`` for
    their device (and for the meta device, with ``meta=True``)."""
    return _set_gangs(gangs, meta)


@contextmanager
def _set_gangs(gangs: Gangs, meta: bool) -> Iterator[None]:
    _push(gangs, meta)
    try:
        yield
    finally:
        _pop(gangs.device, meta)


def get_current_gangs(device: torch.device | None = None) -> Gangs:
    """The calling thread's current gangs of ``device`` (default: the current device): the innermost
    `set_gangs` / ``with gangs:``, else the default gangs (`get_default_gangs`)."""
    device = _current_device() if device is None else torch.device(device)
    stack = _stacks().get(device)
    if stack:
        return stack[-1]
    return get_default_gangs(device)


def maybe_get_current_gangs() -> Gangs | None:
    """Deprecated (as in fairseq2): the gangs the calling thread set last (``with gangs:`` or
    `set_gangs`), whatever their device, or None. Use `get_current_gangs`."""
    warnings.warn(
        "maybe_get_current_gangs is deprecated (as in fairseq2): use get_current_gangs(device)",
        DeprecationWarning,
        stacklevel=2,
    )
    order = _order()
    return order[-1] if order else None


class GangContext(ABC):
    """fairseq2's interface to the current gangs, for code that takes it as a dependency instead
    of calling the module's functions."""

    @abstractmethod
    def get_current_gangs(self, device: torch.device | None = None) -> Gangs:
        """See `get_current_gangs`."""

    @abstractmethod
    def set_gangs(self, gangs: Gangs, *, meta: bool = False) -> AbstractContextManager[None]:
        """See `set_gangs`."""


class StandardGangContext(GangContext):
    """The `GangContext` of this module's functions (per thread, per device, defaults per process)."""

    def get_current_gangs(self, device: torch.device | None = None) -> Gangs:
        return get_current_gangs(device)

    def set_gangs(self, gangs: Gangs, *, meta: bool = False) -> AbstractContextManager[None]:
        return set_gangs(gangs, meta=meta)


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
            f"intra_node_size must be an int > 1 dividing the dp gang's size {dp.size}, got "
            f"{intra_node_size!r}"
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
