"""The state a replica group committed, as its heals serve it: a snapshot taken at the commit boundary.

Why: the tensors a state function returns are the training tensors. Read on the quorum thread while
the training thread runs the next forward pass, which updates BatchNorm statistics (any buffer a
forward changes) in place, they would make the checksum a source claims, the bytes it sends and the
state it commits three different states: the healer would reject every copy, and a job with one
healer would stop committing. What a source offers, and claims, is one `Snapshot` per step:

* **staged** (the default): at the commit boundary -- ``start_quorum``, on the training thread, after
  the last optimizer step and before the next forward pass -- every tensor is copied off the training
  tensors (`ftlaunch.checkpointing.staging`). Only when a heal is due (`plan.snapshot_due`), so a step
  with nobody to heal copies and checksums nothing;
* **live**: training loops that hold their state still from the quorum until the healers have their
  copy (LocalSGD and DiLoCo take the quorum of a sync point synchronously, and every healer fetches
  before it joins the sync's first collective) serve the training tensors themselves, read lazily
  and once per step, at every quorum: no copy of the model at each sync point, no step of waiting.

A durable checkpoint needs the same snapshot (a writer in the background must not see the next
step's tensors): `CommittedState.durable` (`ftlaunch.worker.durable`), when set, is called at every
boundary -- at the first, to resume from disk before the process's first quorum; at each, to hand
a copy to its writer when a save is due, the heal snapshot itself when this boundary took one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from typing import Any, Protocol

from ftlaunch.checkpointing.staging import StagedState, stage
from ftlaunch.errors import CommunicationError
from ftlaunch.worker.progress import state_checksum
from ftlaunch.worker.recovery import StateRegistry

__all__ = ["BoundaryHook", "CommittedState", "Snapshot"]


class BoundaryHook(Protocol):
    """Called at each commit boundary (`ftlaunch.worker.durable.DurableCheckpoints`), and after each
    committed sync by the algorithms that save there (`Manager.save_after_syncs`)."""

    def first_boundary(self, step: int) -> int: ...

    def at_boundary(self, step: int, staged: StagedState | None = None) -> None: ...

    def save_after_syncs(self, shared: Collection[str]) -> None: ...

    def after_sync(self, step: int) -> None: ...


class Snapshot:
    """One step's state as this rank serves it: a staged copy, or (live) the registry's state read
    once, when first needed. Its claim is the checksum of exactly the state it serves."""

    def __init__(self, step: int, registry: StateRegistry, staged: StagedState | None = None) -> None:
        self.step = step
        self._registry = registry
        self._staged = staged
        self._live: dict[str, Any] | None = None
        self._claim: str | None = None
        self._lock = threading.Lock()

    @property
    def live(self) -> bool:
        return self._staged is None

    @property
    def staged(self) -> StagedState | None:
        """The staged copy (None: a live snapshot)."""
        return self._staged

    def state(self, timeout: float) -> dict[str, Any]:
        """The state to serve. Live: read under the registry's gate, waiting up to ``timeout`` for
        the training loop to allow it (`CommunicationError` after that)."""
        if self._staged is not None:
            self._staged.wait()
            state: dict[str, Any] = self._staged.state
            return state
        with self._lock:
            if self._live is None:
                with self._registry.gate.reading(timeout):
                    self._live = self._registry.snapshot()
            return self._live

    def claim(self) -> str | None:
        """`state_checksum` of the served state (computed once), or None when a live state cannot
        be read right now (the training loop closed the gate)."""
        if self._claim is None:
            try:
                self._claim = state_checksum(self.state(0.0))
            except CommunicationError:
                return None
        return self._claim


class CommittedState:
    """Takes and holds this rank's `Snapshot` of the current step (see the module docstring)."""

    def __init__(self, registry: StateRegistry, log: logging.Logger | logging.LoggerAdapter) -> None:
        self._registry = registry
        self._log = log
        #: Serve the live state at every quorum (`Manager.serve_live_state`) instead of staged copies.
        self.live = False
        self._snapshot: Snapshot | None = None
        self._due = False
        #: Durable checkpoints (`ftlaunch.worker.durable`): resumed at the first boundary, saved at due ones.
        self.durable: BoundaryHook | None = None

    def at_boundary(self, step: int, due: bool) -> None:
        """The commit boundary of ``step`` (the training thread, before the step's forward pass):
        take the step's snapshot when ``due`` (a heal is due), or a live one in live mode."""
        self._snapshot = None
        if self.durable is not None:
            step = self.durable.first_boundary(step)  # a resume from disk moves the step
        self._boundary(step, due)
        if self.durable is not None:
            staged = self._snapshot.staged if self._snapshot is not None else None
            self.durable.at_boundary(step, staged)

    def _boundary(self, step: int, due: bool) -> None:
        self._due = due or self.live
        if self.live:
            self._snapshot = Snapshot(step, self._registry)
            return
        if not due:
            return
        try:
            with self._registry.gate.reading(0.0):  # the training thread itself: never wait for it
                staged = stage(self._registry.snapshot(), step)
        except CommunicationError:
            self._log.warning("no snapshot for a heal at step %d: the state was closed for reading", step)
            return
        self._snapshot = Snapshot(step, self._registry, staged)
        self._log.info(
            "snapshot of the committed state for a heal: %.1f MB in %.1f ms",
            staged.nbytes / 1e6, staged.seconds * 1e3,
        )  # fmt: skip

    @property
    def due(self) -> bool:
        """Whether this step's boundary wanted a snapshot (every rank of the group decides the same,
        whether or not its copy succeeded)."""
        return self._due

    def current(self, step: int) -> Snapshot | None:
        """The snapshot of ``step``, or None (none taken, or the group's step moved since)."""
        snap = self._snapshot
        return snap if snap is not None and snap.step == step else None

    def release(self) -> None:
        """The step's heals are over (every healer voted): the copy may go."""
        self._snapshot = None
