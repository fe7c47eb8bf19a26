"""The `Gang` interface (fairseq2's): a set of processes that run collectives together.

What every implementation shares lives here too, so they cannot drift apart: the argument checks
(a bad rank, size or shape is the caller's mistake and raises ``ValueError`` *before* anything is
sent, on every rank alike, so no peer is left waiting in a collective), and the two helpers built
on the interface (`broadcast_flag`, `all_sum`).

Errors, as in fairseq2: ``ValueError``/``TypeError`` for misuse, `GangError` (a
`CommunicationError`) when the communication itself fails, `NotSupportedError` when an
implementation cannot do what was asked, `InvalidOperationError` for a closed gang.
"""

from __future__ import annotations

import ctypes
import io
import pickle
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from enum import Enum
from typing import NoReturn

import torch
import torch.distributed as dist

from ftlaunch.errors import GangError, OperationalError

__all__ = [
    "Gang",
    "ReduceOperation",
    "all_sum",
    "broadcast_flag",
    "raise_operational_gang_error",
]


class ReduceOperation(Enum):
    """The element-wise reductions of `Gang.all_reduce`."""

    SUM = 1
    MEAN = 2
    PRODUCT = 3
    MIN = 4
    MAX = 5


class Gang(ABC):
    """A set of processes that work collectively.

    Every process of a gang calls its collectives in the same order with tensors of the same
    shapes; ``rank`` is this process's place in the gang, ``size`` the number of processes.
    """

    @abstractmethod
    def close(self) -> None:
        """Release what the gang holds (idempotent)."""

    @abstractmethod
    def create_gang(self, ranks: Sequence[int]) -> Gang | None:
        """A sub-gang of the processes ``ranks`` (ranks of this gang); None if this process is not
        one of them. Every process of this gang must call it, members or not.

        The sub-gang numbers its members in the order of their ranks here (as torch's
        ``new_group`` does), whatever the order of ``ranks``.

        Raises ``ValueError`` if ``ranks`` is empty, has duplicates or a value outside
        ``[0, size)``; `GangError` if the communication fails.
        """

    @abstractmethod
    def as_process_group(self) -> dist.ProcessGroup:
        """This gang as a torch ProcessGroup, for torch's own collectives, DDP, FSDP.

        Raises `NotSupportedError` if the gang has none (see `supports_process_group`).
        """

    @abstractmethod
    def barrier(self) -> None:
        """Block until every process of the gang has reached this call. Raises `GangError`."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOperation) -> None:
        """Reduce ``tensor`` over the gang with ``op``, in place on every process. Raises `GangError`.

        MEAN of an integer tensor rounds down.
        """

    @abstractmethod
    def all_gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor) -> None:
        """Write every process's ``input_tensor``, in rank order, into ``output_tensor``.

        ``output_tensor`` must be contiguous, of shape ``[size, *input_tensor.shape]`` and of the
        input's dtype (else ``ValueError``). Raises `GangError`.
        """

    @abstractmethod
    def all_gather_to_list(self, output_tensors: list[torch.Tensor], input_tensor: torch.Tensor) -> None:
        """Like `all_gather`, into ``output_tensors[r]`` for rank r: a list of ``size`` tensors
        shaped like the input (else ``ValueError``). Raises `GangError`."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, source_rank: int = 0) -> None:
        """Copy ``tensor`` of process ``source_rank`` into ``tensor`` of every other process.

        Raises ``ValueError`` if ``source_rank`` is outside ``[0, size)``; `GangError`.
        """

    @abstractmethod
    def broadcast_objects(self, objects: list[object], source_rank: int = 0) -> None:
        """Replace the items of ``objects`` with those of process ``source_rank`` (pickled), in place.

        Every process passes a list of the same length. Raises ``ValueError`` if ``source_rank``
        is outside ``[0, size)``; `GangError`.
        """

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def size(self) -> int: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def supports_process_group(self) -> bool: ...

    def __repr__(self) -> str:
        try:
            where = f"rank={self.rank}, size={self.size}"
        except Exception as e:  # noqa: BLE001 - a repr must not raise (a closed or not yet formed gang)
            where = type(e).__name__
        return f"{type(self).__name__}({where}, device={self.device})"


# ---- the checks every implementation runs first -------------------------------------------------


def check_ranks(ranks: Sequence[int], size: int) -> list[int]:
    """``ranks`` sorted, or ``ValueError`` when it cannot name a sub-gang of a gang of ``size``."""
    ranks = list(ranks)
    if not ranks:
        raise ValueError("ranks must name at least one process")
    if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
        raise ValueError(f"ranks must be ints, got {ranks}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must be unique, got {ranks}")
    bad = [r for r in ranks if not 0 <= r < size]
    if bad:
        raise ValueError(f"ranks must be in [0, {size}), got {bad} in {ranks}")
    return sorted(ranks)


def check_source_rank(source_rank: int, size: int) -> None:
    if not isinstance(source_rank, int) or not 0 <= source_rank < size:
        raise ValueError(f"source_rank must be in [0, {size}), got {source_rank}")


def check_reduce_operation(op: object) -> ReduceOperation:
    if not isinstance(op, ReduceOperation):
        raise TypeError(f"op must be a ReduceOperation, got {op!r}")
    return op


