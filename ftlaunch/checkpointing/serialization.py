"""Safe encoding of nested state dicts for live recovery: a JSON header plus raw tensor bytes.

Why not ``torch.save``/pickle: the bytes come from the network, and unpickling them runs whatever
code the peer (or anyone who can reach the port) chooses. Here the receiver only ever parses JSON
and copies raw bytes into tensors whose dtype and shape it validated first.

Wire format, shared by both transports (see docs/checkpointing.md):

``header frame`` = ``MAGIC`` (8 bytes) | JSON length (uint64 LE) | crc32 of the JSON (uint32 LE) | JSON

``body`` = each tensor's bytes at a 64-byte aligned offset, zero padding between them.

Integrity: the header is protected by crc32 (it is small). Tensor bytes are protected per tensor by
``sum64``, an additive checksum over 64-bit words (word sum plus a block-position-weighted sum of
64 KiB block sums, both modulo 2**64). zlib.crc32 runs at ~2.2 GB/s on one core here, and paying it
on both ends capped loopback transfers at ~1.7 GB/s; ``sum64`` is computed by torch's vectorized
integer reduction at ~9-11 GB/s per core, and receivers compute it piece by piece as bytes arrive.
It detects every single-bit error, truncation, zero-fill and misplaced blocks; changes that cancel
modulo 2**64 in both sums (e.g. flipping bit 63 of two words of one block) go unnoticed. It is not a
MAC: integrity against an adversary needs an authenticated channel.

Zero copy: the sender exposes each tensor's storage as a ``memoryview`` (no copy for contiguous CPU
tensors); the receiver reads the body straight into preallocated (or the caller's existing) tensors.
Preallocated tensors each get their own storage (`plan_slots`), and receivers back their pages
ahead of the bytes (`prefault`).
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import json
import logging
import mmap
import struct
import sys
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ftlaunch.errors import CheckpointTransportError

logger = logging.getLogger(__name__)

MAGIC = b"FTLCKPT1"
_PREFIX = struct.Struct("<8sQI")
#: Bytes before the JSON in a header frame: magic, JSON length, crc32.
FRAME_PREFIX_LEN = _PREFIX.size
FORMAT = "ftlaunch.checkpoint"
VERSION = 1
CHECKSUM = "sum64-v1"
ALIGNMENT = 64
#: A header larger than this is rejected before it is read (a million tensors fit well below it).
MAX_HEADER_BYTES = 256 << 20
#: Nesting deeper than this is rejected (deep JSON would otherwise exhaust the stack).
MAX_DEPTH = 100
MAX_NDIM = 64

_SUM_BLOCK_WORDS = 8192  # 64 KiB blocks for the position-weighted half of sum64
# Blocks summed per torch op: 3 * 8192 words stay below ATen's parallel grain size (32768), so every
# op runs on the calling thread. Intra-op threads spin-wait, and on a busy machine (the usual case:
# training processes on every core) the parallel version was 2-8x slower and erratic.
_OP_BLOCKS = 3
#: Checksum block size; receivers cut pieces on these boundaries to checksum them as they arrive.
BLOCK_BYTES = _SUM_BLOCK_WORDS * 8
_MASK64 = (1 << 64) - 1

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
_DTYPE_TO_NAME = {d: n for n, d in DTYPES.items()}

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


# --------------------------------------------------------------------------------------------------
# small helpers


def _fail(msg: str) -> CheckpointTransportError:
    return CheckpointTransportError(f"invalid checkpoint payload: {msg}")


def _is_int(x: object) -> bool:
    return type(x) is int


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


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
    socket, which stalls the connection; a receiver calls this from a helper thread ahead of the
    bytes' arrival instead. Only whole pages inside the range are populated and no byte changes, so
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


# --------------------------------------------------------------------------------------------------
# header


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
            "dtype": _DTYPE_TO_NAME[self.dtype],
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "sum": self.sum,
            "requires_grad": self.requires_grad,
        }


@dataclass(frozen=True)
class Header:
    step: int
    body_nbytes: int
    tensors: tuple[TensorEntry, ...]
    tree: Any  # validated JSON node (see docs/checkpointing.md)


def frame_header(header: Header) -> bytes:
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
        raise _fail(f"header frame truncated ({len(prefix)} < {FRAME_PREFIX_LEN} bytes)")
    magic, length, _crc = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise _fail(f"bad magic {bytes(magic)!r} (not an ftlaunch checkpoint; pickles are never accepted)")
    if length > MAX_HEADER_BYTES:
        raise _fail(f"header length {length} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    return length


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite JSON constant {name}")


def parse_header(frame: bytes | bytearray | memoryview, expected_step: int | None = None) -> Header:
    """Parse and fully validate a header frame. Anything malformed -> CheckpointTransportError."""
    length = parse_frame_prefix(frame)
    _magic, _len, crc = _PREFIX.unpack_from(frame)
    if len(frame) != FRAME_PREFIX_LEN + length:
        raise _fail(f"header frame is {len(frame)} bytes, expected {FRAME_PREFIX_LEN + length}")
    raw = bytes(frame[FRAME_PREFIX_LEN:])
    if zlib.crc32(raw) != crc:
        raise _fail("header checksum mismatch (corrupted header)")
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _fail(f"header is not valid JSON: {e}") from None
    header = _validate_header(doc)
    if expected_step is not None and header.step != expected_step:
        raise CheckpointTransportError(f"checkpoint is for step {header.step}, expected step {expected_step}")
    return header


def _validate_header(doc: Any) -> Header:
    if not isinstance(doc, dict) or set(doc) != _HEADER_KEYS:
        keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise _fail(f"header must be an object with keys {sorted(_HEADER_KEYS)}, got {keys}")
    if doc["format"] != FORMAT or doc["version"] != VERSION:
        raise _fail(f"unsupported format {doc['format']!r} version {doc['version']!r}")
    if doc["byteorder"] != sys.byteorder:
        raise _fail(f"byte order {doc['byteorder']!r} differs from this machine's {sys.byteorder!r}")
    if doc["checksum"] != CHECKSUM or doc["alignment"] != ALIGNMENT:
        raise _fail(f"unsupported checksum {doc['checksum']!r} / alignment {doc['alignment']!r}")
    step, body_nbytes = doc["step"], doc["body_nbytes"]
    if not _is_int(step) or not _is_int(body_nbytes) or body_nbytes < 0:
        raise _fail("step and body_nbytes must be integers (body_nbytes >= 0)")
    if not isinstance(doc["tensors"], list):
        raise _fail("tensors must be a list")
    entries = tuple(_validate_entry(i, e, body_nbytes) for i, e in enumerate(doc["tensors"]))
    end = 0
    for e in sorted((e for e in entries if e.nbytes), key=lambda e: e.offset):
        if e.offset < end:
            raise _fail(f"tensor {e.index} overlaps the previous tensor")
        end = e.offset + e.nbytes
    refs: set[int] = set()
    _validate_node(doc["tree"], len(entries), refs, 0)
    if len(refs) != len(entries):
        raise _fail(f"{len(entries) - len(refs)} tensors are not referenced by the tree")
    return Header(step=step, body_nbytes=body_nbytes, tensors=entries, tree=doc["tree"])


def _validate_entry(i: int, e: Any, body_nbytes: int) -> TensorEntry:
    if not isinstance(e, dict) or set(e) != _TENSOR_KEYS:
        raise _fail(f"tensor {i}: must be an object with keys {sorted(_TENSOR_KEYS)}")
    dtype = DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
    if dtype is None:
        raise _fail(f"tensor {i}: dtype {e['dtype']!r} is not allowed")
    shape = e["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(s) and s >= 0 for s in shape):
        raise _fail(f"tensor {i}: bad shape {shape!r}")
    offset, nbytes = e["offset"], e["nbytes"]
    if not _is_int(offset) or not _is_int(nbytes) or offset < 0 or nbytes < 0:
        raise _fail(f"tensor {i}: offset/nbytes must be non-negative integers")
    numel = 1
    for s in shape:
        numel *= s
    if numel * dtype.itemsize != nbytes:
        raise _fail(f"tensor {i}: nbytes {nbytes} does not match dtype {e['dtype']} and shape {shape}")
    if offset + nbytes > body_nbytes:
        raise _fail(
            f"tensor {i}: bytes [{offset}, {offset + nbytes}) lie outside the body ({body_nbytes} bytes)"
        )
    s = e["sum"]
    if not isinstance(s, str) or len(s) != 32 or any(c not in "0123456789abcdef" for c in s):
        raise _fail(f"tensor {i}: bad checksum {s!r}")
    if type(e["requires_grad"]) is not bool:
        raise _fail(f"tensor {i}: requires_grad must be a boolean")
    return TensorEntry(i, dtype, tuple(shape), offset, nbytes, s, e["requires_grad"])


def _validate_node(node: Any, ntensors: int, refs: set[int], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _fail(f"tree nested deeper than {MAX_DEPTH}")
    if node is None or isinstance(node, (bool, int, str)):
        return
    if not isinstance(node, dict) or len(node) != 1:
        raise _fail(f"bad tree node of type {type(node).__name__}")
    ((tag, val),) = node.items()
    if tag in ("list", "tuple"):
        if not isinstance(val, list):
            raise _fail(f"{tag} node needs a list")
        for child in val:
            _validate_node(child, ntensors, refs, depth + 1)
    elif tag in ("dict", "odict"):
        if not isinstance(val, list):
            raise _fail(f"{tag} node needs a list of pairs")
        for pair in val:
            if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], (str, int)):
                raise _fail(f"{tag} entries must be [key, value] with a string or integer key")
            _validate_node(pair[1], ntensors, refs, depth + 1)
    elif tag == "tensor":
        if not _is_int(val) or not 0 <= val < ntensors:
            raise _fail(f"tensor reference {val!r} out of range")
        refs.add(val)
    elif tag == "float":
        if not isinstance(val, str):
            raise _fail("float node needs a hex string")
        try:
            _float_value(val)
        except (ValueError, OverflowError, struct.error):
            raise _fail(f"bad float {val!r}") from None
    elif tag == "size":
        if not isinstance(val, list) or not all(_is_int(s) and s >= 0 for s in val):
            raise _fail("size node needs a list of non-negative integers")
    elif tag == "dtype":
        if val not in DTYPES:
            raise _fail(f"dtype {val!r} is not allowed")
    elif tag == "device":
        try:
            torch.device(val)
        except (RuntimeError, TypeError, ValueError):
            raise _fail(f"bad device {val!r}") from None
    else:
        raise _fail(f"unknown tree node tag {tag!r}")


# --------------------------------------------------------------------------------------------------
# encoding


def _float_text(x: float) -> str:
    """Exact text for a float: ``float.hex`` (covers inf and -0.0), NaN as ``nan:<64-bit pattern>``
    because ``float.hex`` drops a NaN's sign and payload."""
    if x != x:
        return "nan:" + struct.pack(">d", x).hex()
    return x.hex()


