"""A process group's failure record: the first communication error of each configuration.

Why an object of its own: the group, every `Work` its ops return (on whatever thread they finish)
and the backends' own completion paths all report failures, and they must agree on one rule --
the first error of the *current* configuration wins and marks the group errored until the next
`configure`; an error of an older configuration (a Work that outlived a reconfigure) is returned
to its caller but changes nothing. Holding that rule here, instead of on the group, lets a Work
report without a reference to the group that issued it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ftlaunch.errors import CommunicationError
from ftlaunch.process_group._store import first_line

logger = logging.getLogger("ftlaunch.process_group.base")

__all__ = ["FailureRecord"]


class FailureRecord:
    """The errors of one process group, per configuration (``generation``).

    ``describe()`` names the group in messages (backend, rank, store); ``on_first(generation,
    on_backend_thread)`` is told the first error of a configuration (a group closes its backend
    then, so that peers blocked on it fail fast). Thread-safe.
    """

    def __init__(
        self,
        describe: Callable[[], str],
        on_first: Callable[[int, bool], None] = lambda generation, on_backend_thread: None,
    ) -> None:
        self._describe = describe
        self._on_first = on_first
        self._lock = threading.Lock()
        self._generation = 0
        self._error: CommunicationError | None = None

    @property
    def generation(self) -> int:
        """The configuration now in use (increased by `new_generation`)."""
        return self._generation

    @property
    def error(self) -> CommunicationError | None:
        """The first error of the configuration in use, or None."""
        return self._error

    def new_generation(self) -> int:
        """A new configuration starts: its errors are counted afresh. Returns its number."""
        with self._lock:
            self._generation += 1
            self._error = None
            return self._generation

    def as_error(self, op: str, exc: BaseException | str, peer: int | None = None) -> CommunicationError:
        """``exc`` as the `CommunicationError` of ``op`` on this group (unchanged if it is one)."""
        if isinstance(exc, CommunicationError):
            return exc
        peer_txt = f" with peer rank {peer}" if peer is not None else ""
        detail = exc if isinstance(exc, str) else first_line(exc)
        return CommunicationError(f"{op} failed on {self._describe()}{peer_txt}: {detail}")

    def record(
        self,
        op: str,
        exc: BaseException | str,
        peer: int | None = None,
        generation: int | None = None,
        *,
        on_backend_thread: bool = False,
        quiet: bool = False,
    ) -> CommunicationError:
        """``exc`` as a `CommunicationError`, remembered (first one wins) when it belongs to the
        configuration in use (``generation`` None: the current one). Returns it for raising.

        The remembered error says that the group is aborted (its backend is closed until the next
        ``configure``): torchft's errors say so too, and code written for it matches "aborted".
        """
        err = self.as_error(op, exc, peer)
        with self._lock:
            first = self._error is None and (generation is None or generation == self._generation)
            if first:
                if "aborted" not in str(err):
                    err = CommunicationError(f"{err} (the group is aborted until the next configure)")
                self._error = err
                current = self._generation
        if first:
            (logger.info if quiet else logger.warning)("ftlaunch.process_group: %s", err)
            self._on_first(current, on_backend_thread)
        return err
