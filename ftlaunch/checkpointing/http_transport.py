"""Live recovery over HTTP: the healthy group serves its state, the healing group fetches it.

Protocol (HTTP/1.1, standard library server and client; see docs/checkpointing.md):

``GET /checkpoint/<step>/header`` -> 200, the header frame (`serialization.header`), ``ETag``.

``GET /checkpoint/<step>/body`` with ``Range: bytes=a-b`` and ``If-Match: <etag>`` -> 206, body bytes.

Errors are JSON ``{"error": "..."}``: 404 unknown path, 409 another step is being served (with
``"serving_step"``), 412 the served snapshot changed (etag), 416 bad range, 503 nothing is being
served. A receiver that gets 503, or 409 for an older step, retries until its deadline (source and
healer act on the same quorum concurrently, so the healer may ask first); 409 for a newer step fails
at once.

This module is the transport object; the serving side is `_http_server`, the fetching side
`_http_fetch`. Speed: the receiver splits the body into ``num_chunks`` ranges fetched over
parallel connections, each read straight from the socket into the destination tensors (fresh
ones, or the caller's own via ``state_dict``); the sender writes memoryviews of its tensors (no
copy for contiguous CPU tensors).

Snapshot semantics (as torchft's): `send_checkpoint` does not copy contiguous CPU tensors; the
caller must not mutate them until `disallow_checkpoint` returns. `disallow_checkpoint` cuts off
in-flight transfers before returning, so a receiver gets an error, never bytes of the next step; a
caller that breaks the rule anyway is caught by the per-tensor checksums on the receiving side.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ftlaunch import env
from ftlaunch.addresses import http_url, parse_host_port
from ftlaunch.checkpointing import dtensors
from ftlaunch.checkpointing._http_fetch import Fetch
from ftlaunch.checkpointing._http_server import CheckpointServer, Snapshot
from ftlaunch.checkpointing.serialization.encode import encode
from ftlaunch.checkpointing.serialization.limits import ReceiveLimits
from ftlaunch.checkpointing.transport import CheckpointTransport
from ftlaunch.errors import CheckpointTransportError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)

__all__ = ["HTTPTransport", "default_num_chunks"]

T = TypeVar("T")

_CPU = torch.device("cpu")


#: The key of a served state that holds DTensors: ``{_DTENSORS: [spec, ...], "state": locals}``. A
#: state without DTensors is served as it is, so the plain wire format does not change.
_DTENSORS = "__ftlaunch_dtensor_specs__"


def _with_specs(state: Any) -> Any:
    """``state`` as served: DTensors replaced by their local shards, and their specs beside it."""
    local, specs = dtensors.split(state)
    if not specs:
        return state
    return {_DTENSORS: dtensors.specs_to_json(specs), "state": local}


def _without_specs(received: Any, mesh: DeviceMesh | None, mine: Any) -> Any:
    """A received state with its DTensors rebuilt (`dtensors.join`)."""
    if not (isinstance(received, dict) and set(received) == {_DTENSORS, "state"}):
        return received
    specs = dtensors.specs_from_json(received[_DTENSORS])
    return dtensors.join(received["state"], specs, mesh, mine)


def _parse_bind(bind: str) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]:port``, a bare IPv6 address (``::``, ``::1``) or ``""`` (every
    interface) -> (host, port); the port defaults to 0 (any free port)."""
    if not bind or (bind.count(":") > 1 and not bind.startswith("[")):
        return bind, 0
    return parse_host_port(bind, default_port=0)


