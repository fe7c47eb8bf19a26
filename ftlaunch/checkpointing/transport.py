"""The interface every live-recovery transport implements.

A healing replica group copies the live state from a healthy one. The healthy side calls
`send_checkpoint` (and later `disallow_checkpoint`, before it mutates that state again); the
healing side calls `recv_checkpoint` with the `metadata` string the sender published through the
quorum. Every transfer failure — timeout, lost connection, corrupt or wrong-step payload — raises
`ftlaunch.errors.CheckpointTransportError`, so the Manager can abort the heal and retry at the next
quorum instead of crashing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Generic, TypeVar

T = TypeVar("T")


class CheckpointTransport(ABC, Generic[T]):
    """Moves a state dict of type ``T`` from one replica group to another."""

    @abstractmethod
    def metadata(self) -> str:
        """What a receiver needs to fetch from us (e.g. a URL); published through the quorum."""

    @abstractmethod
    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta | None = None
    ) -> None:
        """Make ``state_dict`` of ``step`` available to (or push it to) ``dst_ranks``.

        The caller must not mutate ``state_dict`` until `disallow_checkpoint` returns. ``timeout``
        None means the transport's own timeout (as in torchft).
        """

    @abstractmethod
    def disallow_checkpoint(self) -> None:
        """Stop serving the last state: it is about to change. Receivers still reading get an error."""

    @abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta | None = None) -> T:
        """Fetch the state of ``step`` from the peer described by ``metadata`` / ``src_rank``.

        ``timeout`` None means the transport's own timeout (as in torchft).
        """

    def expect_like(self, state: T | None) -> None:  # noqa: B027  (optional hook, default no-op)
        """Hint for the following `recv_checkpoint` calls: what they receive should look like
        ``state`` (the receiver's own; None: no hint). A transport may then refuse a payload far
        larger than it before reading or materializing it (the HTTP transport does:
        `serialization.limits.ReceiveLimits`), so a hostile peer cannot make a heal cost more
        than its timeout and memory proportional to the receiver's own state."""

    def shutdown(self, wait: bool = True) -> None:  # noqa: B027  (optional hook, default no-op)
        """Release sockets and threads; with ``wait``, block until they are gone."""
