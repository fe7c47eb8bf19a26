"""The sending side: describe a state dict as a header plus the tensors that make up its body.

``body`` = each tensor's bytes at a 64-byte aligned offset (`spec.ALIGNMENT`), zero padding
between them. Nothing is copied for contiguous tensors already on the target device: `Encoded`
holds the caller's storage, which is why the transports' snapshot rule (do not mutate until
`disallow_checkpoint`) exists and why checksums are taken here, when the state is handed over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ftlaunch.checkpointing.serialization.buffers import byte_view
from ftlaunch.checkpointing.serialization.checksum import checksums
from ftlaunch.checkpointing.serialization.header import PENDING_SUM, Header, TensorEntry, frame_header
from ftlaunch.checkpointing.serialization.spec import ALIGNMENT, is_int
from ftlaunch.checkpointing.serialization.tree import TreeEncoder

__all__ = ["Encoded", "dumps", "encode"]


@dataclass
class Encoded:
    """A state dict ready to send: its header (and frame) plus the payload tensors it describes.

    ``tensors[i]`` is contiguous, detached, on the requested device and described by
    ``header.tensors[i]``; for contiguous tensors already on that device it shares their storage
    (no copy), so the caller must not mutate them while the payload is being served.
    """

    header: Header
    frame: bytes
    tensors: list[torch.Tensor]

    @property
    def body_nbytes(self) -> int:
        return self.header.body_nbytes


def encode(state_dict: Any, step: int, device: torch.device | None = None, *, sums: bool = True) -> Encoded:
    """Describe ``state_dict`` for sending. Unsupported leaves raise TypeError (misuse).

    Tensors are moved to ``device`` when given (the HTTP transport serves CPU bytes); contiguous
    tensors already there are not copied. Checksums are computed here, so a caller who mutates a
    tensor while it is being served is caught by the receiver instead of silently tearing the copy.
    ``sums=False``: the header says `PENDING_SUM`; the caller sends a sums frame after the body
    (``header.frame_sums(checksums(enc.tensors))``), computed while the tensors travel.
    """
    if not is_int(step):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    enc = TreeEncoder(device)
    tree = enc.node(state_dict, "state_dict", 0)
    # Body offsets: each tensor at the next ALIGNMENT boundary; empty tensors take no bytes.
    entries = []
    offset = 0
    digests = checksums(enc.tensors) if sums else [PENDING_SUM] * len(enc.tensors)
    for i, t in enumerate(enc.tensors):
        nbytes = t.numel() * t.element_size()
        off = -(-offset // ALIGNMENT) * ALIGNMENT if nbytes else 0
        entries.append(TensorEntry(i, t.dtype, tuple(t.shape), off, nbytes, digests[i], enc.requires_grad[i]))
        if nbytes:
            offset = off + nbytes
    header = Header(step=step, body_nbytes=offset, tensors=tuple(entries), tree=tree)
    return Encoded(header=header, frame=frame_header(header), tensors=enc.tensors)


def dumps(state_dict: Any, step: int = 0) -> bytes:
    """Header frame followed by the body, as one bytes object (tools, tests, small states)."""
    enc = encode(state_dict, step, device=torch.device("cpu"))
    out = bytearray(len(enc.frame) + enc.body_nbytes)
    out[: len(enc.frame)] = enc.frame
    body = memoryview(out)[len(enc.frame) :]
    for e, t in zip(enc.header.tensors, enc.tensors, strict=True):
        if e.nbytes:
            body[e.offset : e.offset + e.nbytes] = byte_view(t)
    return bytes(out)
