"""What a group leader tells the lighthouse about its training: steps committed, heals, timings, and
at a clean exit a checksum of the trained state (lighthouse/progress.py keeps the totals).

Why here and not in the training script's stdout: the launcher's summary and ``/metrics`` must be
right for any script, including one that prints nothing. The Manager feeds a `ProgressTracker` at
the step's milestones; the tracker hands each new `ProgressReport` to the lighthouse client, which
sends it with the next quorum request or heartbeat (no extra round trip per step) and the final one
with the leave.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ftlaunch.checkpointing.serialization.checksum import checksums
from ftlaunch.lighthouse.progress import ProgressReport

logger = logging.getLogger(__name__)


def _tensors(node: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(node, torch.Tensor):
        local = getattr(node, "to_local", None)  # a DTensor: this rank's shard
        t = local() if callable(local) else node
        yield path, t.detach().contiguous()
    elif isinstance(node, Mapping):
        for key in sorted(node, key=str):
            yield from _tensors(node[key], f"{path}/{key}")
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from _tensors(item, f"{path}/{i}")


def state_checksum(state: Mapping[str, Any]) -> str:
    """A digest of every tensor in ``state`` (its path, dtype, shape and bytes), in a fixed order.

    Only tensors count: the numbers beside them (a sampler's position, a step) are already reported
    as the step. Groups that committed the same steps hold bit-identical tensors, so their digests
    are equal; with sharded state it is the group leader's shard. Uses the checkpoint format's
    ``sum64`` (~10 GB/s per core), so it is cheap enough to run at every clean exit.
    """
    found = list(_tensors(state, ""))
    h = hashlib.sha256()
    for (path, t), digest in zip(found, checksums([t for _, t in found]), strict=True):
        h.update(f"{path}|{t.dtype}|{tuple(t.shape)}|{digest}\n".encode())
    return h.hexdigest()[:16]


class ProgressTracker:
    """The group leader's progress since its process started (one `session`)."""

    def __init__(
        self, publish: Callable[[ProgressReport], None], clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._publish = publish
        self._clock = clock
        self.session = secrets.token_hex(8)
        self._commits = 0
        self._heals = 0
        self._heal_seconds = 0.0
        self._started: float | None = None
        self._quorum_seconds = 0.0
        self._commit_started: float | None = None
        self._fetch_seconds = 0.0
        # The step's own work (`ProgressReport.compute_seconds`): from when the training thread
        # last stopped waiting on the other groups (the previous decision, or the first step's
        # start) to the step's first collective, less the time it waited for the quorum meanwhile.
        self._compute_from: float | None = None
        self._waited = 0.0
        self._compute: float | None = None  # measured once the step first needed its peers
        self._last: ProgressReport | None = None
        #: The durable-checkpoint fields of each report (`ftlaunch.worker.durable.DurableStats.report`).
        self.durable: Callable[[], dict[str, Any]] | None = None

    @property
    def commits(self) -> int:
        return self._commits

    # -- the step's milestones (the Manager calls these)

    def step_started(self) -> None:
        self._started = self._clock()
        self._quorum_seconds = 0.0
        self._fetch_seconds = 0.0
        if self._compute_from is None:
            self._compute_from = self._started
        self._waited = 0.0
        self._compute = None

    def waited(self, seconds: float) -> None:
        """The training thread waited ``seconds`` for the step's quorum (a synchronous quorum, an
        early ``wait_quorum``): not the group's own work, when it comes before its first collective."""
        if self._compute is None:
            self._waited += seconds

    def peers_needed(self) -> None:
        """The step's first collective (or its commit) is about to wait on the other groups: the
        group's own work of the step ends here. A slow group arrives late; the fast ones arrive
        early and then wait for it -- in the collectives, which this does not count."""
        if self._compute is None and self._compute_from is not None:
            self._compute = max(0.0, self._clock() - self._compute_from - self._waited)

    def not_committed(self) -> None:
        """The step was decided and not committed: the next step's work starts now."""
        self._compute_from = self._clock()

    def quorum_done(self, fetch_seconds: float = 0.0) -> None:
        """The quorum thread finished: quorum, reconfigure and (``fetch_seconds`` of it) the heal."""
        if self._started is not None:
            self._quorum_seconds = self._clock() - self._started
        self._fetch_seconds = fetch_seconds

    def commit_started(self) -> None:
        self._commit_started = self._clock()

    def committed(self, step: int, healed: bool) -> None:
        """The step was committed everywhere; ``step`` is the group's step after it."""
        now = self._clock()
        self._commits += 1
        if healed:
            self._heals += 1
            self._heal_seconds += self._fetch_seconds
        self._last = ProgressReport(
            session=self.session,
            step=step,
            commits=self._commits,
            heals=self._heals,
            heal_seconds=round(self._heal_seconds, 6),
            step_seconds=round(now - self._started, 6) if self._started is not None else 0.0,
            quorum_seconds=round(self._quorum_seconds, 6),
            commit_seconds=round(now - self._commit_started, 6) if self._commit_started is not None else 0.0,
            compute_seconds=round(self._compute or 0.0, 6),
            **(self.durable() if self.durable is not None else {}),
        )
        self._compute_from = now
        self._publish(self._last)

    def finish(self, step: int, state: Callable[[], Mapping[str, Any]] | None) -> ProgressReport:
        """The final report of a clean exit, with the checksum of what ``state`` returns when given
        (None: the exit is not clean, so nothing is claimed about the state)."""
        checksum = ""
        if state is not None and self._commits:
            try:
                checksum = state_checksum(state())
            except Exception as e:  # noqa: BLE001 - a checksum must never break the exit
                logger.warning("no state checksum for the lighthouse: %s: %s", type(e).__name__, e)
        base = self._last or ProgressReport(session=self.session, step=step)
        durable = self.durable() if self.durable is not None else {}  # a final checkpoint at the exit
        report = ProgressReport(
            **{**base.to_json(), **durable, "step": step, "checksum": checksum, "finished": state is not None}
        )
        self._publish(report)
        return report