def check_all_gather(output: torch.Tensor, input: torch.Tensor, size: int) -> None:
    if not output.is_contiguous():
        raise ValueError("all_gather: output_tensor must be contiguous")
    want = (size, *input.shape)
    if tuple(output.shape) != want:
        raise ValueError(f"all_gather: output_tensor must have shape {list(want)}, got {list(output.shape)}")
    if output.dtype != input.dtype:
        raise ValueError(f"all_gather: output_tensor is {output.dtype}, input_tensor {input.dtype}")


def check_all_gather_list(outputs: list[torch.Tensor], input: torch.Tensor, size: int) -> None:
    if len(outputs) != size:
        raise ValueError(f"all_gather_to_list: output_tensors must hold {size} tensors, got {len(outputs)}")
    for i, out in enumerate(outputs):
        if out.shape != input.shape or out.dtype != input.dtype:
            raise ValueError(
                f"all_gather_to_list: output_tensors[{i}] is {out.dtype}{list(out.shape)}, "
                f"input_tensor {input.dtype}{list(input.shape)}"
            )


def check_objects(objects: object) -> list[object]:
    if not isinstance(objects, list):
        raise TypeError(f"objects must be a list, got {type(objects).__name__}")
    return objects


def broadcast_pickled(
    broadcast: Callable[[torch.Tensor, int], bool | None],
    objects: list[object],
    source_rank: int,
    is_source: bool,
    device: torch.device,
    *,
    safe: bool = False,
) -> None:
    """`Gang.broadcast_objects` over a tensor ``broadcast(tensor, source_rank)``: the length of the
    pickle, then its bytes.

    ``safe``: decode with torch's weights-only unpickler, which builds only tensors, numbers,
    strings and containers of them and never runs code named by the sender. A gang whose peers
    are other replica groups (another failure domain, possibly another incarnation of a job) uses
    it; inside a replica group, as in ``torch.distributed.broadcast_object_list``, any picklable
    object travels.

    A source whose objects cannot be pickled still sends a length (-1), so every process raises
    the same ``TypeError`` instead of its peers waiting in the second broadcast until a timeout.
    A fault-tolerant gang's ``broadcast`` returns False when it failed without raising (the step
    then commits nowhere): ``objects`` is left as it was.
    """
    payload: bytes | None = None
    why = ""
    if is_source:
        try:
            payload = _dumps(list(objects), safe)
        except Exception as e:  # noqa: BLE001 - pickle raises many types; all are the same misuse here
            why = f": {type(e).__name__}: {e}"
    length = torch.tensor([len(payload) if payload is not None else -1], dtype=torch.int64, device=device)
    if broadcast(length, source_rank) is False:
        return
    n = int(length.item())
    if n < 0:
        raise TypeError(f"broadcast_objects: the objects of rank {source_rank} cannot be pickled{why}")
    if payload is not None:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=device)
    if broadcast(buf, source_rank) is False or is_source:
        return
    received = _loads(_bytes_of(buf.cpu()), safe)
    if len(received) != len(objects):
        raise ValueError(
            f"broadcast_objects: rank {source_rank} sent {len(received)} objects, this process passed "
            f"{len(objects)}"
        )
    objects[:] = received


def _bytes_of(buf: torch.Tensor) -> bytes:
    """A contiguous CPU uint8 tensor's bytes, through torch alone (NumPy is not a dependency)."""
    return ctypes.string_at(buf.data_ptr(), buf.numel())


def _dumps(objects: list[object], safe: bool) -> bytes:
    if not safe:
        return pickle.dumps(objects)
    out = io.BytesIO()
    torch.save(objects, out)
    try:  # refuse at the source what the receivers' weights-only loader would refuse
        torch.load(io.BytesIO(out.getvalue()), weights_only=True)
    except pickle.UnpicklingError as e:
        raise TypeError(
            f"only tensors, numbers, strings and containers of them cross replica groups ({e})"
        ) from None
    return out.getvalue()


def _loads(data: bytes, safe: bool) -> list[object]:
    if not safe:
        return pickle.loads(data)  # noqa: S301 - the gang's own peers inside one replica group
    try:
        received = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - a refused or corrupt payload, whatever the loader raises
        raise GangError(f"broadcast_objects: refused the objects received: {type(e).__name__}: {e}") from None
    if not isinstance(received, list):
        raise GangError(f"broadcast_objects: received a {type(received).__name__}, not a list")
    return received


# ---- helpers on the interface ---------------------------------------------------------------------


def broadcast_flag(gang: Gang, flag: bool, source_rank: int = 0) -> bool:
    """``flag`` of process ``source_rank``, on every process. Raises ``ValueError``, `GangError`."""
    # uint8 rather than bool: every backend (gloo included) broadcasts bytes.
    t = torch.tensor([1 if flag else 0], dtype=torch.uint8, device=gang.device)
    gang.broadcast(t, source_rank)
    return bool(t.item())


def all_sum(gang: Gang, value: float | int) -> torch.Tensor:
    """The sum of ``value`` over the gang, as a scalar tensor on ``gang.device`` (int64 for an
    int, the default float dtype for a float). Raises `GangError`."""
    t = torch.tensor(value, device=gang.device)
    gang.all_reduce(t, ReduceOperation.SUM)
    return t


def raise_operational_gang_error(cause: GangError) -> NoReturn:
    """Raise `OperationalError` from ``cause``: the job cannot go on without its peers."""
    raise OperationalError(f"a collective communication error occurred: {cause}") from cause
