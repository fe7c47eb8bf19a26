"""The body as a sequence of byte ranges, cut into pieces for sockets (shared by both ends).

Why both ends share it: the HTTP sender streams any byte range of the body from its tensors'
memory, and the receiver reads the same range straight into its destination tensors; both walk
`layout`'s segments with `iter_range`, so a range means the same bytes on both sides. Receivers
split the body into parallel ranges (`split_body`) on checksum-block boundaries, so each piece can
be checksummed as soon as it lands, and send runs of tiny pieces through one buffer (`batches`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftlaunch.checkpointing.serialization.checksum import BLOCK_BYTES
from ftlaunch.checkpointing.serialization.header import Header
from ftlaunch.checkpointing.serialization.spec import ALIGNMENT

if TYPE_CHECKING:
    from ftlaunch.checkpointing.serialization.limits import Deadline

__all__ = [
    "PIECE_BYTES",
    "RUN_BYTES",
    "SMALL_PIECE_BYTES",
    "Piece",
    "Segment",
    "batches",
    "iter_range",
    "layout",
    "runs",
    "split_body",
]

#: Largest single piece (one send or read call); also how often a stream checks for revocation/abort.
PIECE_BYTES = 8 << 20
#: Pieces shorter than this (small tensors, padding) travel in runs of up to RUN_BYTES.
SMALL_PIECE_BYTES = 64 << 10
RUN_BYTES = 1 << 20

_ZEROS = memoryview(bytes(ALIGNMENT))


@dataclass(frozen=True)
class Segment:
    """``length`` bytes of the body at ``offset`` live in ``view``: tensor ``index``'s bytes, or
    padding (``index`` -1)."""

    offset: int
    length: int
    view: memoryview
    index: int = -1


def layout(
    header: Header,
    views: Sequence[memoryview],
    padding: memoryview | None = None,
    deadline: Deadline | None = None,
) -> list[Segment]:
    """Segments covering the whole body in order: tensor bytes and the padding between them.

    ``views[i]`` holds tensor i's bytes; ``padding`` (>= ALIGNMENT bytes) stands in for the gaps —
    zeros on the sending side, a scratch buffer on the receiving side. ``deadline``: a receiver's,
    checked every few thousand tensors.
    """
    pad = _ZEROS if padding is None else padding
    segs: list[Segment] = []
    pos = 0
    for k, e in enumerate(sorted((e for e in header.tensors if e.nbytes), key=lambda e: e.offset)):
        if deadline is not None and k % 4096 == 4095:
            deadline.check("laying out the received state")
        while pos < e.offset:  # gaps are < ALIGNMENT for our encoder, but allow any
            n = min(e.offset - pos, len(pad))
            segs.append(Segment(pos, n, pad[:n]))
            pos += n
        segs.append(Segment(e.offset, e.nbytes, views[e.index], e.index))
        pos = e.offset + e.nbytes
    while pos < header.body_nbytes:
        n = min(header.body_nbytes - pos, len(pad))
        segs.append(Segment(pos, n, pad[:n]))
        pos += n
    return segs


@dataclass(frozen=True)
class Piece:
    """Bytes ``[lo, hi)`` of ``segment`` (segment-relative), and the view over them."""

    segment: Segment
    lo: int
    hi: int

    @property
    def view(self) -> memoryview:
        return self.segment.view[self.lo : self.hi]


def iter_range(segments: Sequence[Segment], start: int, end: int, max_piece: int) -> Iterator[Piece]:
    """Pieces covering body bytes ``[start, end)``, each at most ``max_piece`` bytes."""
    i = max(0, bisect.bisect_right([s.offset for s in segments], start) - 1)
    pos = start
    while pos < end and i < len(segments):
        seg = segments[i]
        lo = pos - seg.offset
        hi = min(seg.length, end - seg.offset)
        while lo < hi:
            n = min(hi - lo, max_piece)
            yield Piece(seg, lo, lo + n)
            lo += n
        pos = seg.offset + hi
        i += 1
    if pos < end:
        raise ValueError(f"range [{start}, {end}) extends beyond the body")


def split_body(segments: Sequence[Segment], n: int) -> list[int]:
    """Boundaries of ``n`` (or fewer) near-equal ranges of the body, each starting on a checksum
    block boundary of the tensor it starts in (so receivers can checksum pieces as they arrive)."""
    total = segments[-1].offset + segments[-1].length if segments else 0
    starts = [s.offset for s in segments]
    bounds = [0]
    for k in range(1, n):
        p = total * k // n
        seg = segments[bisect.bisect_right(starts, p) - 1]
        if seg.index >= 0:
            p = seg.offset + (p - seg.offset) // BLOCK_BYTES * BLOCK_BYTES
        if p > bounds[-1]:
            bounds.append(p)
    if total > bounds[-1]:
        bounds.append(total)
    return bounds


def batches(pieces: Iterator[Piece], small: int, limit: int) -> Iterator[list[Piece]]:
    """Group runs of pieces shorter than ``small`` (up to ``limit`` bytes per run); larger pieces
    come alone. Runs go through one staging buffer: one syscall instead of one per tiny tensor
    or padding gap (and no tiny TCP segments)."""
    run: list[Piece] = []
    size = 0
    for p in pieces:
        n = p.hi - p.lo
        if n >= small:
            if run:
                yield run
                run, size = [], 0
            yield [p]
            continue
        if run and size + n > limit:
            yield run
            run, size = [], 0
        run.append(p)
        size += n
    if run:
        yield run


def runs(segments: Sequence[Segment], start: int, end: int) -> Iterator[list[Piece]]:
    """Body bytes ``[start, end)`` as socket I/O units: a large piece alone, or a run of small ones.

    Sender and receiver cut a range the same way, so each unit is one send on one side and one
    read on the other.
    """
    return batches(iter_range(segments, start, end, PIECE_BYTES), SMALL_PIECE_BYTES, RUN_BYTES)
