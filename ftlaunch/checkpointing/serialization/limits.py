"""How large a received payload may be, judged from the receiver's own state, and the heal deadline.

Why: the format's own limits (`spec.MAX_HEADER_BYTES`) must admit any honest state, so alone they
let a peer send a 256 MiB header of millions of tiny tensors that takes a receiver a minute and
gigabytes to parse, allocate and lay out, far past its heal timeout. A healing receiver knows
what it expects: a state like its own (same model, same optimizer; an optimizer's state may not
exist yet before the first step, hence the generous factor). `ReceiveLimits.like` measures the
receiver's state; the transports refuse a header larger than that *before reading it* and one
with more tensors *before materializing them*, and `Deadline` bounds the CPU work of the header
stages (parsing, validation, allocation, layout) by the transfer's own timeout.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from ftlaunch.checkpointing.serialization.spec import MAX_HEADER_BYTES
from ftlaunch.checkpointing.serialization.tree import TreeEncoder
from ftlaunch.errors import CheckpointTransportError

__all__ = ["Deadline", "ReceiveLimits"]

#: How much larger than the receiver's own state a received one may be (tensors and header bytes):
#: an Adam optimizer alone holds 3 tensors per parameter once it stepped, none before.
FACTOR = 16
#: Added to both limits, so that small states may grow by a fixed amount too.
SLACK_TENSORS = 4096
SLACK_HEADER_BYTES = 1 << 20
#: Upper bound of one tensor entry's JSON in a header, beyond its shape's digits.
_ENTRY_BYTES = 192
_DIM_BYTES = 21


@dataclass(frozen=True)
class ReceiveLimits:
    """The largest header (bytes of its frame) and the most tensors a receiver accepts."""

    max_header_bytes: int = MAX_HEADER_BYTES
    max_tensors: int | None = None

    @classmethod
    def like(cls, state: Any) -> ReceiveLimits:
        """Limits for receiving a state like ``state`` (the receiver's own); the format's limits
        when ``state`` cannot be measured (it holds values the format does not carry)."""
        try:
            tensors, tree_bytes = _measure(state)
        except (TypeError, ValueError):
            return cls()
        header = tree_bytes + sum(_ENTRY_BYTES + _DIM_BYTES * t.dim() for t in tensors)
        return cls(
            max_header_bytes=min(MAX_HEADER_BYTES, FACTOR * header + SLACK_HEADER_BYTES),
            max_tensors=FACTOR * len(tensors) + SLACK_TENSORS,
        )


class _Measure(TreeEncoder):
    """A `TreeEncoder` that only collects the tensors (no copies, sharded ones as they are)."""

    def tensor(self, t: torch.Tensor, path: str) -> int:
        if id(t) not in self.seen:
            self.seen[id(t)] = len(self.tensors)
            self.keepalive.append(t)
            self.tensors.append(t)
        return self.seen[id(t)]


def _measure(state: Any) -> tuple[list[torch.Tensor], int]:
    enc = _Measure(None)
    tree = enc.node(state, "state_dict", 0)
    return enc.tensors, len(json.dumps(tree, separators=(",", ":")))


class Deadline:
    """The transfer's deadline, checked between (and every few thousand items inside) the
    header stages; `check` raises `CheckpointTransportError` once it passed."""

    def __init__(self, timeout: float, what: str, deadline: float | None = None) -> None:
        self.timeout = timeout
        self.what = what
        self.at = time.monotonic() + timeout if deadline is None else deadline

    def check(self, stage: str) -> None:
        if time.monotonic() >= self.at:
            raise CheckpointTransportError(f"timed out after {self.timeout:.1f}s {stage} of {self.what}")