def _float_value(text: str) -> float:
    if text.startswith("nan:"):
        bits = text[4:]
        if len(bits) != 16:
            raise ValueError(text)
        x = struct.unpack(">d", bytes.fromhex(bits))[0]
        if x == x:
            raise ValueError(text)
        return x
    if "nan" in text.lower():
        raise ValueError(text)
    return float.fromhex(text)


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


class _Encoder:
    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.tensors: list[torch.Tensor] = []
        self.requires_grad: list[bool] = []
        self.seen: dict[int, int] = {}  # id(tensor) -> index, so shared (tied) tensors travel once
        self.keepalive: list[torch.Tensor] = []  # keeps ids in `seen` unique during encoding
        self.active: set[int] = set()  # containers on the current path (cycle detection)

    def node(self, x: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"state dict nested deeper than {MAX_DEPTH} at {path}")
        if x is None or isinstance(x, (bool, str)) or type(x) is int:
            return x
        if type(x) is float:
            return {"float": _float_text(x)}
        if isinstance(x, torch.Tensor):
            return {"tensor": self.tensor(x, path)}
        if isinstance(x, torch.Size):
            return {"size": list(x)}
        if isinstance(x, torch.dtype):
            if x not in _DTYPE_TO_NAME:
                raise TypeError(f"dtype {x} at {path} is not supported")
            return {"dtype": _DTYPE_TO_NAME[x]}
        if isinstance(x, torch.device):
            return {"device": str(x)}
        if type(x) in (dict, collections.OrderedDict, collections.defaultdict) or type(x) in (list, tuple):
            if id(x) in self.active:
                raise ValueError(f"state dict contains a reference cycle at {path}")
            self.active.add(id(x))
            try:
                if isinstance(x, dict):
                    pairs = []
                    for k, v in x.items():
                        if not isinstance(k, (str, int)):
                            raise TypeError(f"dict key {k!r} at {path} must be str or int")
                        pairs.append([k, self.node(v, f"{path}.{k}", depth + 1)])
                    return {"odict" if type(x) is collections.OrderedDict else "dict": pairs}
                tag = "list" if type(x) is list else "tuple"
                return {tag: [self.node(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(x)]}
            finally:
                self.active.discard(id(x))
        raise TypeError(
            f"cannot encode {type(x).__name__} at {path}: only tensors, dict/list/tuple, None, bool, "
            "int, float, str, torch.Size/dtype/device are supported"
        )

    def tensor(self, t: torch.Tensor, path: str) -> int:
        if id(t) in self.seen:
            return self.seen[id(t)]
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"tensor subclass {type(t).__name__} at {path} is not supported")
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise TypeError(
                f"tensor at {path} must be a dense, materialized tensor (got {t.layout}, {t.device})"
            )
        if t.dtype not in _DTYPE_TO_NAME:
            raise TypeError(f"dtype {t.dtype} of tensor at {path} is not supported")
        p = t.detach().resolve_conj().resolve_neg()
        if self.device is not None and p.device != self.device:
            p = p.to(self.device)
        p = p.contiguous()  # no copy when already contiguous
        self.seen[id(t)] = len(self.tensors)
        self.keepalive.append(t)
        self.tensors.append(p)
        self.requires_grad.append(bool(t.requires_grad))
        return len(self.tensors) - 1


