"""The header frame: what a receiver reads first, and validates completely before it allocates.

``header frame`` = ``MAGIC`` (8 bytes) | JSON length (uint64 LE) | crc32 of the JSON (uint32 LE) | JSON

Why JSON and not ``torch.save``/pickle: the bytes come from the network, and unpickling them runs
whatever code the peer (or anyone who can reach the port) chooses. The receiver checks the magic
and the length before reading the JSON, the crc32 before parsing it, and then the schema exactly
(known keys, exact types, whitelisted dtypes, every tensor inside the body and none overlapping),
so a `Header` it returns describes a body that can be received into tensors of validated dtype
and shape. The header is small, so crc32 protects it; tensor bytes carry `checksum.checksum`.

A sender that streams the tensors while it checksums them (the process-group transport: its sends
run on the process group's threads) cannot know the checksums when the header goes out. Its header
says ``"sum": ""`` (`PENDING_SUM`) for every tensor, and a *sums frame* follows the body:
crc32 (uint32 LE) | the tensors' checksums, 32 hex digits each, in order (`frame_sums`,
`parse_sums`). A receiver accepts pending sums only where it asked for them (``sums_follow``).
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ftlaunch.checkpointing.serialization import tree
from ftlaunch.checkpointing.serialization.spec import (
    ALIGNMENT,
    CHECKSUM,
    DTYPE_NAMES,
    DTYPES,
    FORMAT,
    MAGIC,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    VERSION,
    invalid,
    is_int,
)
from ftlaunch.errors import CheckpointTransportError

if TYPE_CHECKING:
    from ftlaunch.checkpointing.serialization.limits import Deadline

#: Entries validated between two deadline checks.
_CHECK_EVERY = 4096

__all__ = [
    "FRAME_PREFIX_LEN",
    "MAX_FRAME_BYTES",
    "Header",
    "TensorEntry",
    "PENDING_SUM",
    "frame_header",
    "frame_sums",
    "parse_frame_prefix",
    "parse_header",
    "parse_sums",
    "sums_frame_nbytes",
    "with_sums",
]

#: A tensor's ``sum`` in a header whose checksums follow the body in a sums frame.
PENDING_SUM = ""
_SUM_LEN = 32
_CRC = struct.Struct("<I")

_PREFIX = struct.Struct("<8sQI")
#: Bytes before the JSON in a header frame: magic, JSON length, crc32.
FRAME_PREFIX_LEN = _PREFIX.size
#: The largest header frame a receiver accepts (checked before reading it).
MAX_FRAME_BYTES = FRAME_PREFIX_LEN + MAX_HEADER_BYTES

_HEADER_KEYS = {
    "format",
    "version",
    "step",
    "byteorder",
    "checksum",
    "alignment",
    "body_nbytes",
    "tensors",
    "tree",
}
_TENSOR_KEYS = {"dtype", "shape", "offset", "nbytes", "sum", "requires_grad"}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the body, as described (and validated) by the header."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    sum: str
    requires_grad: bool

    def to_json(self) -> dict:
        return {
            "dtype": DTYPE_NAMES[self.dtype],
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "sum": self.sum,
            "requires_grad": self.requires_grad,
        }


@dataclass(frozen=True)
class Header:
    """A whole payload's description: the step, the body size, its tensors and the value tree."""

    step: int
    body_nbytes: int
    tensors: tuple[TensorEntry, ...]
    tree: Any  # validated JSON node (see docs/checkpointing.md)


