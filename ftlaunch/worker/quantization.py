"""Low-bit communication: 8- and 4-bit block quantization, and an allreduce that sends it.

Used for DiLoCo's pseudo-gradients (``should_quantize``), where the paper reports that 4-bit outer
gradients train as well as full precision: a 4x (8-bit) or ~8x (4-bit) smaller payload on the slow
cross-group links.

Format. A flat tensor is cut into blocks of `BLOCK_SIZE` elements; each block gets one float32
scale (its largest magnitude / ``qmax``) and symmetric integer codes rounded to nearest
(``qmax`` = 127 for 8 bits, 7 for 4 bits; two 4-bit codes share a byte). Per-block scales keep one
outlier from flattening a whole tensor, for 4 bytes per block (1.6 % at 8 bits). The round trip
error of an element is at most half a step: ``|x - dequantize(quantize(x))| <= absmax(block) /
(2 * qmax)``, plus float32 rounding.

The allreduce (`allreduce_quantized`) is a reduce-scatter then an all-gather, both on quantized
bytes, so each rank sends ``2 (W-1)/W`` of the *quantized* size, like a ring allreduce of the
full-precision tensor would of the full size:

1. quantize the tensor in ``W`` equal chunks and ``all_to_all_single`` them: rank ``r`` receives
   every rank's chunk ``r``;
2. dequantize those ``W`` chunks and sum them in float32 (in rank order), quantize the sum;
3. ``all_gather_single`` the summed chunks and dequantize all of them.

Every rank dequantizes the same gathered bytes, so every rank ends with bit-identical results (a
property fault-tolerant training depends on: groups must not drift apart). The error is that of
two round trips: each input's, then the sum's. Only ``SUM`` is supported (the Manager averages by
dividing before the sum). Plain collectives of uint8 tensors, so it runs on Gloo and NCCL alike.

The two collectives depend on each other (step 2 sits between them), so the operation runs on one
background thread per process and returns a future: every quantized allreduce of the process is
issued in the order it was requested, which keeps the collective order identical on every rank.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch
import torch.distributed as dist

from ftlaunch.process_group.base import ProcessGroup

#: Elements per scale.
BLOCK_SIZE = 256
#: The code range of each width: codes are in [-qmax, qmax].
QMAX = {8: 127, 4: 7}

Bits = Literal[4, 8]

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def bits_of(should_quantize: bool | int) -> Bits:
    """``should_quantize`` as a bit width: True means 8 bits, 4 and 8 are themselves."""
    if should_quantize is True:
        return 8
    if should_quantize in (4, 8) and not isinstance(should_quantize, bool):
        return 8 if should_quantize == 8 else 4
    raise ValueError(f"should_quantize must be True, 8 or 4, got {should_quantize!r}")


def check_quantizable(tensor: torch.Tensor, op: str | dist.ReduceOp | dist.ReduceOp.RedOpType) -> None:
    """ValueError unless a quantized allreduce of ``tensor`` with ``op`` is possible."""
    if not tensor.is_floating_point():
        raise ValueError(f"quantized allreduce needs a floating point tensor, got {tensor.dtype}")
    if isinstance(op, str):
        ok = op.lower() in ("avg", "sum")
    else:
        ok = op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG
    if not ok:
        raise ValueError(f"quantized allreduce supports only avg and sum, got {op}")


def padded_numel(numel: int, chunks: int = 1, block_size: int = BLOCK_SIZE) -> int:
    """The length ``numel`` is padded to: ``chunks`` equal chunks of whole blocks."""
    per_chunk = -(-numel // chunks)
    per_chunk = -(-per_chunk // block_size) * block_size
    return max(per_chunk, block_size) * chunks


def encoded_nbytes(numel: int, bits: Bits, block_size: int = BLOCK_SIZE) -> int:
    """Bytes of the encoding of ``numel`` elements (a multiple of ``block_size``): scales + codes."""
    if numel % block_size:
        raise ValueError(f"{numel} elements are not whole blocks of {block_size}")
    return numel // block_size * 4 + numel * bits // 8


def quantize(x: torch.Tensor, bits: Bits, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8) and per-block float32 scales of a 1-D tensor of whole blocks."""
    if x.dim() != 1 or x.numel() % block_size:
        raise ValueError(
            f"quantize needs a 1-D tensor of whole blocks of {block_size}, got shape {tuple(x.shape)}"
        )
    if bits == 4 and block_size % 2:
        raise ValueError("4-bit blocks must have an even number of elements")
    qmax = QMAX[bits]
    blocks = x.detach().reshape(-1, block_size).float()
    scales = blocks.abs().amax(dim=1) / qmax
    # An all-zero block keeps scale 0 (it dequantizes to zeros); divide by 1 instead of 0.
    divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = torch.round(blocks / divisor[:, None]).clamp_(-qmax, qmax).to(torch.int8).reshape(-1)
    if bits == 8:
        return codes.view(torch.uint8), scales
    nibbles = (codes + 8).to(torch.uint8)  # [-7, 7] -> [1, 15]
    return nibbles[0::2] | (nibbles[1::2] << 4), scales


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, bits: Bits, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """The float32 values of `quantize`'s output."""
    if bits == 8:
        values = codes.view(torch.int8).float()
    else:
        low = (codes & 0x0F).to(torch.int16) - 8
        high = (codes >> 4).to(torch.int16) - 8
        values = torch.stack([low, high], dim=1).reshape(-1).float()
    return (values.reshape(-1, block_size) * scales[:, None]).reshape(-1)


