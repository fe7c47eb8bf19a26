"""``sum64``: the per-tensor checksum of the checkpoint format, and its incremental form.

Why not crc32: zlib.crc32 runs at ~2.2 GB/s on one core here, and paying it on both ends capped
loopback transfers at ~1.7 GB/s. ``sum64`` is an additive checksum over 64-bit little-endian words
(word sum plus a block-position-weighted sum of 64 KiB block sums, both modulo 2**64), computed by
torch's vectorized integer reduction at ~9-11 GB/s per core; receivers compute it piece by piece
as bytes arrive (`IncrementalChecksum`), overlapped with the other connections' I/O.

It detects every single-bit error, truncation, zero-fill and misplaced blocks; changes that cancel
modulo 2**64 in both sums (e.g. flipping bit 63 of two words of one block) go unnoticed. It is not
a MAC: integrity against an adversary needs an authenticated channel. `checksum_reference` is the
executable specification (pure Python); the tests check the fast paths against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ftlaunch.checkpointing.serialization.buffers import tensor_bytes

__all__ = ["BLOCK_BYTES", "IncrementalChecksum", "checksum", "checksum_reference", "checksums"]

_SUM_BLOCK_WORDS = 8192  # 64 KiB blocks for the position-weighted half of sum64
# Blocks summed per torch op: 3 * 8192 words stay below ATen's parallel grain size (32768), so every
# op runs on the calling thread. Intra-op threads spin-wait, and on a busy machine (the usual case:
# training processes on every core) the parallel version was 2-8x slower and erratic.
_OP_BLOCKS = 3
#: Checksum block size; receivers cut pieces on these boundaries to checksum them as they arrive.
BLOCK_BYTES = _SUM_BLOCK_WORDS * 8
_MASK64 = (1 << 64) - 1


def _block_sums(u8: torch.Tensor, j0: int, j1: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sums (int64, wrapping) of the 64 KiB blocks ``j0..j1`` of an 8-byte aligned uint8 tensor,
    written to ``out`` (``j1 - j0`` int64 elements) when given."""
    rows = u8[j0 * BLOCK_BYTES : j1 * BLOCK_BYTES].view(torch.int64).view(j1 - j0, _SUM_BLOCK_WORDS)
    if out is None:
        out = torch.empty(j1 - j0, dtype=torch.int64, device=rows.device)
    if rows.device.type != "cpu":
        return torch.sum(rows, dim=1, out=out)  # accelerators: one kernel
    # Last blocks first: a receiver calls this right after a read wrote the bytes in order, so the
    # end of the piece is still in the CPU cache (measured ~1.4x faster than front to back for 4 MiB).
    for i in reversed(range(0, j1 - j0, _OP_BLOCKS)):
        torch.sum(rows[i : i + _OP_BLOCKS], dim=1, out=out[i : i + _OP_BLOCKS])
    return out


def _rest_sum(u8: torch.Tensor, start: int) -> int:
    """Sum of the words from ``start`` (after the last full block) to the end, tail zero-padded."""
    n = u8.numel()
    full = n - n % 8
    rest = int(u8[start:full].view(torch.int64).sum()) if full > start else 0
    if n > full:
        rest += int.from_bytes(bytes(u8[full:].cpu().tolist()) + bytes(8 - (n - full)), "little")
    return rest


def _digest(block_sums: torch.Tensor, rest: int) -> str:
    nblocks = block_sums.numel()
    s1 = s2 = 0
    if nblocks:
        weights = torch.arange(1, nblocks + 1, dtype=torch.int64, device=block_sums.device)
        s1, s2 = int(block_sums.sum()), int((block_sums * weights).sum())
    return f"{(s1 + rest) & _MASK64:016x}{(s2 + (nblocks + 1) * rest) & _MASK64:016x}"


def _aligned_bytes(t: torch.Tensor) -> torch.Tensor | None:
    u8 = tensor_bytes(t)
    return u8 if u8.storage_offset() % 8 == 0 else None


def checksum(t: torch.Tensor) -> str:
    """``sum64`` of a contiguous tensor's bytes, as 32 hex digits (see the module docstring).

    Words are little-endian 64-bit; the last partial word is zero-padded. Integer additions wrap
    modulo 2**64, so the result does not depend on the reduction order (or thread count).
    """
    u8 = _aligned_bytes(t)
    if u8 is None:
        u8 = tensor_bytes(t).clone()  # view(int64) needs an 8-byte aligned storage offset
    nblocks = u8.numel() // BLOCK_BYTES
    sums = _block_sums(u8, 0, nblocks) if nblocks else torch.zeros(0, dtype=torch.int64)
    return _digest(sums, _rest_sum(u8, nblocks * BLOCK_BYTES))


