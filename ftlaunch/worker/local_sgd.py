"""LocalSGD, DiLoCo and Streaming DiLoCo, fault tolerant (torchft's ``torchft.local_sgd``).

Groups train alone for ``sync_every`` inner steps and meet only at *sync points*, so the slow
cross-group links carry one exchange per ``sync_every`` steps instead of one per step:

- `LocalSGD` averages the parameters (https://arxiv.org/abs/1805.09767).
- `DiLoCo` averages *pseudo-gradients* (last global parameters - local parameters) and applies them
  with an outer optimizer to the global parameters (https://arxiv.org/abs/2311.08105). With several
  model fragments it is Streaming DiLoCo (https://arxiv.org/abs/2501.18512): fragments are synced in
  turn, one every ``sync_every / len(fragments)`` steps; a fragment's all-reduce may overlap the next
  ``fragment_sync_delay`` inner steps; the pseudo-gradients may travel in 8 or 4 bits.

Both hook the inner optimizer: ``optimizer.step()`` counts inner steps and runs the sync when one
is due; the training loop does not change. Enter them (``with DiLoCo(...)`` or ``ft.diloco(...)``,
which also joins at once).

Fault tolerance works at sync points, never per inner step:

- Each sync point takes one quorum (`sync_point.take_quorum`). A group that died during its inner
  loop is not in it; one that dies during the sync fails the sync's collectives, the commit vote
  fails everywhere, and every group drops the fragment's local progress and retries it at the next
  sync point with the next quorum.
- A group joins before its first training step (its first forward pass or inner step after
  entering, or an explicit ``join()``): it asks for a quorum at once (so survivors, whose next
  quorum includes it, never wait for it), takes part in the survivors' next sync contributing
  nothing, and loads the healed state after the vote: DiLoCo's global parameters, outer optimizer
  state and sync count (the fragment schedule), LocalSGD's average. It starts its inner loop from them.
  A group that joins running peers inside a training step counts that step's inner step as the
  one at which they voted on that sync: from then on its schedule is theirs, step for step, so a
  training loop that stops at a given step stops in every group.
- Which fragment a sync exchanges, and whether anyone has anything to exchange yet, is agreed by a
  small MAX all-reduce of ``(kind, sync count)`` at each sync point: a joining group learns the
  survivors' schedule before the pseudo-gradient collectives, whose shapes must match. LocalSGD
  has no schedule to learn; one element averaged with its parameters tells a join whether anyone
  brought a sync (running peers) or everyone is joining (a fresh or resumed job).

Differences from torchft (where torchft's behaviour was not kept, and why) are listed in
docs/diloco.md.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from ftlaunch.errors import FtlaunchError
from ftlaunch.worker.fragments import Fragment
from ftlaunch.worker.manager import Manager
from ftlaunch.worker.sync_point import DEFAULT_BUCKET_CAP_MB, Buckets, local_view, take_quorum, wait

logger = logging.getLogger(__name__)

#: What a group brings to a sync point: nothing yet (it is joining), or a sync of its inner steps.
JOIN, SYNC = 0, 1
#: Key of DiLoCo's schedule (sync count, lineage) in the state that travels with live recovery.
STATE_KEY = "diloco"
#: Key of fragment i's global parameters and outer optimizer state there: torchft's key and layout
#: (``{"original_parameters": {name: tensor}, "outer_optimizer": state_dict}``), which code that
#: reads ``Manager._manager_state_dict()`` expects.
FRAGMENT_KEY = "StreamingDiLoCoFragment_{}"
#: Lineage ids are in [1, LINEAGE_END): a MAX all-reduce of (id, LINEAGE_END - id) gives the largest
#: and the smallest id of the up-to-date groups (healers contribute zeros, which count for neither).
LINEAGE_END = 1 << 62


def _log(manager: Manager) -> logging.Logger | logging.LoggerAdapter:
    return getattr(manager, "log", logger)


class _Hooked:
    """Enter/exit: hook ``optimizer.step``, and join the job once, before the first training step.

    The join waits for the first forward pass in the entering thread (any module: the outermost
    one runs first, before a parameter is read) or the first ``optimizer.step()``, whichever comes
    first, or for an explicit `join`. Not on entering: ``with DiLoCo(...) as diloco:`` binds
    ``diloco`` only after ``__enter__`` returns, and the join may heal, which calls the state
    functions, which may read ``diloco`` (torchft's DiLoCo syncs nothing on entering, and such code
    exists). A restarted group still trains no step on stale parameters: it heals before its
    first forward.
    """

    _optimizer: torch.optim.Optimizer

    def __init__(self) -> None:
        self._hooks: list[RemovableHandle] = []
        self._join_hooks: list[RemovableHandle] = []
        self._joined = False
        self._joining = False

    def __enter__(self) -> Self:
        if not self._hooks:
            self._hooks.append(self._optimizer.register_step_post_hook(self._after_inner_step))
        if not self._joined and not self._join_hooks:
            owner = threading.get_ident()

            def before_forward(*_: Any) -> None:
                if threading.get_ident() == owner:
                    self._join_once(in_step=True)

            self._join_hooks = [
                register_module_forward_pre_hook(before_forward),
                self._optimizer.register_step_pre_hook(lambda *_: self._join_once(in_step=True)),
            ]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks + self._join_hooks:
            h.remove()
        self._hooks.clear()
        self._join_hooks.clear()

    @property
    def joined(self) -> bool:
        """Whether this group has joined the job (see `join`)."""
        return self._joined

    def join(self) -> None:
        """Join the job now, if not done yet: a first sync point with the other groups, at which a
        restarted group heals (its state functions are called) and a fresh job's groups take the
        primary's parameters. Runs by itself before the first forward or inner step."""
        self._join_once(in_step=False)

    def _join_once(self, in_step: bool) -> None:
        """``in_step``: the join runs inside a training step (its forward or inner step), whose
        batch is drawn and whose inner step is still to come; else between two steps."""
        if self._joined or self._joining:
            return
        self._joining = True
        try:
            self._join(in_step)
        finally:
            self._joining = False
        self._joined = True
        for h in self._join_hooks:
            h.remove()
        self._join_hooks.clear()

    def _join(self, in_step: bool) -> None:
        raise NotImplementedError

    def _after_inner_step(self, *_: Any) -> None:
        raise NotImplementedError