def encode(state_dict: Any, step: int, device: torch.device | None = None) -> Encoded:
    """Describe ``state_dict`` for sending. Unsupported leaves raise TypeError (misuse).

    Tensors are moved to ``device`` when given (the HTTP transport serves CPU bytes); contiguous
    tensors already there are not copied. Checksums are computed here, so a caller who mutates a
    tensor while it is being served is caught by the receiver instead of silently tearing the copy.
    """
    if not _is_int(step):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    enc = _Encoder(device)
    tree = enc.node(state_dict, "state_dict", 0)
    entries = []
    offset = 0
    sums = checksums(enc.tensors)
    for i, t in enumerate(enc.tensors):
        nbytes = t.numel() * t.element_size()
        off = align_up(offset) if nbytes else 0
        entries.append(TensorEntry(i, t.dtype, tuple(t.shape), off, nbytes, sums[i], enc.requires_grad[i]))
        if nbytes:
            offset = off + nbytes
    header = Header(step=step, body_nbytes=offset, tensors=tuple(entries), tree=tree)
    return Encoded(header=header, frame=frame_header(header), tensors=enc.tensors)


# --------------------------------------------------------------------------------------------------
# body layout (shared by senders and receivers)

_ZEROS = memoryview(bytes(ALIGNMENT))