def default_num_chunks() -> int:
    """Parallel connections per receive when ``num_chunks`` is not given: one per CPU this process
    may run on, at most 4. Each connection's thread is busy copying and checksumming; more threads
    than CPUs only contend (measured on 2 CPUs: 2 connections used ~15% less CPU per GB than 4 and
    were faster). Across a network with a per-connection bandwidth limit, pass a larger value."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


class HTTPTransport(CheckpointTransport[T]):
    """Serves this group's state over HTTP and fetches peers' states with parallel range requests.

    ``num_chunks``: parallel connections per receive (default `default_num_chunks`: the usable
    CPUs, at most 4; 0 means no chunking - one connection - as in torchft). ``bind`` is ``host`` or
    ``host:port`` (loopback by default; use
    ``0.0.0.0``/``::`` to serve other hosts — the state is readable by anyone who can reach the
    port). ``state_dict``, when given, returns this group's current state: received tensors of
    matching dtype and shape are written into it in place (on failure their contents are
    unspecified — the heal is retried). Tensors received without a match are freshly allocated,
    each with its own storage.

    DTensors travel as the PG transport's do (`ftlaunch.checkpointing.dtensors`): each rank serves
    its local shard plus the sharding spec, and the receiver rebuilds the DTensor on
    ``device_mesh`` (settable later as ``transport.device_mesh``), else on the mesh of its own
    DTensor at the same path in ``state_dict()``, after checking the sharding is the same.
    """

    def __init__(
        self,
        timeout: timedelta,
        num_chunks: int | None = None,
        bind: str = "127.0.0.1",
        *,
        state_dict: Callable[[], T] | None = None,
        device_mesh: DeviceMesh | None = None,
    ) -> None:
        if num_chunks is None:
            num_chunks = default_num_chunks()
        if num_chunks < 0:
            raise ValueError(f"num_chunks must be >= 0 (0: no chunking), got {num_chunks}")
        num_chunks = max(num_chunks, 1)  # torchft's 0 = the whole body over one connection
        if timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self._timeout = timeout
        self._num_chunks = num_chunks
        self._state_dict = state_dict
        self._limits: ReceiveLimits | None = None  # set by `expect_like`
        self.device_mesh = device_mesh
        host, port = _parse_bind(bind)
        self._server = CheckpointServer((host, port), timeout.total_seconds())
        port = int(self._server.server_address[1])
        if host in ("", "0.0.0.0", "::"):
            host = env.local_addr() or socket.gethostname()  # what the job's other hosts reach
        self._url = http_url(host, port)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="ftlaunch-ckpt-http",
            daemon=True,
        )
        self._thread.start()
        self._closed = False
        logger.info("checkpoint transport: serving at %s", self._url)

    def metadata(self) -> str:
        return self._url

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta | None = None
    ) -> None:
        """Start serving ``state_dict`` (replacing any previous one); returns at once.

        Contiguous CPU tensors are served in place (not copied); other tensors are copied to CPU
        now. ``dst_ranks`` and ``timeout`` are informational: any receiver may fetch until
        `disallow_checkpoint`.
        """
        if self._closed:
            raise CheckpointTransportError("checkpoint transport is shut down")
        t0 = time.perf_counter()
        snap = Snapshot(step, encode(_with_specs(state_dict), step, device=_CPU))
        self._server.publish(snap, wait=self._timeout.total_seconds())
        logger.info(
            "checkpoint transport: serving step %d (%d tensors, %d bytes) to ranks %s; prepared in %.3fs",
            step, snap.ntensors, snap.body_nbytes, dst_ranks, time.perf_counter() - t0,
        )  # fmt: skip

    def disallow_checkpoint(self) -> None:
        self._server.publish(None, wait=self._timeout.total_seconds())

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta | None = None) -> T:
        """Fetch the state of ``step`` from ``metadata`` (a URL) within ``timeout``.

        None or ``timedelta(0)`` means the transport's own timeout: an HTTP fetch has no lower
        layer that bounds it (unlike a process group's op timeout), so it is never unbounded.
        """
        t0 = time.perf_counter()
        mine = self._state_dict() if self._state_dict is not None else None
        template = _with_specs(mine) if mine is not None else None
        seconds = (timeout or self._timeout).total_seconds()
        limits = (
            self._limits if self._limits is not None or template is None else ReceiveLimits.like(template)
        )
        received = Fetch(metadata, step, seconds, self._num_chunks, template, limits).run()
        result: T = _without_specs(received, self.device_mesh, mine)
        logger.info(
            "checkpoint transport: received step %d from rank %d (%s) in %.3fs",
            step, src_rank, metadata, time.perf_counter() - t0,
        )  # fmt: skip
        return result

    def expect_like(self, state: T | None) -> None:
        """Refuse, before reading or allocating it, a received header far larger than ``state``'s
        (`ReceiveLimits.like`); None: only the format's limits (or the ``state_dict`` template's)."""
        self._limits = None if state is None else ReceiveLimits.like(_with_specs(state))

    def shutdown(self, wait: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.publish(None, wait=self._timeout.total_seconds() if wait else 0.0)
        self._server.shutdown()  # stops serve_forever (returns within poll_interval)
        self._server.server_close()
        self._server.close_connections(wait=10.0 if wait else 0.0)
        if wait:
            self._thread.join()

    def __enter__(self) -> HTTPTransport[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
