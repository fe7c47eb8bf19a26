"""Live recovery: the state that travels with a heal, and its transfer within a step.

The state is a set of named ``(load_state_dict, state_dict)`` pairs: the Manager's own (step,
batches committed) plus whatever the user registered. A source group `offer`s its snapshot of the
step (`worker.committed.Snapshot`: the state it committed, never tensors the next forward pass is
changing) to the healers the step's plan assigns to it; a healing group `fetch`es it, checks it at
once (a peer that registered other keys then fails the step's vote instead of raising after a
commit) and ``load``s it only once every group agreed to commit. Every group must register the
same keys.

Claims: each source states, with its quorum request, a checksum of the snapshot it serves
(`worker/plan.py`); the plan heals only from sources whose claims agree, and `fetch` rejects
received state that does not match its source's claim. So a group that serves other state than
the one it (and the other up-to-date groups) claimed heals nobody: its payload is refused.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Protocol

from ftlaunch.checkpointing.transport import CheckpointTransport
from ftlaunch.errors import CommunicationError, FtlaunchError
from ftlaunch.lighthouse.quorum import Quorum
from ftlaunch.worker.plan import StepPlan
from ftlaunch.worker.progress import state_checksum

#: Key of the Manager's own state (step, batches committed) inside the healed state dict.
MANAGER_STATE_KEY = "ftlaunch_manager"
#: Key of the user state passed to the Manager's constructor.
DEFAULT_STATE_KEY = "default"

LoadFn = Callable[[Any], None]
SaveFn = Callable[[], Any]


class Served(Protocol):
    """What a source serves (`worker.committed.Snapshot`): one step's state and its claim."""

    step: int

    def state(self, timeout: float) -> dict[str, Any]: ...

    def claim(self) -> str | None: ...


class ReadGate:
    """Lets the training loop keep the state from being read while it changes it (torchft's
    ``allow_state_dict_read`` / ``disallow_state_dict_read``).

    A source group snapshots its state on the quorum thread while the training thread runs; code
    that mutates the state outside the optimizer step (an outer optimizer, a manual weight average)
    closes the gate first. `disallow` waits for a snapshot in progress to finish; a snapshot that
    finds the gate closed waits for `allow`, up to its timeout (then the heal fails, the step does
    not commit, and the next quorum retries).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._allowed = True

    def disallow(self) -> None:
        with self._cond:
            self._allowed = False
            self._cond.wait_for(lambda: self._readers == 0)

    def allow(self) -> None:
        with self._cond:
            self._allowed = True
            self._cond.notify_all()

    @contextmanager
    def reading(self, timeout: float) -> Iterator[None]:
        with self._cond:
            if not self._cond.wait_for(lambda: self._allowed, timeout):
                raise CommunicationError(
                    f"the state could not be read for a heal: reads stayed disallowed for {timeout:g} s "
                    "(disallow_state_dict_read without allow_state_dict_read?)"
                )
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()


class StateRegistry:
    """The Manager's own state plus whatever the user registered, under unique keys."""

    def __init__(self, load_own: LoadFn, save_own: SaveFn) -> None:
        self._own = (load_own, save_own)
        self._user: dict[str, tuple[LoadFn, SaveFn]] = {}
        #: Closed by the training loop while it changes the state outside a step (see `ReadGate`).
        self.gate = ReadGate()
        #: Selects, from the whole state, the part every group holds bit-identical (`agreed`).
        self.agreed_fn: Callable[[dict[str, Any]], Any] | None = None
        #: Called with each entry registered from now on (a durable checkpoint being resumed from
        #: loads the entry's saved state into it as it is registered: `ftlaunch.worker.durable`).
        self.on_register: Callable[[str, LoadFn, SaveFn], None] | None = None

    def register(self, key: str, load_state_dict: LoadFn, state_dict: SaveFn) -> None:
        """Add state under ``key``; ValueError if the key is taken (or is the Manager's own)."""
        if key in self._user or key == MANAGER_STATE_KEY:
            raise ValueError(f"state dict key {key!r} is already registered")
        self._user[key] = (load_state_dict, state_dict)
        if self.on_register is not None:
            self.on_register(key, load_state_dict, state_dict)

    def entries(self) -> dict[str, tuple[LoadFn, SaveFn]]:
        """Every entry's ``(load_state_dict, state_dict)``, the Manager's own first."""
        return {MANAGER_STATE_KEY: self._own, **self._user}

    def keys(self) -> list[str]:
        return [MANAGER_STATE_KEY, *self._user]

    def snapshot(self) -> dict[str, Any]:
        """Everything a healing group needs, as a dict of the registered state dicts."""
        state: dict[str, Any] = {key: save() for key, (_, save) in self._user.items()}
        state[MANAGER_STATE_KEY] = self._own[1]()
        return state

    def torchft_layout(self) -> dict[str, Any]:
        """The state as torchft's ``Manager._manager_state_dict`` lays it out: the registered entries
        under ``"user"``, the Manager's own under ``"torchft"``."""
        return {
            "user": {key: save() for key, (_, save) in self._user.items()},
            "torchft": self._own[1](),
        }

    def agreed(self) -> Any:
        """What every replica group holds bit-identical after each commit: the job's result, whose
        checksum the group leader reports at a clean exit (the launcher's summary compares them).
        All of `snapshot` unless an algorithm said less (``Manager.set_agreed_state``): DiLoCo
        groups agree on the global parameters and outer state, not on their inner ones."""
        state = self.snapshot()
        return self.agreed_fn(state) if self.agreed_fn is not None else state

    def missing(self, state: Mapping[str, Any]) -> list[str]:
        """Registered keys that ``state`` lacks (a peer that registered different state)."""
        return [k for k in self.keys() if k not in state]

    def load(self, state: Mapping[str, Any]) -> None:
        """Load every registered entry, the Manager's own first; `FtlaunchError` if one is missing."""
        missing = self.missing(state)
        if missing:
            raise FtlaunchError(
                f"healed state has no entries {missing}: do both groups register the same state?"
            )
        self._own[0](state[MANAGER_STATE_KEY])
        for key, (load, _) in self._user.items():
            load(state[key])