@dataclass(frozen=True)
class Segment:
    """``length`` bytes of the body at ``offset`` live in ``view``: tensor ``index``'s bytes, or
    padding (``index`` -1)."""

    offset: int
    length: int
    view: memoryview
    index: int = -1


def layout(header: Header, views: Sequence[memoryview], padding: memoryview | None = None) -> list[Segment]:
    """Segments covering the whole body in order: tensor bytes and the padding between them.

    ``views[i]`` holds tensor i's bytes; ``padding`` (>= ALIGNMENT bytes) stands in for the gaps —
    zeros on the sending side, a scratch buffer on the receiving side.
    """
    pad = _ZEROS if padding is None else padding
    segs: list[Segment] = []
    pos = 0
    for e in sorted((e for e in header.tensors if e.nbytes), key=lambda e: e.offset):
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


# --------------------------------------------------------------------------------------------------
# decoding


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
                f"checksum mismatch for tensor {self.entry.index} ({_DTYPE_TO_NAME[self.entry.dtype]}"
                f"{list(self.entry.shape)}): payload corrupted, truncated or mutated while being sent"
            )

    def commit(self) -> torch.Tensor:
        if self.target is not self.landing:
            with torch.no_grad():
                self.target.copy_(self.landing)
        return self.target


def _match_templates(node: Any, template: Any, found: dict[int, torch.Tensor], depth: int) -> None:
    """Walk the header tree beside the caller's current state to find tensors to receive in place."""
    if depth > MAX_DEPTH or not isinstance(node, dict):
        return
    ((tag, val),) = node.items()
    if tag == "tensor":
        if isinstance(template, torch.Tensor) and val not in found:
            found[val] = template
    elif tag in ("dict", "odict") and isinstance(template, Mapping):
        for k, v in val:
            if k in template:
                _match_templates(v, template[k], found, depth + 1)
    elif tag in ("list", "tuple") and isinstance(template, (list, tuple)) and len(template) == len(val):
        for v, t in zip(val, template, strict=True):
            _match_templates(v, t, found, depth + 1)


def plan_slots(header: Header, device: torch.device, template: Any = None) -> list[Slot]:
    """Allocate (or reuse from ``template``) the tensors the body is received into.

    A template tensor is reused in place when it has the same dtype and shape, is contiguous and
    dense, and is not already used for another tensor; otherwise a fresh tensor is allocated. Reuse
    avoids allocation and page faults and keeps the caller's tensor identity (optimizers hold
    references to parameters).
    """
    found: dict[int, torch.Tensor] = {}
    if template is not None:
        _match_templates(header.tree, template, found, 0)
    used: set[int] = set()
    slots = []
    for e in header.tensors:
        t = found.get(e.index)
        if t is not None and (
            type(t) in (torch.Tensor, torch.nn.Parameter)
            and t.dtype == e.dtype
            and tuple(t.shape) == e.shape
            and t.layout == torch.strided
            and t.is_contiguous()
            and not t.is_conj()
            and not t.is_neg()
            and id(t) not in used
        ):
            used.add(id(t))
            if t.device == device:
                slots.append(Slot(e, t.detach(), t))
            else:
                slots.append(Slot(e, torch.empty(e.shape, dtype=e.dtype, device=device), t, fresh=True))
        else:
            fresh = torch.empty(e.shape, dtype=e.dtype, device=device)
            slots.append(Slot(e, fresh, fresh, fresh=True))
    return slots