_ZERO_PAD = torch.zeros(8, dtype=torch.uint8)


def checksums(tensors: Sequence[torch.Tensor]) -> list[str]:
    """`checksum` of many tensors; small CPU tensors are done together in a few torch ops.

    Real state dicts hold hundreds of tiny tensors (biases, norms, optimizer scalars), where the
    per-op overhead of `checksum` would dominate. A tensor shorter than one block has
    ``sum64 = (S, S)`` with S its zero-padded word sum, and word sums of many tensors are
    differences of one prefix sum over their concatenation.
    """
    out: list[str] = [""] * len(tensors)
    small: list[int] = []
    parts: list[torch.Tensor] = []
    bounds = [0]  # word offsets of the small tensors in the concatenation
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if nbytes >= BLOCK_BYTES or t.device.type != "cpu":
            out[i] = checksum(t)
            continue
        small.append(i)
        if nbytes:
            parts.append(tensor_bytes(t))
            if nbytes % 8:
                parts.append(_ZERO_PAD[: 8 - nbytes % 8])
        bounds.append(bounds[-1] + (nbytes + 7) // 8)
    if small:
        prefix = [0]
        if bounds[-1]:
            words = torch.cat(parts).view(torch.int64)  # a fresh, aligned buffer
            ends = torch.tensor(bounds[1:], dtype=torch.int64).clamp_(min=1) - 1
            prefix += words.cumsum(0)[ends].tolist()  # int64 prefix sums wrap modulo 2**64 like the sums
        for k, i in enumerate(small):
            lo = prefix[k] if bounds[k] else 0
            hi = prefix[k + 1] if bounds[k + 1] else 0
            total = (hi - lo) & _MASK64
            out[i] = f"{total:016x}{total:016x}"
    return out


class IncrementalChecksum:
    """`checksum` of a tensor computed piece by piece as its bytes arrive, in the receiving
    threads, so it overlaps the other connections' I/O instead of running after the transfer.

    Pieces must start on a 64 KiB block boundary and end on one or at the tensor's end; different
    threads may feed disjoint pieces concurrently.
    """

    def __init__(self, t: torch.Tensor) -> None:
        u8 = _aligned_bytes(t)
        if u8 is None:
            raise ValueError("incremental checksums need an 8-byte aligned tensor")
        self._u8 = u8
        self._nbytes = u8.numel()
        self._nblocks = self._nbytes // BLOCK_BYTES
        self._sums = torch.zeros(self._nblocks, dtype=torch.int64, device=u8.device)
        self._rest: int | None = None if self._nbytes else 0

    def update(self, lo: int, hi: int) -> None:
        """Account for the bytes ``[lo, hi)`` (which have arrived)."""
        if lo % BLOCK_BYTES or (hi % BLOCK_BYTES and hi != self._nbytes):
            raise ValueError(f"piece [{lo}, {hi}) is not block aligned")
        j0, j1 = lo // BLOCK_BYTES, min(hi // BLOCK_BYTES, self._nblocks)
        if j1 > j0:
            _block_sums(self._u8, j0, j1, out=self._sums[j0:j1])
        if hi == self._nbytes:
            self._rest = _rest_sum(self._u8, self._nblocks * BLOCK_BYTES)

    def digest(self) -> str:
        """The checksum, once every piece was fed (callers check that all bytes arrived)."""
        if self._rest is None:
            raise ValueError("the end of the tensor was never fed")
        return _digest(self._sums, self._rest)


def checksum_reference(data: bytes) -> str:
    """Pure-Python ``sum64`` (slow; the specification that `checksum` is tested against)."""
    padded = data + b"\0" * (-len(data) % 8)
    words = [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)]
    nfull = (len(data) // 8) // _SUM_BLOCK_WORDS
    s1 = s2 = 0
    for i, w in enumerate(words):
        s1 += w
        s2 += (min(i // _SUM_BLOCK_WORDS, nfull) + 1) * w
    return f"{s1 & _MASK64:016x}{s2 & _MASK64:016x}"
