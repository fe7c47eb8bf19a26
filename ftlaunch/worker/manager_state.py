"""The Manager's state and query API (torchft's): what travels with a heal, the step counters,
this step's participants. Kept beside the per-step protocol (`manager.py`), which it only reads:
the protocol changes the fields these methods read, never the other way round (except
`load_state_dict`, which a heal or a checkpoint load calls between steps).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.worker.committed import CommittedState
from ftlaunch.worker.plan import StepPlan
from ftlaunch.worker.recovery import StateRegistry


class ManagerStateApi:
    """Mixed into `ftlaunch.worker.manager.Manager`, which sets these fields."""

    _step: int
    _batches_committed: int
    _state: StateRegistry
    _committed: CommittedState
    _layout: dict[str, str] | None
    _plan: StepPlan | None
    _quorum_seq: int
    _pg: ProcessGroup
    _group_rank: int

    def wait_quorum(self) -> None:
        """Block until this step's quorum is known (the Manager's)."""
        raise NotImplementedError

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Add state that travels with live recovery (e.g. a data loader position)."""
        self._state.register(key, load_state_dict, state_dict)

    def require_same_layout(self, digest: str, text: str = "") -> None:
        """Publish how this group lays out its state (e.g. how it shards the model: ``digest``
        identifies it, ``text`` describes it for error messages) and refuse to take part in a step
        whose up-to-date groups publish another layout: gradient shards would be averaged with the
        wrong peers' shards and healed state would land in the wrong places. The refusal is a
        `ConfigurationError` raised into the training loop. Call it before the first step, with
        the same value on every rank of the group.
        """
        self._layout = {"digest": digest, "text": text}

    def set_state_dict_fns(
        self, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """torchft's older name: `register_state_dict_fn` under the key ``"set_state_dict_fns"``."""
        warnings.warn(
            "set_state_dict_fns is deprecated: use register_state_dict_fn", DeprecationWarning, stacklevel=2
        )
        self.register_state_dict_fn("set_state_dict_fns", load_state_dict, state_dict)

    def disallow_state_dict_read(self) -> None:
        """Keep the state from being read for a heal while the caller changes it outside a step
        (waits for a read in progress). Healing this step's peers then waits, up to the heal
        timeout, for `allow_state_dict_read`."""
        self._state.gate.disallow()

    def allow_state_dict_read(self) -> None:
        """Let heals read the state again (see `disallow_state_dict_read`)."""
        self._state.gate.allow()

    def set_agreed_state(self, select: Callable[[dict[str, Any]], Any]) -> None:
        """Say which part of the state every replica group holds bit-identical after each commit:
        ``select`` gets the whole state that travels with a heal (the default answer) and returns
        that part. The group leader reports its checksum at a clean exit, and ``ftlaunch``'s summary
        compares them across groups. DDP leaves out the module's buffers (BatchNorm statistics are
        each replica's own, as in torch's DDP), LocalSGD keeps the parameters and DiLoCo its global
        parameters and outer optimizer state: their groups legitimately differ in the rest."""
        self._state.agreed_fn = select

    def serve_live_state(self) -> None:
        """Heals serve the training tensors themselves, at every quorum, instead of a snapshot the
        Manager copies at the commit boundary when a heal is due (worker/committed.py).

        For training loops that take each quorum synchronously (``start_quorum`` then
        ``wait_quorum`` before anything else) and change no state until the step's first collective
        completed -- every healer fetches before it joins one: LocalSGD and DiLoCo, whose quorums
        are their sync points. They skip the copy of the model at each sync point, and a joining
        group heals at the first one instead of waiting a sync interval for a snapshot. Any other
        loop must not call it: its forward pass would change what the heal reads.
        """
        self._committed.live = True

    # ============================================================================ state (torchft's API)
    def state_dict(self) -> dict[str, int]:
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches_committed

    def num_participants(self) -> int:
        """Groups whose gradients count this step (the divisor of the average): the up-to-date
        groups, at most ``min_replica_size`` of them with `WorldSizeMode.FIXED_WITH_SPARES`."""
        self.wait_quorum()
        return self._plan.num_participants if self._plan is not None else 0

    def participating_rank(self) -> int | None:
        """This group's rank among the participants, None while it heals or stands by as a spare."""
        self.wait_quorum()
        return self._plan.participant_rank if self._plan is not None else None

    def is_participating(self) -> bool:
        return self.participating_rank() is not None

    def latest_plan(self) -> tuple[int, StepPlan | None]:
        """``(attempt, plan)`` of the latest step, read without waiting: ``attempt`` changes whenever
        a step begins (it numbers the quorum requests), ``plan`` is None until that step's quorum is
        known and when the step failed before planning. Between two steps it describes the step
        that just ended -- who took part (``plan.participant_ids``), from which step
        (``plan.max_step``) -- which is what the exactly-once sampler reads after a commit."""
        return self._quorum_seq, self._plan

    @property
    def pg(self) -> ProcessGroup:
        return self._pg

    @property
    def group_rank(self) -> int:
        return self._group_rank
