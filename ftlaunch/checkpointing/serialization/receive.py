"""The receiving side: where each tensor of a validated header lands, and the finished state dict.

A transport receives in three steps: `plan_slots` allocates the destination tensors (or picks the
caller's own to receive into in place), the transport moves the body's bytes into them, and
`finish` verifies every checksum before it rebuilds the state dict. Only a header that
`header.parse_header` accepted gets here, so every allocation has a validated dtype and shape.

Preallocated tensors each get their own storage (not views into one receive buffer), so keeping,
freeing or resizing one is like any tensor the caller allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ftlaunch.checkpointing.serialization import tree
from ftlaunch.checkpointing.serialization.buffers import byte_view
from ftlaunch.checkpointing.serialization.checksum import IncrementalChecksum, checksum, checksums
from ftlaunch.checkpointing.serialization.header import (
    FRAME_PREFIX_LEN,
    Header,
    TensorEntry,
    parse_frame_prefix,
    parse_header,
)
from ftlaunch.checkpointing.serialization.spec import DTYPE_NAMES, invalid
from ftlaunch.errors import CheckpointTransportError

if TYPE_CHECKING:
    from ftlaunch.checkpointing.serialization.limits import Deadline

__all__ = ["Slot", "finish", "loads", "plan_slots"]


@dataclass
class Slot:
    """Where tensor ``entry`` is received: bytes land in ``landing`` (contiguous, on the transport's
    device); ``target`` is what the rebuilt state dict holds (the same tensor, or the caller's
    existing tensor that ``landing`` is copied into after verification)."""

    entry: TensorEntry
    landing: torch.Tensor
    target: torch.Tensor
    #: Set by receivers that checksum pieces as they arrive; otherwise `verify` does it all.
    incremental: IncrementalChecksum | None = None
    #: ``landing`` was allocated for this receive (its pages are not backed yet: see `prefault`).
    fresh: bool = False

    def verify(self, got: str | None = None) -> None:
        """Compare the received bytes' checksum (``got``, or computed now) with the header's."""
        if got is None:
            got = self.incremental.digest() if self.incremental is not None else checksum(self.landing)
        if got != self.entry.sum:
            raise CheckpointTransportError(
                f"checksum mismatch for tensor {self.entry.index} ({DTYPE_NAMES[self.entry.dtype]}"
                f"{list(self.entry.shape)}): payload corrupted, truncated or mutated while being sent"
            )

    def commit(self) -> torch.Tensor:
        """The verified tensor for the state dict (copied into the caller's tensor if needed)."""
        if self.target is not self.landing:
            with torch.no_grad():
                self.target.copy_(self.landing)
        return self.target


def plan_slots(
    header: Header, device: torch.device, template: Any = None, deadline: Deadline | None = None
) -> list[Slot]:
    """Allocate (or reuse from ``template``) the tensors the body is received into.

    A template tensor is reused in place when it has the same dtype and shape, is contiguous and
    dense, and is not already used for another tensor; otherwise a fresh tensor is allocated. Reuse
    avoids allocation and page faults and keeps the caller's tensor identity (optimizers hold
    references to parameters). A failed allocation is a `CheckpointTransportError` (the peer's
    claimed size, though valid, does not fit here): the heal fails like any other transfer.
    """
    found: dict[int, torch.Tensor] = {}
    if template is not None:
        tree.match_templates(header.tree, template, found)
    used: set[int] = set()
    slots = []
    try:
        for e in header.tensors:
            if deadline is not None and e.index % 1024 == 1023:
                deadline.check("allocating the received state")
            t = found.get(e.index)
            if t is not None and _fits(t, e) and id(t) not in used:
                used.add(id(t))
                if t.device == device:
                    slots.append(Slot(e, t.detach(), t))
                else:
                    slots.append(Slot(e, torch.empty(e.shape, dtype=e.dtype, device=device), t, fresh=True))
            else:
                fresh = torch.empty(e.shape, dtype=e.dtype, device=device)
                slots.append(Slot(e, fresh, fresh, fresh=True))
    except RuntimeError as e:  # out of memory, e.g. for a (valid) header claiming a huge state
        raise CheckpointTransportError(
            f"cannot allocate the received state ({header.body_nbytes} bytes): {e}"
        ) from e
    return slots


def _fits(t: torch.Tensor, e: TensorEntry) -> bool:
    """Whether the caller's tensor ``t`` can receive entry ``e``'s bytes in place."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.dtype == e.dtype
        and tuple(t.shape) == e.shape
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
    )


def finish(header: Header, slots: Sequence[Slot], got: Sequence[str | None] | None = None) -> Any:
    """Verify every received tensor, copy into the caller's tensors where needed, rebuild the tree.

    ``got``: checksums the transport already computed of some landed tensors (None where not), so
    that verifying them here costs nothing; the rest are computed now."""
    known: list[str | None] = list(got) if got is not None else [None] * len(slots)
    rest = [i for i, s in enumerate(slots) if s.incremental is None and known[i] is None]
    for i, digest in zip(rest, checksums([slots[i].landing for i in rest]), strict=True):
        known[i] = digest
    for s, known_sum in zip(slots, known, strict=True):
        s.verify(known_sum)
    return _build(header, [s.commit() for s in slots])


def _build(header: Header, targets: Sequence[torch.Tensor]) -> Any:
    """Rebuild the state dict from a validated header and its received tensors."""
    for e, t in zip(header.tensors, targets, strict=True):
        if (
            e.requires_grad
            and t.is_leaf
            and not t.requires_grad
            and (t.is_floating_point() or t.is_complex())
        ):
            t.requires_grad_(True)
    return tree.build(header.tree, targets)


def loads(
    data: bytes | bytearray | memoryview, expected_step: int | None = None, template: Any = None
) -> Any:
    """Decode what `dumps` produced (copying into fresh or ``template`` tensors); validates fully."""
    mv = memoryview(data).cast("B")
    length = parse_frame_prefix(mv[:FRAME_PREFIX_LEN])
    header = parse_header(mv[: FRAME_PREFIX_LEN + length], expected_step)
    body = mv[FRAME_PREFIX_LEN + length :]
    if len(body) != header.body_nbytes:
        raise invalid(f"body is {len(body)} bytes, header says {header.body_nbytes} (truncated or padded)")
    slots = plan_slots(header, torch.device("cpu"), template)
    for s in slots:
        if s.entry.nbytes:
            byte_view(s.landing)[:] = body[s.entry.offset : s.entry.offset + s.entry.nbytes]
    return finish(header, slots)