def on_demand(claims: bool) -> list[str] | None:
    """A request's claim before anyone is known to heal: ``[]`` ("I claim when a heal is due",
    `plan.claims_wanted`), or None with claims off (``FTLAUNCH_HEAL_CLAIMS``, `env.WorkerEnv`)."""
    return [] if claims else None


def claim_token(snapshot: Served | None, claims: bool) -> str | None:
    """What this rank tells its leader about its snapshot (`worker.committed.Snapshot`): its claim
    (the checksum of the state it serves, every tensor's path, dtype, shape and ``sum64``), or with
    claims off (``claims`` False: ``FTLAUNCH_HEAL_CLAIMS``, `env.WorkerEnv`) `STAGED_TOKEN`; None
    when it has nothing to serve.

    Tensors only: honest groups that committed the same steps hold bit-identical tensors, while
    numbers beside them (a prefetching loader's position) may legitimately differ a little. Costs
    one pass over the state, made only when a heal is due (a snapshot exists then only)."""
    if snapshot is None:
        return None
    if not claims:
        return STAGED_TOKEN
    return snapshot.claim()


#: A rank's word to its leader that it holds a snapshot, when claims are off.
STAGED_TOKEN = "staged"


def check_claim(state: Mapping[str, Any], plan: StepPlan, group_rank: int) -> None:
    """`CommunicationError` unless ``state`` is what the plan's source claimed for ``group_rank``
    (and the Manager's step inside it is the step the source claimed to be at)."""
    own = state.get(MANAGER_STATE_KEY)
    if isinstance(own, Mapping) and own.get("step") != plan.max_step:
        raise CommunicationError(
            f"state received from {plan.recover_src_id} is at step {own.get('step')!r}, "
            f"but its source claimed step {plan.max_step}: rejected"
        )
    claim = plan.recover_claim
    if claim is None:
        return
    want = claim[group_rank] if group_rank < len(claim) else None
    got = state_checksum(state)
    if got != want:
        raise CommunicationError(
            f"state received from {plan.recover_src_id} does not match the checksum it claimed "
            f"(claimed {want}, received {got}): rejected, this step is not committed"
        )