def build(header: Header, targets: Sequence[torch.Tensor]) -> Any:
    """Rebuild the state dict from a validated header and its received tensors."""
    for e, t in zip(header.tensors, targets, strict=True):
        if (
            e.requires_grad
            and t.is_leaf
            and not t.requires_grad
            and (t.is_floating_point() or t.is_complex())
        ):
            t.requires_grad_(True)
    return _build_node(header.tree, targets)


def _build_node(node: Any, targets: Sequence[torch.Tensor]) -> Any:
    if node is None or isinstance(node, (bool, int, str)):
        return node
    ((tag, val),) = node.items()
    if tag == "tensor":
        return targets[val]
    if tag == "list":
        return [_build_node(v, targets) for v in val]
    if tag == "tuple":
        return tuple(_build_node(v, targets) for v in val)
    if tag == "dict":
        return {k: _build_node(v, targets) for k, v in val}
    if tag == "odict":
        return collections.OrderedDict((k, _build_node(v, targets)) for k, v in val)
    if tag == "float":
        return _float_value(val)
    if tag == "size":
        return torch.Size(val)
    if tag == "dtype":
        return DTYPES[val]
    if tag == "device":
        return torch.device(val)
    raise _fail(f"unknown tree node tag {tag!r}")  # unreachable after validation


def finish(header: Header, slots: Sequence[Slot]) -> Any:
    """Verify every received tensor, copy into the caller's tensors where needed, rebuild the tree."""
    rest = [s for s in slots if s.incremental is None]
    for s, got in zip(rest, checksums([s.landing for s in rest]), strict=True):
        s.verify(got)
    for s in slots:
        if s.incremental is not None:
            s.verify()
    return build(header, [s.commit() for s in slots])


# --------------------------------------------------------------------------------------------------
# whole payload in memory (tools, tests, small states)


def dumps(state_dict: Any, step: int = 0) -> bytes:
    """Header frame followed by the body, as one bytes object."""
    enc = encode(state_dict, step, device=torch.device("cpu"))
    out = bytearray(len(enc.frame) + enc.body_nbytes)
    out[: len(enc.frame)] = enc.frame
    body = memoryview(out)[len(enc.frame) :]
    for e, t in zip(enc.header.tensors, enc.tensors, strict=True):
        if e.nbytes:
            body[e.offset : e.offset + e.nbytes] = byte_view(t)
    return bytes(out)


def loads(
    data: bytes | bytearray | memoryview, expected_step: int | None = None, template: Any = None
) -> Any:
    """Decode what `dumps` produced (copying into fresh or ``template`` tensors); validates fully."""
    mv = memoryview(data).cast("B")
    length = parse_frame_prefix(mv[:FRAME_PREFIX_LEN])
    header = parse_header(mv[: FRAME_PREFIX_LEN + length], expected_step)
    body = mv[FRAME_PREFIX_LEN + length :]
    if len(body) != header.body_nbytes:
        raise _fail(f"body is {len(body)} bytes, header says {header.body_nbytes} (truncated or padded)")
    slots = plan_slots(header, torch.device("cpu"), template)
    for s in slots:
        if s.entry.nbytes:
            byte_view(s.landing)[:] = body[s.entry.offset : s.entry.offset + s.entry.nbytes]
    return finish(header, slots)


__all__ = [
    "ALIGNMENT",
    "BLOCK_BYTES",
    "CHECKSUM",
    "DTYPES",
    "Encoded",
    "FRAME_PREFIX_LEN",
    "Header",
    "IncrementalChecksum",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "Piece",
    "Segment",
    "Slot",
    "TensorEntry",
    "build",
    "byte_view",
    "checksum",
    "checksum_reference",
    "checksums",
    "batches",
    "dumps",
    "encode",
    "finish",
    "frame_header",
    "iter_range",
    "layout",
    "loads",
    "parse_frame_prefix",
    "parse_header",
    "plan_slots",
    "prefault",
    "split_body",
    "tensor_bytes",
]
