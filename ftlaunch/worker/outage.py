"""Stepping on the last quorum while the lighthouse is unreachable (docs/lighthouse.md, *Stepping
through an outage*).

Why: a step needs its quorum before its collectives, so without this every group waits for a dead
lighthouse to come back (12 s in the soak) and commits nothing meanwhile, although the process
group of the last quorum is configured and every member of it is alive.

The rule, decided by each group leader alone (`LastQuorumSteps.ask`): when the lighthouse cannot be
reached for `UNREACHABLE_AFTER` seconds and this group's last step *committed* on a *complete,
healthy* quorum (every group a participant, all at the same step, nobody healing, no layout
conflict) -- or on a complete quorum in which some groups healed -- the group steps on that quorum
again, with every member at the step they all reached (`reached`): the leader returns it as the step's
quorum, so the group's other ranks (through the group store) and `plan_step` see the members they saw
last step, each where it is now, the quorum id does not change and the process group is not
reconfigured. The steps must be the reached ones, not the last quorum's: a step's plan says from which
step it went (``plan.max_step``), and the exactly-once sampler reads that to tell which samples the
commit trained (worker/exactly_once.py).

Why it is safe -- a step commits only if every participant of the quorum's process group votes for
it in the same collectives (worker/commit.py), so:

* all members stepping on the same quorum commit the same steps: they were all at the same step
  (each committed the last one on it, nobody healing), and each fallback step commits on all of them
  or on none;
* a member that does not step on it (it reached the lighthouse and waits for a quorum, it died, it
  took a different quorum) is missing from the collectives: they fail or wait, nothing commits, and
  a step that did not commit makes the group ineligible (`after_step`) -- it then waits for the
  lighthouse as before, with backoff, without spinning;
* a quorum the lighthouse forms with the same id has the same members (ids change with membership),
  so a member that got an answer and a member that fell back still use the same process group;
  a new id means a new process group, and the fallen-back member's collectives fail (no commit);
* heals need a lighthouse (a restarted group can only join through one): none happen meanwhile.
  (Heal claims, which pick heal sources, play no part either.)

The edge when the lighthouse comes back: some members may reach it and park a quorum request
while others were refused a moment earlier and stepped on, waiting in a collective for the parked
ones. A group in outage mode (its last quorum came from here) therefore waits at most `ANSWER_WAIT`
for a quorum answer before stepping on the last quorum again: the parked member joins the step, and
at the next probe every member asks the lighthouse, which forms at once (it adopted their resume
reports, lighthouse/resume.py). The same short wait holds for a group that is not in
outage mode yet whose lighthouse was unreachable since its last quorum: it met the outage only after
the lighthouse came back (it was SIGSTOPped while its peers stepped on) and parks while they wait in
a collective for it; with no outage seen it asks again for the rest of the quorum timeout. In outage mode a
group tries the lighthouse only every `PROBE_EVERY` steps, with one connection attempt: all members are at the
same step, so they try together, and the steps between cost nothing. Quorum ids stay above every reported one,
and the step each group reports is the one it reached, so nothing is committed twice or lost.

``FTLAUNCH_OUTAGE_STEPS=off`` turns it off (the groups wait for the lighthouse instead).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ftlaunch.errors import LighthouseUnavailableError, QuorumTimeoutError
from ftlaunch.lighthouse.client import QuorumClient
from ftlaunch.lighthouse.quorum import Quorum, QuorumMember
from ftlaunch.lighthouse.reconnect import OutageTolerantClient
from ftlaunch.worker import quorum_request
from ftlaunch.worker.plan import StepPlan

__all__ = [
    "ANSWER_WAIT",
    "PROBE_EVERY",
    "UNREACHABLE_AFTER",
    "LastQuorumSteps",
    "after_heal",
    "healthy",
    "reached",
]

#: Seconds the lighthouse must be unreachable (connections refused or reset) before a group steps on
#: its last quorum: every member notices the same dead lighthouse within about this long.
UNREACHABLE_AFTER = 0.5
#: In outage mode, the longest a quorum request waits for an answer before the group steps on its
#: last quorum again (a peer that was refused may be waiting in a collective for this group).
ANSWER_WAIT = 1.0
#: In outage mode the lighthouse is tried (one connection attempt) only at steps that are a multiple
#: of this: every member is at the same step, so all try at the same step, and the steps between
#: pay nothing (a blackholed lighthouse address would cost a connect timeout each time).
PROBE_EVERY = 4


def healthy(plan: StepPlan) -> bool:
    """Whether a step on ``plan`` involved every group of its quorum, all up to date (nobody healed,
    no layout conflict): the only kind of quorum a group may step on without a lighthouse. (Heal
    claims do not matter here: they choose heal sources, and no heal happens without a lighthouse.)"""
    n = plan.replica_world_size
    return (
        not plan.heal and plan.num_sources == n and plan.num_participants == n and plan.num_up_to_date == n
        and plan.layout_conflict is None
    )  # fmt: skip


def after_heal(quorum: Quorum, plan: StepPlan) -> Quorum | None:
    """After a committed step on ``quorum`` in which some groups healed: the same quorum with every
    participant at the step they all reached (``max_step + 1``: the sources stepped from it, the
    healers loaded it and stepped with them), or None when the step was not complete otherwise (a
    layout conflict, or participants other than the sources: `WorldSizeMode.FIXED_WITH_SPARES`).
    Every group computes it from the same quorum, so all get the same one, on which nobody heals."""
    if plan.layout_conflict is not None or plan.num_participants != plan.num_sources or plan.deferred:
        return None  # (deferred: the healers waited, still behind)
    return reached(quorum, plan)


def reached(quorum: Quorum, plan: StepPlan) -> Quorum:
    """``quorum`` after a step on it committed on every member: each participant at the step they all
    reached (``max_step + 1``), with no failed commits. What the next step on it plans from: its plan
    then says the step it goes from, as a lighthouse's quorum would (the exactly-once sampler checks
    a commit against it)."""
    step = plan.max_step + 1
    members = tuple(dataclasses.replace(m, step=step, commit_failures=0) for m in quorum.participants)
    return dataclasses.replace(quorum, participants=members)


class LastQuorumSteps:
    """The group leader's choice between the lighthouse's quorum and the last one (module docstring)."""

    def __init__(
        self,
        enabled: bool = True,
        *,
        unreachable_after: float = UNREACHABLE_AFTER,
        answer_wait: float = ANSWER_WAIT,
        probe_every: int = PROBE_EVERY,
    ) -> None:
        self.enabled = enabled
        self.unreachable_after = unreachable_after
        self.answer_wait = answer_wait
        self.probe_every = probe_every
        self._current: Quorum | None = None  # the quorum of the step in progress
        self._eligible: Quorum | None = None  # the one the last step committed on, complete and healthy
        #: The step in progress runs on a quorum from here, not from the lighthouse.
        self.in_outage = False
        #: Steps taken on the last quorum (logs, tests).
        self.steps = 0

    def ask(
        self,
        client: QuorumClient,
        request: QuorumMember,
        retries: int,
        timeout: float,
        log: logging.LoggerAdapter[Any],
    ) -> Quorum:
        """This step's quorum: the lighthouse's, or the last one while the lighthouse is unreachable
        (and the last step qualifies). Errors other than unreachability are the lighthouse's own."""
        fallback = self._eligible if self.enabled and isinstance(client, OutageTolerantClient) else None
        if fallback is None:
            self.in_outage = False
            quorum = quorum_request.ask_lighthouse(client, request, retries, timeout, log)
        else:
            if self.in_outage and request.step % self.probe_every != 0:
                return self._step_on(fallback, "", log)
            assert isinstance(client, OutageTolerantClient)  # noqa: S101 - checked for `fallback` above
            # The first attempt waits at most `answer_wait` for an answer, in outage mode or not: a
            # leader that met a dead lighthouse only after it came back (SIGSTOPped meanwhile) parks
            # at the new one while its peers, which stepped on, wait in a collective for it.
            wait = min(timeout, self.answer_wait)
            # In outage mode one connection attempt: the lighthouse is known to have been down.
            give_up = 0.0 if self.in_outage else self.unreachable_after
            try:
                quorum = quorum_request.ask_lighthouse(client, request, retries, wait, log,
                                                       give_up_after=give_up,
                                                       final=(QuorumTimeoutError,))  # fmt: skip
            except LighthouseUnavailableError as e:
                return self._step_on(fallback, f"lighthouse unreachable ({e})", log)
            except QuorumTimeoutError:
                if self.in_outage or client.lost_since_last_quorum:
                    return self._step_on(fallback, f"no quorum answer within {wait:g}s after an outage", log)
                if wait >= timeout:
                    raise
                quorum = self._ask_again(client, request, retries, timeout - wait, fallback, log)
            if self.in_outage:
                log.info("lighthouse back: quorum %d after %d step(s) on quorum %d", quorum.quorum_id,
                         self.steps,
                         fallback.quorum_id)  # fmt: skip
            self.in_outage = False
        self._current = quorum
        return quorum

    def _ask_again(
        self,
        client: OutageTolerantClient,
        request: QuorumMember,
        retries: int,
        timeout: float,
        fallback: Quorum,
        log: logging.LoggerAdapter[Any],
    ) -> Quorum:
        """No answer within `answer_wait` and no outage seen: the lighthouse is taking its time (a
        join, a hang being declared); wait for it as long as the caller allows -- stepping on
        should the lighthouse die meanwhile, as in the first attempt."""
        try:
            return quorum_request.ask_lighthouse(client, request, retries, timeout, log,
                                                 give_up_after=self.unreachable_after)  # fmt: skip
        except LighthouseUnavailableError as e:
            return self._step_on(fallback, f"lighthouse unreachable ({e})", log)

    def _step_on(self, quorum: Quorum, why: str, log: logging.LoggerAdapter[Any]) -> Quorum:
        if not self.in_outage:
            log.warning("%s: stepping on the last quorum %d (%d groups) until it is back", why,
                        quorum.quorum_id,
                        len(quorum.participants))  # fmt: skip
        self.in_outage = True
        self.steps += 1
        self._current = quorum
        return quorum

    def after_step(self, committed: bool, plan: StepPlan | None) -> None:
        """The step's outcome (every rank of every group agreed on it): only a committed step on a
        healthy plan lets the next one go on without the lighthouse -- or a committed heal step on an
        otherwise complete one (`after_heal`)."""
        current = self._current
        if not committed or plan is None or current is None:
            self._eligible = None
        elif healthy(plan):
            self._eligible = reached(current, plan)
        else:
            self._eligible = after_heal(current, plan)
        if self._eligible is None and self.in_outage:
            self.in_outage = False  # the fallback failed: wait for the lighthouse (with backoff)