def offer(
    transport: CheckpointTransport[Any], plan: StepPlan, snapshot: Served | None, timeout: timedelta
) -> None:
    """Source side: serve (or push) ``snapshot`` (`worker.committed.Snapshot`, None: this rank has
    none) to the healers assigned to this group.

    The caller must call ``transport.disallow_checkpoint()`` before a live snapshot's state changes
    again. Raises what the transport raises (`CheckpointTransportError`), and `CommunicationError`
    without a snapshot or when a live state stays closed for reading for ``timeout``.
    """
    if snapshot is None:
        raise CommunicationError("asked to serve a heal, but this rank holds no snapshot of its state")
    state = snapshot.state(timeout.total_seconds())
    transport.send_checkpoint(
        dst_ranks=list(plan.recover_dst_ranks), step=snapshot.step, state_dict=state, timeout=timeout
    )


def fetch(
    transport: CheckpointTransport[Any],
    plan: StepPlan,
    quorum: Quorum,
    group_rank: int,
    registry: StateRegistry,
    timeout: timedelta,
) -> dict[str, Any]:
    """Healer side: the state of the plan's source group, from its rank with our group rank.

    Raises `CheckpointTransportError` when the transfer fails and `CommunicationError` when the
    state lacks a registered key.
    """
    src_rank = plan.recover_src_rank
    if src_rank is None:
        raise ValueError("fetch() on a plan that does not heal")
    metas = quorum.participants[src_rank].data.get("ckpt") or []
    meta = metas[group_rank] if group_rank < len(metas) else ""
    # What we receive should look like our own state: a transport may refuse far more.
    try:
        transport.expect_like(registry.snapshot())
    except Exception as e:  # noqa: BLE001 - only a hint: the format's own limits still hold
        transport.expect_like(None)
        logging.getLogger(__name__).debug("no receive limits from our own state: %s", e)
    state = transport.recv_checkpoint(src_rank=src_rank, metadata=meta, step=plan.max_step, timeout=timeout)
    missing = registry.missing(state)
    if missing:
        raise CommunicationError(
            f"state received from {plan.recover_src_id} has no entries {missing}: "
            "do all groups register the same state?"
        )
    check_claim(state, plan, group_rank)
    return state


def exchange(
    transport: CheckpointTransport[Any],
    plan: StepPlan,
    quorum: Quorum,
    snapshot: Served | None,
    group_rank: int,
    registry: StateRegistry,
    timeout: timedelta,
    log: logging.LoggerAdapter,
) -> tuple[bool, dict[str, Any] | None]:
    """This group's part of the step's healing: (whether it offered its ``snapshot`` -- the caller
    must ``disallow_checkpoint`` after the vote --, the state it received when it heals, else None)."""
    sent = False
    if plan.untrusted_ids and plan.heal:
        log.warning(
            "not healing from %s: their state claims disagree with the other up-to-date groups'",
            list(plan.untrusted_ids),
        )
    if plan.contested and plan.heal:
        log.warning(
            "the up-to-date groups claim different states and no claim has a majority: healing from "
            "%s, checked against its own claim only",
            plan.recover_src_id,
        )
    if plan.recover_dst_ranks:  # a source: serve our state to the healers assigned to us
        log.info("sending state to replica ranks %s", list(plan.recover_dst_ranks))
        offer(transport, plan, snapshot, timeout)
        sent = True
    received = None
    if plan.waits and plan.deferred:
        log.info("waiting one step to heal: no group at step %d holds a snapshot yet (they take one "
                 "at the end of this step)", plan.max_step)  # fmt: skip
    if plan.heal:  # behind: fetch the state now; the Manager loads it once every group agreed to commit
        log.info("healing from %s at step %d", plan.recover_src_id, plan.max_step)
        received = fetch(transport, plan, quorum, group_rank, registry, timeout)
    return sent, received