class LocalSGD(_Hooked):
    """Average the model's parameters over the replica groups every ``sync_every`` inner steps.

    ``LocalSGD(manager, model, optimizer, sync_every)`` as torchft's; ``bucket_cap_mb`` sizes the
    flat buffers the parameters travel in (None: one all-reduce per parameter). A sync that does
    not commit leaves the local parameters as they are.
    """

    def __init__(
        self,
        manager: Manager,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sync_every: int,
        *,
        bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        super().__init__()
        self._manager = manager
        self._model = model
        self._optimizer = optimizer
        self._sync_every = sync_every
        self._bucket_cap_mb = bucket_cap_mb
        self._local_step = 0
        #: Joined running peers inside a training step: its inner step is their sync's (`_join`).
        self._joined_their_sync = False
        manager.serve_live_state()  # quorums only at sync points, taken with the state held still
        # What the groups share: the parameters as averaged at the last sync point.
        manager.set_agreed_state(
            lambda _: {"parameters": [local_view(p.detach()) for p in model.parameters()]}
        )
        # Durable checkpoints right after an average: every group's own part (its optimizer's
        # momentum) is saved by each group beside the job's checkpoint.
        manager.save_after_syncs()

    @property
    def local_step(self) -> int:
        """Inner steps since the last sync point."""
        return self._local_step

    def _after_inner_step(self, *_: Any) -> None:
        self._local_step += 1
        if self._joined_their_sync:  # the peers' sync step, whose sync the join took part in
            self._joined_their_sync = False
            self._local_step = 0
            return
        if self._local_step >= self._sync_every:
            self.sync()

    def sync(self) -> bool:
        """Average the parameters with the other groups now; True if the sync committed."""
        return self._sync(SYNC)[0]

    def _sync(self, kind: int) -> tuple[bool, bool]:
        take_quorum(self._manager, _log(self._manager))
        committed, brought_sync = self._average(kind)
        self._local_step = 0
        return committed, brought_sync

    def _join(self, in_step: bool) -> None:
        # A sync at once: a fresh job's groups all get the primary's parameters (init_sync), a
        # restarted group the survivors' average (it contributes zeros while it heals).
        while not (sync := self._sync(JOIN))[0]:
            _log(self._manager).info("joining: the sync did not commit, asking again")
        # Running peers (one of them brought a sync) took this quorum and voted in the inner step
        # that reached sync_every. A join inside a training step (its first forward or inner step)
        # is in that step of theirs: its inner step is counted as theirs, so after it the groups
        # are in the same place (inner step, Manager step, the sampler's batches) and stay there.
        # Starting over at 0 there puts it one inner step ahead for good; with sync_every=1 its
        # first step takes a second quorum, and a loop that stops at a Manager step stops them but
        # leaves it asking for a quorum no one else asks for. A join between two steps (join(),
        # ft.local_sgd) is after their sync: its next step is their next one. A fresh or resumed
        # job's join (everyone joining) is no inner step of anyone's.
        self._joined_their_sync = in_step and sync[1]
        self._local_step = self._sync_every - 1 if self._joined_their_sync else 0

    def _average(self, kind: int) -> tuple[bool, bool]:
        """Average the parameters; whether the sync committed, and whether an up-to-date group
        brought a sync (rather than a join): one element more in the average, ``kind`` from each
        group (a healer's is zeroed with its parameters), above 0 when any of them brought one."""
        params = [local_view(p) for p in self._model.parameters()]
        like = params[0] if params else torch.empty(0)
        brought = torch.full((1,), float(kind), dtype=like.dtype, device=like.device)
        buckets = Buckets([*params, brought], self._bucket_cap_mb)
        with torch.no_grad():
            for t, v in zip([*params, brought], buckets.views, strict=True):
                v.copy_(t)
        works = [self._manager.allreduce(b) for b in buckets.buffers]
        for w in works:
            wait(w)
        if not self._manager.should_commit():
            return False, False
        with torch.no_grad():
            for p, v in zip(params, buckets.views[:-1], strict=True):
                p.copy_(v)
        self._manager.sync_applied()
        return True, bool(buckets.views[-1].item() > 0)


@dataclass
class _Sync:
    """A sync point between its start (quorum, all-reduce launched) and its end (commit)."""

    kind: int
    fragment: Fragment | None = None
    grads: Buckets | None = None
    works: list[Any] = field(default_factory=list)
    #: This group's global parameters descend from other ones than the job's (see `DiLoCo._start`).
    lost_lineage: bool = False


class DiLoCo(_Hooked):
    """DiLoCo, and Streaming DiLoCo with several fragments; torchft's constructor.

    Args:
        manager: the Manager of this worker.
        model_fragments: the modules whose parameters are synced in turn (one module: plain
            DiLoCo). Their parameters must be disjoint.
        inner_optimizer: the optimizer of every step; its ``step`` drives the schedule.
        outer_optimizer: applies the averaged pseudo-gradients to the global parameters (e.g.
            ``SGD(lr=0.7, momentum=0.9, nesterov=True)`` over the model's parameters); one per
            fragment, or one for all.
        sync_every: inner steps between two syncs of the same fragment; a multiple of the number
            of fragments (a fragment is synced every ``sync_every / len(fragments)`` steps).
        backup_device: where the global parameters live (default CPU); ``pin_memory`` pins them
            when that is the CPU and CUDA is available.
        use_bucketization, bucket_cap_mb: pseudo-gradients travel in flat buffers of at most
            ``bucket_cap_mb`` (default 32 MB); ``use_bucketization=False`` sends one per parameter.
        should_quantize: send pseudo-gradients in 8 bits (True or 8) or 4 bits (4).
        fragment_sync_delay: inner steps a fragment's all-reduce overlaps before its outer step
            (the paper's tau); less than ``sync_every / len(fragments)``.
        fragment_update_alpha: after an outer step, parameters = global + alpha (local - global);
            0 takes the global parameters, 1 keeps the local ones.
    """

    def __init__(
        self,
        manager: Manager,
        model_fragments: Sequence[nn.Module] | nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        sync_every: int,
        backup_device: torch.device | str | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = True,
        bucket_cap_mb: float | None = None,
        should_quantize: bool | int = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        modules = [model_fragments] if isinstance(model_fragments, nn.Module) else list(model_fragments)
        outers = (
            [outer_optimizer] * len(modules)
            if isinstance(outer_optimizer, torch.optim.Optimizer)
            else list(outer_optimizer)
        )
        _check(modules, inner_optimizer, outers, sync_every, fragment_sync_delay, fragment_update_alpha)
        if should_quantize:
            from ftlaunch.worker.quantization import bits_of

            bits_of(should_quantize)  # ValueError now rather than at the first sync
        super().__init__()
        self._manager = manager
        self._optimizer = inner_optimizer
        device = torch.device(backup_device) if backup_device is not None else torch.device("cpu")
        self._fragments = [Fragment(m, o, device, pin_memory) for m, o in zip(modules, outers, strict=True)]
        self._outers = list({id(o): o for o in outers}.values())
        self._outer_of = [next(j for j, u in enumerate(self._outers) if u is o) for o in outers]
        self._interval = sync_every // len(modules)
        self._prepare_at = self._interval - fragment_sync_delay
        self._alpha = fragment_update_alpha
        self._bucket_cap_mb = (bucket_cap_mb or DEFAULT_BUCKET_CAP_MB) if use_bucketization else None
        self._should_quantize = should_quantize
        self._device = self._fragments[0].params[0].device
        self._local_step = 0
        self._syncs = 0
        self._lineage = secrets.randbelow(LINEAGE_END - 1) + 1
        self._pending: _Sync | None = None
        self._healed = False
        #: Joined at running peers' sync point: the sync their next vote ends is already done here.
        self._joined_their_sync = False
        for f in self._fragments:
            f.save_global()
        entries = self.heal_entries()
        manager.register_state_dict_fn(STATE_KEY, self._load_schedule, lambda: self.heal_entries()[STATE_KEY])
        for i in range(len(self._fragments)):
            key = FRAGMENT_KEY.format(i)
            manager.register_state_dict_fn(
                key, functools.partial(self._load_fragment, i), functools.partial(self._fragment_state, i)
            )
        manager.serve_live_state()  # quorums only at sync points, taken with the state held still
        # What the groups share: global parameters, outer optimizer state, the schedule. Not the
        # inner parameters and inner optimizer state, which each group trains on its own data.
        manager.set_agreed_state(lambda state: {k: state[k] for k in entries})
        # Durable checkpoints right after an outer step, when the groups hold the same global
        # state; each group saves its own inner state beside it. A job resuming has loaded the
        # global state by now (``_healed``), and its own model and inner optimizer in here.
        manager.save_after_syncs(set(entries))

    # ---------------------------------------------------------------- what users and tests read
    @property
    def syncs(self) -> int:
        """Committed syncs (outer steps) of the job; the same in every group, healed with the state."""
        return self._syncs

    @property
    def local_step(self) -> int:
        """Inner steps since the last sync point."""
        return self._local_step

    @property
    def sync_interval(self) -> int:
        """Inner steps between two sync points: ``sync_every / len(fragments)``."""
        return self._interval

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The global (outer) parameters by fragment-qualified name; identical in every group."""
        return {f"{i}.{n}": b for i, f in enumerate(self._fragments) for n, b in f.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """What a healing group receives (and what a checkpoint of the algorithm holds)."""
        return {
            "syncs": self._syncs,
            "lineage": self._lineage,
            "fragments": [f.state_dict() for f in self._fragments],
            "outer_optimizers": [o.state_dict() for o in self._outers],
        }

    def heal_entries(self) -> dict[str, Any]:
        """What DiLoCo adds to the state a healing group receives, by Manager key: the schedule
        under ``"diloco"``, each fragment under torchft's ``StreamingDiLoCoFragment_<i>``."""
        entries: dict[str, Any] = {STATE_KEY: {"syncs": self._syncs, "lineage": self._lineage}}
        for i in range(len(self._fragments)):
            entries[FRAGMENT_KEY.format(i)] = self._fragment_state(i)
        return entries

    def _fragment_state(self, i: int) -> dict[str, Any]:
        return {
            "original_parameters": self._fragments[i].state_dict(),
            "outer_optimizer": self._outers[self._outer_of[i]].state_dict(),
        }

    def _load_fragment(self, i: int, state_dict: dict[str, Any]) -> None:
        self._fragments[i].load_state_dict(state_dict["original_parameters"])
        self._outers[self._outer_of[i]].load_state_dict(state_dict["outer_optimizer"])
        self._healed = True

    def _load_schedule(self, state_dict: dict[str, Any]) -> None:
        self._syncs = int(state_dict["syncs"])
        self._lineage = int(state_dict["lineage"])
        self._healed = True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load `state_dict` and restart the model from its global parameters."""
        self._load_healed(state_dict)
        for f in self._fragments:
            f.restore()

    def _load_healed(self, state_dict: dict[str, Any]) -> None:
        fragments, outers = state_dict["fragments"], state_dict["outer_optimizers"]
        if len(fragments) != len(self._fragments) or len(outers) != len(self._outers):
            raise ValueError(
                f"DiLoCo state has {len(fragments)} fragments and {len(outers)} outer optimizers, "
                f"this DiLoCo {len(self._fragments)} and {len(self._outers)}"
            )
        for f, sd in zip(self._fragments, fragments, strict=True):
            f.load_state_dict(sd)
        for o, sd in zip(self._outers, outers, strict=True):
            o.load_state_dict(sd)
        self._syncs = int(state_dict["syncs"])
        self._lineage = int(state_dict["lineage"])
        self._healed = True

    # ---------------------------------------------------------------- the schedule
    def _after_inner_step(self, *_: Any) -> None:
        self._local_step += 1
        if self._joined_their_sync and self._local_step == self._interval:
            self._joined_their_sync = False
            self._local_step = 0  # where the peers are after their vote: the join committed it
            return
        if self._local_step == self._prepare_at:
            self._pending = self._start(SYNC)
        if self._local_step == self._interval:
            pending, self._pending = self._pending, None
            assert pending is not None  # started at _prepare_at <= _interval
            self._finish(pending)
            self._local_step = 0

    def _join(self, in_step: bool) -> None:
        if not self._healed:  # loaded from a durable checkpoint: its global state stands
            for f in self._fragments:
                f.save_global()  # this group's starting point, unless it heals
        while not self._finish(sync := self._start(JOIN)):
            _log(self._manager).info("joining: the sync did not commit, asking again")
        # Running peers (they brought a sync) took this quorum at inner step interval - delay and
        # vote on it at inner step `interval`; our vote waited for theirs. A join inside a
        # training step (its first forward or inner step) is in the step of theirs that ends with
        # that vote: its inner step is counted as theirs, so after it the groups are in the same
        # place (sync count, inner step, Manager step, the sampler's batches) and stay there.
        # Starting over at 0 there would put it one inner step ahead for good; where that first
        # inner step takes a quorum (interval - delay = 1), a loop that stops at a Manager step
        # stops them but leaves it asking for a quorum no one else asks for. A join between two
        # steps (an explicit join(), ft.diloco) is after their vote: its next step is their next
        # one. A fresh or resumed job's join (everyone joining) is no inner step of anyone's.
        self._joined_their_sync = in_step and sync.kind == SYNC
        self._local_step = self._interval - 1 if self._joined_their_sync else 0

    # ---------------------------------------------------------------- one sync point
    def _start(self, kind: int) -> _Sync:
        """Quorum, agreement on the fragment, and the pseudo-gradient all-reduce (not waited for)."""
        take_quorum(self._manager, _log(self._manager))
        kind, syncs, newest, oldest = self._agree(kind)
        if kind == JOIN:  # everyone is just starting: nothing to exchange, only the heal
            self._lineage = newest  # one history from here on (healers also receive it)
            return _Sync(JOIN)
        if newest != oldest:
            # Up-to-date groups whose global parameters have different histories: two sets of groups
            # started apart (each formed its first quorum without the other) and reached the same
            # step. Nobody commits; the groups of the older lineage fall back to step 0, so the next
            # quorum heals them from the others.
            lost = self._manager.is_participating() and self._lineage != newest
            self._manager.report_error(FtlaunchError("up-to-date groups have different global parameters"))
            return _Sync(SYNC, lost_lineage=lost)
        fragment = self._fragments[syncs % len(self._fragments)]
        grads = fragment.pseudo_gradients(self._bucket_cap_mb)
        works = [self._manager.allreduce(b, should_quantize=self._should_quantize) for b in grads.buffers]
        return _Sync(SYNC, fragment, grads, works)

    def _agree(self, kind: int) -> tuple[int, int, int, int]:
        """Kind, sync count, newest and oldest lineage of the up-to-date groups: one MAX all-reduce,
        in which healers count zero.

        Waiting for it also means that every healer has its copy of our state (a healer fetches
        before it contributes): the inner steps that overlap the sync may change the model.
        """
        mine = [kind, self._syncs, self._lineage, LINEAGE_END - self._lineage]
        control = torch.tensor(mine, dtype=torch.int64, device=self._device)
        wait(self._manager.allreduce(control, reduce_op=dist.ReduceOp.MAX))
        agreed_kind, syncs, newest, inverse_oldest = (int(v) for v in control.tolist())
        return agreed_kind, syncs, newest, LINEAGE_END - inverse_oldest

    def _finish(self, sync: _Sync) -> bool:
        """Wait for the all-reduce, vote, and apply the outer step if every group committed."""
        for w in sync.works:
            wait(w)
        local = sync.fragment.copy_locals() if sync.fragment is not None and self._alpha > 0 else None
        self._healed = False
        committed = self._manager.should_commit()  # a healer loads the state in here
        if self._healed:
            for f in self._fragments:
                f.restore()  # start from the healed global parameters
            local = None  # our local parameters came from stale ones
            self._healed = False
        if sync.fragment is not None:
            sync.fragment.restore()
            if committed:
                assert sync.grads is not None
                sync.fragment.outer_step(sync.grads)
                if local is not None:
                    sync.fragment.merge(local, self._alpha)
                self._syncs += 1
                self._manager.sync_applied()
        if sync.lost_lineage:
            _log(self._manager).warning(
                "this group's global parameters descend from other ones than the job's: it heals at "
                "the next sync"
            )
            self._manager.load_state_dict({"step": 0, "batches_committed": self._manager.batches_committed()})
        if sync.kind == SYNC and sync.fragment is None:
            what = "sync (split histories found)"
        elif sync.fragment is None:
            what = "join"
        else:
            what = f"sync of fragment {self._fragments.index(sync.fragment)}"
        outcome = "committed" if committed else "not committed"
        _log(self._manager).info("%s %s (syncs committed: %d)", what, outcome, self._syncs)
        return committed


def _check(modules: list[nn.Module], inner: torch.optim.Optimizer, outers: list[torch.optim.Optimizer],
           sync_every: int, delay: int, alpha: float) -> None:  # fmt: skip
    n = len(modules)
    if n == 0:
        raise ValueError("DiLoCo needs at least one model fragment")
    if len(outers) != n:
        raise ValueError(f"{len(outers)} outer optimizers for {n} fragments: pass one, or one per fragment")
    if any(o is inner for o in outers):
        raise ValueError("the outer optimizer must not be the inner optimizer")
    if sync_every < n or sync_every % n:
        raise ValueError(f"sync_every ({sync_every}) must be a multiple of the number of fragments ({n})")
    if not 0 <= delay < sync_every // n:
        raise ValueError(
            f"fragment_sync_delay ({delay}) must be >= 0 and less than sync_every / fragments "
            f"({sync_every // n}): a fragment's sync must end before the next one starts"
        )
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"fragment_update_alpha must be in [0, 1], got {alpha}")
    seen: set[int] = set()
    for m in modules:
        for p in m.parameters():
            if id(p) in seen:
                raise ValueError("model fragments share a parameter: each must be in exactly one fragment")
            seen.add(id(p))
