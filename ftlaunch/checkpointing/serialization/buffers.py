"""Raw access to a tensor's bytes: views for sockets and checksums, and backing fresh memory.

Why its own module: the encoder, the checksums and both transports' receivers all move tensor
bytes without copying them, and they must agree on how (a uint8 view sharing the storage, a
memoryview tied to the tensor's lifetime). Zero copy is what makes a live-recovery transfer run at
memory speed: the sender hands `byte_view`s of its tensors to the socket, the receiver reads the
socket straight into `byte_view`s of the destination tensors.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any

import torch

__all__ = ["byte_view", "prefault", "tensor_bytes"]


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 tensor sharing its storage."""
    return t.detach().reshape(-1).view(torch.uint8)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (no copy, no numpy needed).

    The view keeps the tensor alive, so its storage cannot be freed while the view is in use.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    arr = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    arr._ftlaunch_owner = t  # type: ignore[attr-defined]  # tie the storage's lifetime to the view
    return memoryview(arr).cast("B")


_MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux >= 5.14
_PAGE = mmap.PAGESIZE


def _load_madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def prefault(t: torch.Tensor, lo: int = 0, hi: int | None = None) -> bool:
    """Have the kernel back bytes ``[lo, hi)`` of a contiguous CPU tensor with memory now, without
    writing them (``madvise(MADV_POPULATE_WRITE)``; the GIL is released during the call).

    Fresh memory is mapped lazily: the kernel allocates and zeroes each 4 KiB page on its first
    write. When that first write is a socket read, the faults are taken while the read holds the
    socket, which stalls the connection; a receiver calls this just before reading a piece into
    fresh memory instead. Only whole pages inside the range are populated and no byte changes, so
    calling it on memory that is already backed (or concurrently written) is harmless and cheap.

    Returns False where unsupported (not Linux, kernel < 5.14, not a CPU tensor) or when the kernel
    declined (e.g. memory pressure): the writes then fault the pages as usual.
    """
    global _madvise
    fn = _madvise
    if fn is None or t.device.type != "cpu":
        return False
    nbytes = t.numel() * t.element_size()
    hi = nbytes if hi is None else min(hi, nbytes)
    start = -(-(t.data_ptr() + lo) // _PAGE) * _PAGE
    end = (t.data_ptr() + hi) // _PAGE * _PAGE
    if end <= start:
        return True
    if fn(start, end - start, _MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == 22:  # EINVAL: this kernel has no MADV_POPULATE_WRITE
        _madvise = None
    return False