def encode(x: torch.Tensor, chunks: int, bits: Bits, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """``x`` (1-D, ``chunks`` x whole blocks) as ``chunks`` rows of bytes: each row its scales,
    then its codes."""
    codes, scales = quantize(x, bits, block_size)
    return torch.cat([scales.reshape(chunks, -1).view(torch.uint8), codes.reshape(chunks, -1)], dim=1)


def decode(rows: torch.Tensor, bits: Bits, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """`encode`'s inverse: rows of bytes -> one float32 row per chunk."""
    chunks, nbytes = rows.shape
    per_block = 4 + block_size * bits // 8
    nblocks = nbytes // per_block
    scales = rows[:, : 4 * nblocks].contiguous().view(torch.float32).reshape(-1)
    codes = rows[:, 4 * nblocks :].contiguous().reshape(-1)
    return dequantize(codes, scales, bits, block_size).reshape(chunks, -1)


def allreduce_quantized(
    pg: ProcessGroup | dist.ProcessGroup, tensor: torch.Tensor, bits: Bits = 8, block_size: int = BLOCK_SIZE
) -> torch.futures.Future[torch.Tensor]:
    """SUM ``tensor`` over ``pg`` in place, sending ``bits``-bit codes; the future holds ``tensor``.

    The future fails with what the collectives raised (e.g. `CommunicationError`); ``tensor`` is
    then left as it was. See the module docstring for the algorithm and its error.
    """
    check_quantizable(tensor, dist.ReduceOp.SUM)
    # CUDA: the background thread runs on the caller's stream (so it reads ``tensor`` after what the
    # caller queued to produce it), and the future is CUDA-aware (a consumer on another stream --
    # FSDP2 reads its hook's output on its own -- waits for the result instead of reading it early).
    cuda = tensor.is_cuda
    stream = torch.cuda.current_stream(tensor.device) if cuda else None
    fut: torch.futures.Future[torch.Tensor] = (
        torch.futures.Future(devices=[tensor.device]) if cuda else torch.futures.Future()
    )

    def run() -> None:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            try:
                _allreduce(pg, tensor, bits, block_size)
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                fut.set_exception(e)  # type: ignore[arg-type] # torch's stub types it as a result
            else:
                fut.set_result(tensor)

    _background().submit(run)
    return fut


def _allreduce(
    pg: ProcessGroup | dist.ProcessGroup, tensor: torch.Tensor, bits: Bits, block_size: int
) -> None:
    world = pg.size()
    n = tensor.numel()
    flat = torch.zeros(padded_numel(n, world, block_size), dtype=torch.float32, device=tensor.device)
    flat[:n].copy_(tensor.detach().reshape(-1))
    send = encode(flat, world, bits, block_size)  # row j: our chunk j, for rank j
    recv = torch.empty_like(send)
    pg.all_to_all_single(recv, send, [], []).wait()  # row i: rank i's chunk `rank`
    mine = decode(recv, bits, block_size).sum(dim=0)  # float32, in rank order
    gathered = torch.empty(send.numel(), dtype=torch.uint8, device=send.device)
    pg.all_gather_single(gathered, encode(mine, 1, bits, block_size).reshape(-1)).wait()
    total = decode(gathered.view(world, -1), bits, block_size).reshape(-1)[:n]
    tensor.copy_(total.reshape(tensor.shape))


def _background() -> ThreadPoolExecutor:
    """The one thread that issues quantized allreduces, in request order (see the module docstring)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftlaunch-quantized")
        return _executor
