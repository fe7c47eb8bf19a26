"""The per-step plan is a pure function of the quorum: every group must derive a consistent view."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftlaunch.lighthouse.quorum import Quorum, QuorumMember
from ftlaunch.worker.plan import (
    StepPlan,
    WorldSizeMode,
    claims_wanted,
    may_heal,
    plan_step,
    snapshot_due,
)

#: What a member that can take part in a heal says: it holds a snapshot to serve, and (were it
#: behind) it waits for its heal before its forward pass.
READY = {"staged": True, "heal_ready": True}


def quorum(steps: dict[str, int], qid: int = 7, data: dict[str, dict] | None = None) -> Quorum:
    """Members at ``steps``; each with ``READY`` unless ``data`` says otherwise for it."""
    members = tuple(
        QuorumMember(replica_id=rid, store_address=f"h{rid}:1", step=s, data=(data or {}).get(rid, READY))
        for rid, s in sorted(steps.items())
    )
    return Quorum(quorum_id=qid, participants=members, created=0.0)


def test_all_up_to_date_nobody_heals() -> None:
    q = quorum({"rg0": 5, "rg1": 5, "rg2": 5})
    plans = [plan_step(q, r) for r in ("rg0", "rg1", "rg2")]
    assert [p.replica_rank for p in plans] == [0, 1, 2]
    assert all(p.replica_world_size == 3 and p.num_sources == 3 and not p.heal for p in plans)
    assert all(p.recover_dst_ranks == () for p in plans)
    assert {p.store_address for p in plans} == {"hrg0:1"}


def test_behind_group_heals_from_a_source() -> None:
    q = quorum({"rg0": 5, "rg1": 2, "rg2": 5})
    p1 = plan_step(q, "rg1")
    assert p1.heal and p1.recover_src_rank == 0 and p1.recover_src_id == "rg0"
    assert p1.source_rank is None and p1.max_step == 5 and p1.num_sources == 2
    assert plan_step(q, "rg0").recover_dst_ranks == (1,)
    assert plan_step(q, "rg2").recover_dst_ranks == ()
    assert plan_step(q, "rg2").source_rank == 1


def test_init_sync_at_step_zero_everyone_copies_the_primary() -> None:
    q = quorum({"rg0": 0, "rg1": 0, "rg2": 0})
    assert not plan_step(q, "rg0").heal
    assert plan_step(q, "rg0").recover_dst_ranks == (1, 2)
    assert plan_step(q, "rg1").recover_src_rank == 0
    assert plan_step(q, "rg1").num_sources == 1


def test_without_init_sync_step_zero_needs_no_heal() -> None:
    q = quorum({"rg0": 0, "rg1": 0})
    assert not plan_step(q, "rg1", init_sync=False).heal


def test_dynamic_world_size_counts_every_source() -> None:
    q = quorum({"rg0": 5, "rg1": 2, "rg2": 5, "rg3": 5})
    plans = {r: plan_step(q, r, min_replica_size=2) for r in ("rg0", "rg1", "rg2", "rg3")}
    assert {r: p.participant_rank for r, p in plans.items()} == {"rg0": 0, "rg1": None, "rg2": 1, "rg3": 2}
    assert all(p.num_participants == p.num_sources == 3 for p in plans.values())


def test_fixed_with_spares_counts_the_first_min_replica_size_sources() -> None:
    """torchft's FIXED_WITH_SPARES: participants are capped at min_replica_size; the other sources
    are spares (not healers: they are up to date and heal nobody differently)."""
    q = quorum({"rg0": 5, "rg1": 2, "rg2": 5, "rg3": 5})
    plans = {
        r: plan_step(q, r, world_size_mode=WorldSizeMode.FIXED_WITH_SPARES, min_replica_size=2)
        for r in ("rg0", "rg1", "rg2", "rg3")
    }
    assert {r: p.participant_rank for r, p in plans.items()} == {"rg0": 0, "rg1": None, "rg2": 1, "rg3": None}
    assert all(p.num_participants == 2 and p.num_sources == 3 for p in plans.values())
    spare = plans["rg3"]
    assert not spare.heal and not spare.participates and spare.source_rank == 2
    assert plans["rg1"].heal and plans["rg1"].recover_src_id == "rg0"  # healing is unchanged
    # Fewer sources than min_replica_size: all of them count (the commit then refuses the step).
    small = plan_step(
        quorum({"rg0": 5, "rg1": 2}),
        "rg0",
        world_size_mode=WorldSizeMode.FIXED_WITH_SPARES,
        min_replica_size=3,
    )
    assert small.num_participants == 1 and small.participant_rank == 0


def test_round_robin_spreads_healers_over_sources() -> None:
    q = quorum({"a": 9, "b": 9, "c": 1, "d": 0, "e": 3})
    srcs = [plan_step(q, r).recover_src_id for r in ("c", "d", "e")]
    assert srcs == ["a", "b", "a"]
    assert plan_step(q, "a").recover_dst_ranks == (2, 4)
    assert plan_step(q, "b").recover_dst_ranks == (3,)


def test_unknown_replica_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not in quorum"):
        plan_step(quorum({"rg0": 1}), "rg9")


@given(
    st.dictionaries(st.sampled_from([f"rg{i}" for i in range(8)]), st.integers(0, 5), min_size=1),
    st.booleans(),
)
def test_plans_are_mutually_consistent(steps: dict[str, int], init_sync: bool) -> None:
    q = quorum(steps)
    plans = {r: plan_step(q, r, init_sync=init_sync) for r in steps}
    ranks = sorted(p.replica_rank for p in plans.values())
    assert ranks == list(range(len(steps)))
    # Every healer is named as a destination by exactly its source, and sources never heal.
    for p in plans.values():
        if p.heal:
            src = plans[p.recover_src_id]  # type: ignore[index]
            assert not src.heal and p.replica_rank in src.recover_dst_ranks
        else:
            assert p.source_rank is not None and not p.waits
    n_sources = sum(1 for p in plans.values() if not p.heal)
    assert all(p.num_sources == n_sources >= 1 for p in plans.values())
    assert len({p.store_address for p in plans.values()}) == 1


# ------------------------------------------------------------------------------ layouts


def laid_out(steps: dict[str, int], layouts: dict[str, str | None]) -> Quorum:
    """A quorum whose members publish a layout digest (None: they publish none)."""
    members = tuple(
        QuorumMember(replica_id=rid, store_address=f"h{rid}:1", step=s,
                     data=READY if layouts[rid] is None
                     else {**READY, "layout": {"digest": layouts[rid], "text": f"mesh of {rid}"}})
        for rid, s in sorted(steps.items())
    )  # fmt: skip
    return Quorum(quorum_id=1, participants=members, created=0.0)


def test_same_layouts_no_conflict() -> None:
    q = laid_out({"rg0": 3, "rg1": 3, "rg2": 1}, {"rg0": "a", "rg1": "a", "rg2": "a"})
    assert all(plan_step(q, r).layout_conflict is None for r in ("rg0", "rg1", "rg2"))


def test_a_healer_laid_out_differently_refuses_alone() -> None:
    q = laid_out({"rg0": 3, "rg1": 3, "rg2": 1}, {"rg0": "a", "rg1": "a", "rg2": "b"})
    assert plan_step(q, "rg0").layout_conflict is None and plan_step(q, "rg1").layout_conflict is None
    msg = plan_step(q, "rg2").layout_conflict
    assert msg is not None and "rg2 lays out its state differently from rg0" in msg
    assert "here mesh of rg2; there mesh of rg0" in msg and "Refusing to take part" in msg


def test_at_step_zero_the_primary_is_the_reference() -> None:
    q = laid_out({"rg0": 0, "rg1": 0}, {"rg0": "a", "rg1": "b"})
    assert plan_step(q, "rg0").layout_conflict is None  # rg1 heals from rg0 (init_sync): it refuses
    assert plan_step(q, "rg1").layout_conflict is not None


def test_sources_that_differ_all_refuse() -> None:
    q = laid_out({"rg0": 3, "rg1": 3}, {"rg0": "a", "rg1": "b"})
    assert plan_step(q, "rg0").layout_conflict is not None and plan_step(q, "rg1").layout_conflict is not None


def test_groups_without_a_layout_are_not_compared() -> None:
    q = laid_out({"rg0": 3, "rg1": 3, "rg2": 3}, {"rg0": None, "rg1": "a", "rg2": "a"})
    assert all(plan_step(q, r).layout_conflict is None for r in ("rg0", "rg1", "rg2"))


# ---- heal claims (heal sources must agree on a checksum of their state) -------------------


def claimed(
    steps: dict[str, int],
    claims: dict[str, list[str] | None],
    failures: dict[str, int] | None = None,
    qid: int = 7,
) -> Quorum:
    members = tuple(
        QuorumMember(
            replica_id=rid,
            store_address=f"h{rid}:1",
            step=s,
            commit_failures=(failures or {}).get(rid, 0),
            data=READY if claims.get(rid) is None else {**READY, "claim": claims[rid]},
        )
        for rid, s in sorted(steps.items())
    )
    return Quorum(quorum_id=qid, participants=members, created=0.0)


def test_a_lone_dissenter_is_no_heal_source() -> None:
    """rg0 (the lowest rank: everyone's source and store host by step alone) claims other state
    than the two groups beside it at the top step: nobody heals from it."""
    q = claimed(
        {"rg0": 9, "rg1": 9, "rg2": 9, "rg3": 2, "rg4": 0},
        {"rg0": ["bad"], "rg1": ["good"], "rg2": ["good"], "rg3": ["old"]},
    )
    plans = {r: plan_step(q, r) for r in ("rg0", "rg1", "rg2", "rg3", "rg4")}
    assert plans["rg3"].recover_src_id == "rg1" and plans["rg4"].recover_src_id == "rg2"
    assert plans["rg3"].recover_claim == ("good",) and not plans["rg3"].contested
    assert plans["rg0"].recover_dst_ranks == () and plans["rg1"].recover_dst_ranks == (3,)
    assert {p.store_address for p in plans.values()} == {"hrg0:1"}  # still the lowest source's store
    assert all(p.untrusted_ids == ("rg0",) for p in plans.values())
    # It still steps with the others (it is up to date); it just serves nobody.
    assert plans["rg0"].participates and plans["rg0"].num_sources == 3 and not plans["rg0"].heal


def test_a_group_without_a_claim_is_no_source_while_others_claim() -> None:
    q = claimed({"a": 4, "b": 4, "c": 4, "d": 1}, {"b": ["x"]})
    assert plan_step(q, "d").recover_src_id == "b" and plan_step(q, "d").untrusted_ids == ("a", "c")
    # Nobody claims (older groups, or claims unreadable everywhere): every source is trusted, unchecked.
    q = claimed({"a": 4, "b": 4, "d": 1}, {})
    assert plan_step(q, "d").recover_src_id == "a" and plan_step(q, "d").recover_claim is None
    assert plan_step(q, "d").untrusted_ids == ()


def test_a_tie_trusts_every_claimant_and_checks_each_heal_against_its_own_source() -> None:
    """No majority can tell who is right (two groups that disagree; DiLoCo groups hold different
    local weights at a sync): every claimant serves, as before claims, each healer checked against
    its own source's claim; a source without a claim still serves nobody."""
    q = claimed({"a": 4, "b": 4, "n": 4, "c": 1, "d": 0}, {"a": ["x"], "b": ["y"], "c": ["z"]})
    c, d = plan_step(q, "c"), plan_step(q, "d")
    assert c.contested and (c.recover_src_id, c.recover_claim) == ("a", ("x",))
    assert (d.recover_src_id, d.recover_claim) == ("b", ("y",)) and d.untrusted_ids == ("n",)
    assert plan_step(q, "n").recover_dst_ranks == () and plan_step(q, "a").participates
    # Nobody behind: a tie changes nothing (no heal, same store host as before).
    q = claimed({"a": 4, "b": 4}, {"a": ["x"], "b": ["y"]})
    assert not plan_step(q, "a").heal and plan_step(q, "b").store_address == "ha:1"


def test_a_single_up_to_date_group_is_trusted_whatever_it_claims() -> None:
    q = claimed({"a": 4, "b": 1}, {"a": ["x"]})
    assert plan_step(q, "b").recover_src_id == "a" and plan_step(q, "b").recover_claim == ("x",)


def test_init_sync_at_step_zero_ignores_claims() -> None:
    q = claimed({"a": 0, "b": 0, "c": 0}, {"a": ["x"], "b": ["y"], "c": ["y"]})
    assert plan_step(q, "b").recover_src_id == "a" and not plan_step(q, "b").contested


def test_a_healer_whose_heal_failed_moves_to_the_next_agreeing_source() -> None:
    steps = {"a": 9, "b": 9, "c": 9, "h": 3}
    claims = {"a": ["s"], "b": ["s"], "c": ["s"]}
    assert plan_step(claimed(steps, claims), "h").recover_src_id == "a"
    assert plan_step(claimed(steps, claims, {"h": 1}), "h").recover_src_id == "b"
    moved = claimed(steps, claims, {"h": 2})
    assert plan_step(moved, "h").recover_src_id == "c" and plan_step(moved, "c").recover_dst_ranks == (3,)


@pytest.mark.parametrize("bad", [[], "s", [1], ["x" * 200], None])
def test_a_malformed_claim_is_no_claim(bad: object) -> None:
    q = Quorum(
        quorum_id=1,
        participants=(
            QuorumMember(replica_id="a", store_address="a:1", step=5, data={**READY, "claim": bad}),
            QuorumMember(replica_id="b", store_address="b:1", step=5, data=READY),
            QuorumMember(replica_id="c", store_address="c:1", step=5, data={**READY, "claim": ["s"]}),
            QuorumMember(replica_id="d", store_address="d:1", step=1, data=READY),
        ),
        created=0.0,
    )
    assert plan_step(q, "d").recover_src_id == "c" and plan_step(q, "d").untrusted_ids == ("a", "b")


def test_claims_are_wanted_only_when_someone_heals_and_every_member_claims_on_demand() -> None:
    on_demand = {"a": [], "b": [], "c": []}
    assert claims_wanted(claimed({"a": 5, "b": 5, "c": 3}, on_demand))  # c heals
    assert not claims_wanted(claimed({"a": 5, "b": 5, "c": 5}, on_demand))  # nobody heals
    assert claims_wanted(claimed({"a": 0, "b": 0, "c": 0}, on_demand))  # the start's primary copy
    assert not claims_wanted(claimed({"a": 0, "b": 0, "c": 0}, on_demand), init_sync=False)
    # One member that makes no empty claim (claims off, an older ftlaunch, a claim already made):
    # nobody asks again, whatever the others' settings.
    assert not claims_wanted(claimed({"a": 5, "b": 5, "c": 3}, {"a": [], "b": [], "c": None}))
    assert not claims_wanted(claimed({"a": 5, "b": 5, "c": 3}, {"a": ["x"], "b": [], "c": []}))
    assert not claims_wanted(claimed({"a": 5}, {"a": []}))  # alone: nobody to heal from


@given(st.dictionaries(st.sampled_from("abcde"), st.integers(0, 3), min_size=1), st.booleans())
def test_live_sources_want_claims_exactly_when_someone_heals_and_snapshots_never_do(
    steps: dict[str, int], init_sync: bool
) -> None:
    """Groups serving a live state claim on demand; a snapshot's claim rides on the first request."""
    q = claimed(steps, {r: [] for r in steps})
    heals = any(plan_step(q, r, init_sync=init_sync).heal for r in steps)
    assert claims_wanted(q, init_sync=init_sync) == heals
    assert not claims_wanted(claimed(steps, {r: ["s"] for r in steps}), init_sync=init_sync)
    unstaged = quorum(steps, data={r: {"claim": []} for r in steps})  # nothing to serve: nothing to claim
    assert not claims_wanted(unstaged, init_sync=init_sync)


# ---- snapshots: heals are served from the state the sources committed -----------------------------


def test_a_healer_waits_while_no_source_holds_a_snapshot_and_the_sources_step_on() -> None:
    """A healer that shows up in a quorum whose sources took no snapshot (nobody was behind at their
    boundary) waits that step: no source is assigned, it does not take part, the sources commit."""
    steps = {"a": 5, "b": 5, "h": 0}
    q = quorum(steps, data={"a": {}, "b": {}})
    h, a = plan_step(q, "h"), plan_step(q, "a")
    assert h.waits and not h.heal and h.deferred and h.num_healers == 1 and not h.participates
    assert a.deferred and not a.waits and a.participates and a.recover_dst_ranks == ()
    assert a.num_sources == 2 and a.num_up_to_date == 2
    # One source took its snapshot: it serves every healer; the other steps on without serving.
    q = quorum({**steps, "g": 1}, data={"a": {}})
    assert [plan_step(q, r).recover_src_id for r in ("g", "h")] == ["b", "b"]
    assert not plan_step(q, "a").deferred and plan_step(q, "a").untrusted_ids == ()


def test_a_healer_not_ready_to_heal_waits_while_a_ready_one_heals() -> None:
    """A healer whose forward pass already runs on its old state (it did not expect to be behind:
    a resumed SIGSTOP) says so, and waits; the next step it asks ready."""
    q = quorum({"a": 5, "x": 0, "y": 1}, data={"x": {"staged": True}})
    x, y = plan_step(q, "x"), plan_step(q, "y")
    assert x.waits and x.deferred and y.heal and y.recover_src_id == "a"
    assert plan_step(q, "a").recover_dst_ranks == (2,)


def plan_at(max_step: int, healers: int, deferred: bool = False, source: bool = True) -> StepPlan:
    """The last plan of a group (a source, unless ``source`` is False: then one of the healers)."""
    return StepPlan(quorum_id=1, replica_rank=0, replica_world_size=healers + 1, max_step=max_step,
                    num_sources=1, source_rank=0 if source else None, recover_src_rank=None,
                    recover_src_id=None,
                    recover_dst_ranks=(), store_address="a:1", num_healers=healers,
                    deferred=deferred)  # fmt: skip


def test_a_snapshot_is_taken_only_when_a_heal_is_due() -> None:
    # Nobody behind: no copy, no checksum (the per-step path pays nothing).
    assert not snapshot_due(8, plan_at(7, healers=0))
    # Someone waited in the last step (committed: 8 = 7 + 1): snapshot its end.
    assert snapshot_due(8, plan_at(7, healers=1, deferred=True))
    # The heal step committed: the healer holds the state, nothing more to serve.
    assert not snapshot_due(8, plan_at(7, healers=1))
    # It did not commit (still at 7): the healer retries, from any source.
    assert snapshot_due(7, plan_at(7, healers=1))
    # The start: the others wait one step for the primary, which snapshots the end of step 0.
    assert snapshot_due(1, plan_at(0, healers=2, deferred=True)) and not snapshot_due(0, None)
    # A process's first step copies nothing: mostly a restarted group's or a spare's, serving nobody.
    assert not snapshot_due(5, None)
    # A healer that waited at the start (at the primary's step 0, but a healer) serves nobody.
    assert not snapshot_due(0, plan_at(0, healers=1, deferred=True, source=False))
    # Behind itself (a healer, a restarted group): it serves nobody.
    assert not snapshot_due(0, plan_at(7, healers=1, deferred=True)) and not snapshot_due(
        3, plan_at(7, healers=1)
    )


def test_a_group_waits_for_its_quorum_before_its_forward_pass_only_when_it_may_heal() -> None:
    assert may_heal(0, None)  # its first step: it may be behind
    assert may_heal(3, plan_at(7, healers=1))  # it was behind
    assert may_heal(0, plan_at(0, healers=1, deferred=True, source=False))  # waited for the primary
    assert not may_heal(1, plan_at(0, healers=1, source=False))  # healed at the start, committed
    assert not may_heal(7, plan_at(7, healers=1)) and not may_heal(8, plan_at(7, healers=0))
