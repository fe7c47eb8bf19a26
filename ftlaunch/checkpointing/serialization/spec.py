"""What version 1 of the checkpoint format allows: its constants, limits and dtypes.

The header parser, the tree codec and the encoder all check values against these, so the rules a
receiver enforces and the ones a sender follows cannot drift apart. `invalid` is the one error for
a payload that breaks them: every rejection reads "invalid checkpoint payload: ..." and is a
`CheckpointTransportError`, so the Manager treats a hostile or corrupt payload like a lost peer.
"""

from __future__ import annotations

import torch

from ftlaunch.errors import CheckpointTransportError

__all__ = [
    "ALIGNMENT",
    "CHECKSUM",
    "DTYPES",
    "DTYPE_NAMES",
    "FORMAT",
    "MAGIC",
    "MAX_DEPTH",
    "MAX_HEADER_BYTES",
    "MAX_NDIM",
    "VERSION",
    "invalid",
    "is_int",
]

MAGIC = b"FTLCKPT1"
FORMAT = "ftlaunch.checkpoint"
VERSION = 1
CHECKSUM = "sum64-v1"
#: Every tensor starts at a multiple of this many bytes of the body.
ALIGNMENT = 64
#: A header larger than this is rejected before it is read (a million tensors fit well below it).
MAX_HEADER_BYTES = 256 << 20
#: Nesting deeper than this is rejected (deep JSON would otherwise exhaust the stack).
MAX_DEPTH = 100
MAX_NDIM = 64

_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16",
    "complex32", "complex64", "complex128",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "bool",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
)  # fmt: skip
#: The only dtypes a header may name (name -> dtype); quantized/bit-packed dtypes are excluded.
DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}
#: dtype -> its name in a header.
DTYPE_NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}


def invalid(msg: str) -> CheckpointTransportError:
    """The error for a payload that breaks the format (raise it)."""
    return CheckpointTransportError(f"invalid checkpoint payload: {msg}")


def is_int(x: object) -> bool:
    """An int and not a bool: JSON ``true`` must not pass for 1 in a header."""
    return type(x) is int