def frame_header(header: Header) -> bytes:
    """The header frame (prefix + JSON) a sender sends before the body."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "step": header.step,
        "byteorder": sys.byteorder,
        "checksum": CHECKSUM,
        "alignment": ALIGNMENT,
        "body_nbytes": header.body_nbytes,
        "tensors": [e.to_json() for e in header.tensors],
        "tree": header.tree,
    }
    raw = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return _PREFIX.pack(MAGIC, len(raw), zlib.crc32(raw)) + raw


def parse_frame_prefix(prefix: bytes | bytearray | memoryview) -> int:
    """Validate the fixed-size start of a header frame; return the JSON length that follows."""
    if len(prefix) < FRAME_PREFIX_LEN:
        raise invalid(f"header frame truncated ({len(prefix)} < {FRAME_PREFIX_LEN} bytes)")
    magic, length, _crc = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise invalid(f"bad magic {bytes(magic)!r} (not an ftlaunch checkpoint; pickles are never accepted)")
    if length > MAX_HEADER_BYTES:
        raise invalid(f"header length {length} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    return length


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite JSON constant {name}")


def parse_header(
    frame: bytes | bytearray | memoryview,
    expected_step: int | None = None,
    *,
    max_tensors: int | None = None,
    deadline: Deadline | None = None,
    sums_follow: bool = False,
) -> Header:
    """Parse and fully validate a header frame. Anything malformed -> CheckpointTransportError.

    ``max_tensors`` (`limits.ReceiveLimits`) is checked right after the JSON is parsed, before any
    entry is validated; ``deadline`` between the stages and every few thousand entries.
    ``sums_follow``: every tensor's checksum must be `PENDING_SUM` (a sums frame follows the
    body); otherwise each must be a checksum."""
    length = parse_frame_prefix(frame)
    _magic, _len, crc = _PREFIX.unpack_from(frame)
    if len(frame) != FRAME_PREFIX_LEN + length:
        raise invalid(f"header frame is {len(frame)} bytes, expected {FRAME_PREFIX_LEN + length}")
    raw = bytes(frame[FRAME_PREFIX_LEN:])
    if zlib.crc32(raw) != crc:
        raise invalid("header checksum mismatch (corrupted header)")
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise invalid(f"header is not valid JSON: {e}") from None
    if deadline is not None:
        deadline.check("parsing the header")
    if max_tensors is not None and isinstance(doc, dict) and isinstance(doc.get("tensors"), list):
        if len(doc["tensors"]) > max_tensors:
            raise invalid(
                f"header lists {len(doc['tensors'])} tensors, more than the {max_tensors} this "
                "receiver accepts (its own state has far fewer)"
            )
    header = _validate_header(doc, deadline, sums_follow)
    if expected_step is not None and header.step != expected_step:
        raise CheckpointTransportError(f"checkpoint is for step {header.step}, expected step {expected_step}")
    return header


def _validate_header(doc: Any, deadline: Deadline | None = None, sums_follow: bool = False) -> Header:
    if not isinstance(doc, dict) or set(doc) != _HEADER_KEYS:
        keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise invalid(f"header must be an object with keys {sorted(_HEADER_KEYS)}, got {keys}")
    if doc["format"] != FORMAT or doc["version"] != VERSION:
        raise invalid(f"unsupported format {doc['format']!r} version {doc['version']!r}")
    if doc["byteorder"] != sys.byteorder:
        raise invalid(f"byte order {doc['byteorder']!r} differs from this machine's {sys.byteorder!r}")
    if doc["checksum"] != CHECKSUM or doc["alignment"] != ALIGNMENT:
        raise invalid(f"unsupported checksum {doc['checksum']!r} / alignment {doc['alignment']!r}")
    step, body_nbytes = doc["step"], doc["body_nbytes"]
    if not is_int(step) or not is_int(body_nbytes) or body_nbytes < 0:
        raise invalid("step and body_nbytes must be integers (body_nbytes >= 0)")
    if not isinstance(doc["tensors"], list):
        raise invalid("tensors must be a list")
    checked = []
    for i, e in enumerate(doc["tensors"]):
        if deadline is not None and i % _CHECK_EVERY == _CHECK_EVERY - 1:
            deadline.check("validating the header")
        checked.append(_validate_entry(i, e, body_nbytes, sums_follow))
    entries = tuple(checked)
    end = 0
    for e in sorted((e for e in entries if e.nbytes), key=lambda e: e.offset):
        if e.offset < end:
            raise invalid(f"tensor {e.index} overlaps the previous tensor")
        end = e.offset + e.nbytes
    if deadline is not None:
        deadline.check("validating the header")
    refs: set[int] = set()
    tree.validate(doc["tree"], len(entries), refs)
    if len(refs) != len(entries):
        raise invalid(f"{len(entries) - len(refs)} tensors are not referenced by the tree")
    return Header(step=step, body_nbytes=body_nbytes, tensors=entries, tree=doc["tree"])


def _validate_entry(i: int, e: Any, body_nbytes: int, sums_follow: bool) -> TensorEntry:
    if not isinstance(e, dict) or set(e) != _TENSOR_KEYS:
        raise invalid(f"tensor {i}: must be an object with keys {sorted(_TENSOR_KEYS)}")
    dtype = DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
    if dtype is None:
        raise invalid(f"tensor {i}: dtype {e['dtype']!r} is not allowed")
    shape = e["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(is_int(s) and s >= 0 for s in shape):
        raise invalid(f"tensor {i}: bad shape {shape!r}")
    offset, nbytes = e["offset"], e["nbytes"]
    if not is_int(offset) or not is_int(nbytes) or offset < 0 or nbytes < 0:
        raise invalid(f"tensor {i}: offset/nbytes must be non-negative integers")
    numel = 1
    for s in shape:
        numel *= s
    if numel * dtype.itemsize != nbytes:
        raise invalid(f"tensor {i}: nbytes {nbytes} does not match dtype {e['dtype']} and shape {shape}")
    if offset + nbytes > body_nbytes:
        raise invalid(
            f"tensor {i}: bytes [{offset}, {offset + nbytes}) lie outside the body ({body_nbytes} bytes)"
        )
    s = e["sum"]
    if sums_follow:
        if s != PENDING_SUM:
            raise invalid(f"tensor {i}: checksum {s!r} where the sums frame was to carry it")
    elif not _is_sum(s):
        raise invalid(f"tensor {i}: bad checksum {s!r}")
    if type(e["requires_grad"]) is not bool:
        raise invalid(f"tensor {i}: requires_grad must be a boolean")
    return TensorEntry(i, dtype, tuple(shape), offset, nbytes, s, e["requires_grad"])


def _is_sum(s: Any) -> bool:
    return isinstance(s, str) and len(s) == _SUM_LEN and all(c in "0123456789abcdef" for c in s)


def sums_frame_nbytes(ntensors: int) -> int:
    """Size of the sums frame of a header with ``ntensors`` tensors."""
    return _CRC.size + _SUM_LEN * ntensors


def frame_sums(sums: list[str]) -> bytes:
    """The sums frame that follows a body whose header had pending sums (see the module docstring)."""
    raw = "".join(sums).encode("ascii")
    if len(raw) != _SUM_LEN * len(sums):
        raise ValueError("every checksum must be 32 hex digits")
    return _CRC.pack(zlib.crc32(raw)) + raw


def parse_sums(frame: bytes | bytearray | memoryview, ntensors: int) -> list[str]:
    """Validate a sums frame for ``ntensors`` tensors; its checksums, in order."""
    if len(frame) != sums_frame_nbytes(ntensors):
        raise invalid(f"sums frame is {len(frame)} bytes, expected {sums_frame_nbytes(ntensors)}")
    raw = bytes(frame[_CRC.size :])
    if zlib.crc32(raw) != _CRC.unpack_from(frame)[0]:
        raise invalid("sums frame checksum mismatch (corrupted)")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise invalid("sums frame is not ASCII") from None
    sums = [text[k : k + _SUM_LEN] for k in range(0, len(text), _SUM_LEN)]
    bad = next((k for k, s in enumerate(sums) if not _is_sum(s)), None)
    if bad is not None:
        raise invalid(f"tensor {bad}: bad checksum {sums[bad]!r} in the sums frame")
    return sums


def with_sums(header: Header, sums: list[str]) -> Header:
    """``header`` with its pending checksums filled in from a parsed sums frame."""
    if len(sums) != len(header.tensors):
        raise invalid(f"{len(sums)} checksums for {len(header.tensors)} tensors")
    entries = tuple(replace(e, sum=s) for e, s in zip(header.tensors, sums, strict=True))
    return replace(header, tensors=entries)
