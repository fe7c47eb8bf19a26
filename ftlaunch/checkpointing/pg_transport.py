"""Live recovery over a process group: point-to-point sends between the healthy and healing groups.

Useful where the groups already share a (reconfigured) process group — e.g. NCCL between GPUs,
where HTTP would bounce through host memory. Only the standard ``torch.distributed.ProcessGroup``
interface is used (``pg.send([t], dst, tag)`` / ``pg.recv([t], src, tag)`` and ``Work.wait``), so
plain Gloo/NCCL groups and ftlaunch's reconfigurable groups both work.

Protocol, per receiver (tags are fixed, so messages cannot be confused):
  1. ``int64[1]`` — length of the header frame            (tag ``TAG_BASE``)
  2. ``uint8[length]`` — the header frame (JSON + crc32), its checksums pending
                                                           (tag ``TAG_BASE + 1``)
  3. the tensors' bytes as ``uint8``, one message per tensor -- on a GPU, one per tensor of
     ``PACK_BELOW`` bytes or more and one per *pack* of smaller neighbours (`messages`)
                                                           (tag ``TAG_BASE + 2 + first index``)
  4. ``uint8[]`` — the sums frame: every tensor's checksum (tag ``TAG_BASE - 1``; its size follows
     from the header)
The receiver validates the header before posting any tensor receive, receives in place into the
tensors of ``state_dict()`` where dtype and shape match, then verifies every tensor's checksum.

Why the checksums come last: the sends run on the process group's own threads, so the sender
checksums its tensors while they travel, and the receiver checksums each tensor as soon as it has
landed, while the next ones arrive. With the checksums in the header, a 256 MB state paid a full
pass over the bytes on each side before the first byte moved and after the last one landed.

Why small tensors travel packed on a GPU: every message is one process-group op -- a Baby hop to
the child and back, and over NCCL a collective's latency (NCCL runs the point-to-point ops of one
communicator one after the other). A sharded state of a few hundred small tensors (norms, biases,
FSDP2 shards) paid that a few hundred times: on one GPU over NCCL's socket transport, 19.9 MB in 212
tensors took 3.9 s. Packing costs a device copy of the small tensors on each side, which on a GPU is
nearly free; on CPU it is a memory copy that Gloo's cheap point-to-point ops do not repay, so there
every tensor travels alone and lands in place (`PGTransport`'s ``packed``; both sides of a transfer
use the same group, so the same device and the same setting).

Sharded state (DTensors, e.g. FSDP2 parameters and optimizer state): each rank sends its local
shards only, with their sharding as plain JSON beside the state (`ftlaunch.checkpointing.dtensors`):
the encoded value is ``{"state": <state, local shards in place of DTensors>, "dtensors": [specs]}``.
The receiver rebuilds each DTensor on ``device_mesh`` (or on the mesh of its own DTensor at the
same path in ``state_dict()``) and refuses a shard whose sharding differs from its own.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ftlaunch.checkpointing import dtensors
from ftlaunch.checkpointing.serialization.buffers import byte_view, tensor_bytes
from ftlaunch.checkpointing.serialization.checksum import BLOCK_BYTES, checksum, checksums
from ftlaunch.checkpointing.serialization.encode import encode
from ftlaunch.checkpointing.serialization.header import (
    FRAME_PREFIX_LEN,
    MAX_FRAME_BYTES,
    frame_sums,
    parse_header,
    parse_sums,
    sums_frame_nbytes,
    with_sums,
)
from ftlaunch.checkpointing.serialization.limits import Deadline, ReceiveLimits
from ftlaunch.checkpointing.serialization.receive import finish, plan_slots
from ftlaunch.checkpointing.serialization.spec import invalid
from ftlaunch.checkpointing.transport import CheckpointTransport
from ftlaunch.errors import CheckpointTransportError, CommunicationError

logger = logging.getLogger(__name__)

T = TypeVar("T")

TAG_BASE = 1 << 20
#: Tag of the sums frame (message 4).
TAG_SUMS = TAG_BASE - 1
_PG_ERRORS = (RuntimeError, OSError, CommunicationError)
#: Tensors smaller than this travel packed with their neighbours (`messages`).
PACK_BELOW = 1 << 20
#: The most bytes of one pack: each side allocates one buffer of its size on the device.
PACK_BYTES = 16 << 20


def messages(nbytes: Sequence[int], packed: bool = True) -> list[list[int]]:
    """The tensor messages of a transfer, each the positions of the tensors it carries, from the
    tensors' sizes in the header's order: a tensor of `PACK_BELOW` bytes or more alone, smaller ones
    packed in order up to `PACK_BYTES` (with ``packed``; else each alone), empty ones in none. Both
    sides compute it from the header, so they agree on every message without saying more."""
    out: list[list[int]] = []
    pack: list[int] = []
    size = 0
    for i, n in enumerate(nbytes):
        if n == 0:
            continue
        if n >= PACK_BELOW or not packed:
            out.append([i])
            continue
        if pack and size + n > PACK_BYTES:
            out.append(pack)
            pack, size = [], 0
        pack.append(i)
        size += n
    if pack:
        out.append(pack)
    return out


class PGTransport(CheckpointTransport[T]):
    """Sends the state with ``pg.send`` and receives it with ``pg.recv``, in place when possible.

    ``device``: where tensors travel (``cpu`` for Gloo, the local GPU for NCCL). ``state_dict``,
    when given, returns this group's current state; received tensors whose dtype and shape match
    are written into it in place (on failure their contents are unspecified — the heal is retried).
    ``device_mesh``: the mesh received DTensors are rebuilt on (settable later, as
    ``transport.device_mesh``, once the model is sharded); without it, the mesh of the DTensor at
    the same path in ``state_dict()``.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        timeout: timedelta,
        device: torch.device,
        state_dict: Callable[[], T] | None = None,
        device_mesh: DeviceMesh | None = None,
        packed: bool | None = None,
    ) -> None:
        """``packed``: whether tensors under `PACK_BELOW` bytes travel packed (`messages`); default:
        on a CUDA device. Sender and receiver must agree (they do when both use the default)."""
        if timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self._pg = pg
        self._timeout = timeout
        self._device = torch.device(device)
        self._packed = self._device.type == "cuda" if packed is None else packed
        self._state_dict = state_dict
        self._limits: ReceiveLimits | None = None  # set by `expect_like`
        self.device_mesh = device_mesh

    def metadata(self) -> str:
        return "<pg>"  # the process group itself is the address

    @staticmethod
    def _post(op: Callable[..., Any], tensor: torch.Tensor, peer: int, tag: int, what: str) -> Any:
        """Start ``pg.send``/``pg.recv``; a failure to even start it is a transport error too."""
        try:
            return op([tensor], peer, tag)
        except _PG_ERRORS as e:
            raise CheckpointTransportError(f"{what} failed: {e}") from e

    def _deadline(self, timeout: timedelta | None) -> float:
        """The call's deadline (monotonic): None -> the transport's timeout; ``timedelta(0)`` -> none
        of its own (as in torchft: each wait is bounded by the process group's op timeout only)."""
        if timeout is None:
            timeout = self._timeout
        if not timeout:
            return math.inf
        return time.monotonic() + timeout.total_seconds()

    def _wait(self, work: Any, deadline: float, what: str) -> None:
        if deadline == math.inf:
            try:
                work.wait()
            except _PG_ERRORS as e:
                raise CheckpointTransportError(f"failed {what}: {e}") from e
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise CheckpointTransportError(f"timed out {what}")
        try:
            # timedelta(0) would mean "no timeout": never pass less than a millisecond.
            work.wait(timedelta(seconds=max(left, 1e-3)))
        except _PG_ERRORS as e:
            late = time.monotonic() >= deadline
            raise CheckpointTransportError(f"{'timed out' if late else 'failed'} {what}: {e}") from e

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta | None = None
    ) -> None:
        """Push ``state_dict`` to every rank in ``dst_ranks``; returns when all sends completed."""
        t0 = time.perf_counter()
        deadline = self._deadline(timeout)
        local_state, specs = dtensors.split(state_dict)
        payload = {"state": local_state, "dtensors": dtensors.specs_to_json(specs)}
        enc = encode(payload, step, device=self._device, sums=False)
        frame = torch.frombuffer(bytearray(enc.frame), dtype=torch.uint8).to(self._device)
        length = torch.tensor([frame.numel()], dtype=torch.int64, device=self._device)
        pending = []
        entries = enc.header.tensors
        body = []
        for msg in messages([e.nbytes for e in entries], self._packed):
            first = entries[msg[0]].index
            if len(msg) == 1:
                body.append((f"tensor {first}", tensor_bytes(enc.tensors[msg[0]]), TAG_BASE + 2 + first))
            else:
                packed = torch.cat([tensor_bytes(enc.tensors[i]) for i in msg])
                body.append((f"tensors {first}-{entries[msg[-1]].index}", packed, TAG_BASE + 2 + first))
        for dst in dst_ranks:
            for name, tensor, tag in [
                ("header length", length, TAG_BASE),
                ("header", frame, TAG_BASE + 1),
                *body,
            ]:
                what = f"sending the {name} of step {step} to rank {dst}"
                pending.append((what, self._post(self._pg.send, tensor, dst, tag, what)))
        # The tensors travel on the process group's threads meanwhile.
        sums = torch.frombuffer(bytearray(frame_sums(checksums(enc.tensors))), dtype=torch.uint8)
        sums = sums.to(self._device)
        for dst in dst_ranks:
            what = f"sending the checksums of step {step} to rank {dst}"
            pending.append((what, self._post(self._pg.send, sums, dst, TAG_SUMS, what)))
        for what, work in pending:
            self._wait(work, deadline, what)
        logger.info(
            "checkpoint transport (pg): sent step %d (%d tensors, %d bytes) to ranks %s in %.3fs",
            step, len(enc.tensors), enc.body_nbytes, dst_ranks, time.perf_counter() - t0,
        )  # fmt: skip

    def expect_like(self, state: T | None) -> None:
        """Refuse a received header far larger than ``state``'s (`ReceiveLimits.like`)."""
        self._limits = None if state is None else ReceiveLimits.like(state)

    def disallow_checkpoint(self) -> None:
        """Nothing to do: `send_checkpoint` returns only after the state has been sent."""

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta | None = None) -> T:
        t0 = time.perf_counter()
        deadline = self._deadline(timeout)
        what = f"receiving the header of step {step} from rank {src_rank}"
        length = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._wait(self._post(self._pg.recv, length, src_rank, TAG_BASE, what), deadline, what)
        n = int(length.item())
        limits = self._limits or ReceiveLimits()
        if not FRAME_PREFIX_LEN <= n <= min(MAX_FRAME_BYTES, limits.max_header_bytes):
            raise invalid(
                f"header length {n} from rank {src_rank} (this receiver accepts {limits.max_header_bytes})"
            )
        frame = torch.empty(n, dtype=torch.uint8, device=self._device)
        self._wait(self._post(self._pg.recv, frame, src_rank, TAG_BASE + 1, what), deadline, what)
        # Parsing and allocating obey the deadline too (a header of many tiny tensors costs CPU).
        stages = None if deadline == math.inf else Deadline(deadline - time.monotonic(), what, deadline)
        header = parse_header(byte_view(frame.cpu()).tobytes(), expected_step=step,
                              max_tensors=limits.max_tensors, deadline=stages, sums_follow=True)  # fmt: skip
        mine = self._state_dict() if self._state_dict is not None else None
        template = {"state": dtensors.locals_of(mine)} if mine is not None else None
        slots = plan_slots(header, self._device, template, stages)
        pending = []
        for msg in messages([s.entry.nbytes for s in slots], self._packed):
            first = slots[msg[0]].entry.index
            what = f"receiving tensor {first} of step {step} from rank {src_rank}"
            if len(msg) == 1:
                into = tensor_bytes(slots[msg[0]].landing)
            else:
                last = slots[msg[-1]].entry.index
                what = f"receiving tensors {first}-{last} of step {step} from rank {src_rank}"
                into = torch.empty(
                    sum(slots[i].entry.nbytes for i in msg), dtype=torch.uint8, device=self._device
                )
            tag = TAG_BASE + 2 + first
            pending.append((msg, into, what, self._post(self._pg.recv, into, src_rank, tag, what)))
        what = f"receiving the checksums of step {step} from rank {src_rank}"
        sums = torch.empty(sums_frame_nbytes(len(slots)), dtype=torch.uint8, device=self._device)
        sums_work = self._post(self._pg.recv, sums, src_rank, TAG_SUMS, what)
        # Checksum each large tensor as soon as it has landed, while the next ones arrive.
        got: list[str | None] = [None] * len(slots)
        for msg, into, what_i, work in pending:
            self._wait(work, deadline, what_i)
            offset = 0
            for i in msg:
                if len(msg) > 1:  # a pack: each tensor's bytes into its landing
                    n = slots[i].entry.nbytes
                    tensor_bytes(slots[i].landing).copy_(into[offset : offset + n])
                    offset += n
                if slots[i].entry.nbytes >= BLOCK_BYTES:
                    got[i] = checksum(slots[i].landing)
        self._wait(sums_work, deadline, what)
        header = with_sums(header, parse_sums(byte_view(sums.cpu()), len(slots)))
        for s, e in zip(slots, header.tensors, strict=True):
            s.entry = e
        payload = finish(header, slots, got)
        if not isinstance(payload, dict) or set(payload) != {"state", "dtensors"}:
            raise invalid(f"payload from rank {src_rank} is not a PGTransport state")
        specs = dtensors.specs_from_json(payload["dtensors"])
        result: T = dtensors.join(payload["state"], specs, self.device_mesh, mine)
        logger.info(
            "checkpoint transport (pg): received step %d (%d tensors, %d bytes) from rank %d in %.3fs",
            step, len(slots), header.body_nbytes, src_rank, time.perf_counter() - t0,
        )  # fmt: skip
        return result
