"""The pure quorum decision: one test per rule, plus property tests of its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlaunch.lighthouse.quorum import (
    ID_EPOCH_BASE_MS,
    Connection,
    GroupState,
    Health,
    LighthouseState,
    Quorum,
    QuorumIdAllocator,
    QuorumMember,
    QuorumOptions,
    decide_quorum,
    decode_quorum_id,
    encode_quorum_id,
    group_health,
    may_form,
)

NOW = 1000.0
OPTS = QuorumOptions(min_replicas=1, join_timeout=10.0, heartbeat_timeout=5.0)


def groups(
    *ids: str, last_seen: float = NOW, connection: Connection = Connection.CONNECTED
) -> dict[str, GroupState]:
    return {rid: GroupState(rid, last_seen, connection) for rid in ids}


def requests(*ids: str, **fields) -> dict[str, QuorumMember]:
    return {rid: QuorumMember(rid, **fields) for rid in ids}


def quorum(qid: int, *ids: str) -> Quorum:
    return Quorum(qid, tuple(QuorumMember(r) for r in sorted(ids)), created=0.0)


def state(g, r, *, round_start=NOW, prev=None, broken=False, next_id=100) -> LighthouseState:
    return LighthouseState(
        groups=g,
        requests=r,
        round_start=round_start,
        prev_quorum=prev,
        prev_quorum_broken=broken,
        next_quorum_id=next_id,
    )


def ids(decision) -> list[str]:
    return [m.replica_id for m in decision.participants]


# ---------------------------------------------------------------------------------- liveness


def test_health_live_silent_disconnected_failed():
    assert group_health(GroupState("a", NOW - 5.0), NOW, OPTS) is Health.LIVE  # boundary: still live
    assert group_health(GroupState("a", NOW - 5.01), NOW, OPTS) is Health.SILENT
    assert group_health(GroupState("a", NOW, Connection.DISCONNECTED), NOW, OPTS) is Health.DISCONNECTED
    assert group_health(GroupState("a", NOW, Connection.FAILED), NOW, OPTS) is Health.FAILED


def test_silent_group_neither_counts_nor_blocks():
    g = {**groups("a", "b"), **groups("c", last_seen=NOW - 6.0)}
    # c asked long ago but is silent: not a candidate; a+b asked: every live group asked.
    d = decide_quorum(state(g, requests("a", "b", "c")), NOW, OPTS)
    assert d.formed and ids(d) == ["a", "b"]


def test_disconnected_and_failed_groups_are_not_live():
    g = {
        **groups("a"),
        **groups("b", connection=Connection.DISCONNECTED),
        **groups("c", connection=Connection.FAILED),
    }
    d = decide_quorum(state(g, requests("a", "b", "c")), NOW, OPTS)
    assert d.formed and ids(d) == ["a"]


def test_request_without_known_group_is_ignored():
    d = decide_quorum(state(groups("a"), requests("a", "ghost")), NOW, OPTS)
    assert ids(d) == ["a"]


# ---------------------------------------------------------------------------------- min_replicas


def test_min_replicas_waits_then_forms():
    opts = QuorumOptions(min_replicas=3, join_timeout=0.0, heartbeat_timeout=5.0)
    d = decide_quorum(state(groups("a", "b"), requests("a", "b")), NOW, opts)
    assert not d.formed and "min_replicas" in d.reason
    d = decide_quorum(state(groups("a", "b", "c"), requests("a", "b", "c")), NOW, opts)
    assert d.formed and ids(d) == ["a", "b", "c"]


def test_min_replicas_applies_to_fast_quorum_too():
    opts = QuorumOptions(min_replicas=2, join_timeout=10.0, heartbeat_timeout=5.0)
    d = decide_quorum(state(groups("a"), requests("a"), prev=quorum(7, "a")), NOW, opts)
    assert not d.formed and "min_replicas" in d.reason


# ---------------------------------------------------------------------------------- join timeout


def test_join_timeout_waits_for_stragglers_then_forms_with_those_present():
    g = groups("a", "b", "c")
    r = requests("a", "b")
    d = decide_quorum(
        state(g, r, round_start=NOW), NOW + 9.9, QuorumOptions(join_timeout=10.0, heartbeat_timeout=60.0)
    )
    assert not d.formed and "straggler" in d.reason
    assert d.wake_at == pytest.approx(NOW + 10.0)
    d = decide_quorum(
        state(g, r, round_start=NOW), NOW + 10.0, QuorumOptions(join_timeout=10.0, heartbeat_timeout=60.0)
    )
    assert d.formed and ids(d) == ["a", "b"] and "join timeout" in d.reason


def test_wake_at_is_the_next_heartbeat_expiry_if_sooner():
    g = {**groups("a", "b"), **groups("c", last_seen=NOW - 4.0)}
    d = decide_quorum(state(g, requests("a", "b"), round_start=NOW), NOW, OPTS)
    assert not d.formed and d.wake_at == pytest.approx(NOW + 1.0)  # c expires before the join timeout


def test_every_live_group_asked_forms_at_once():
    d = decide_quorum(state(groups("a", "b", "c"), requests("a", "b", "c")), NOW, OPTS)
    assert d.formed and "every live group asked" in d.reason


# ---------------------------------------------------------------------------------- split brain


def test_split_brain_needs_more_than_half_of_live_groups():
    g = groups("a", "b", "c", "d")
    opts = QuorumOptions(join_timeout=0.0, heartbeat_timeout=5.0)
    d = decide_quorum(state(g, requests("a", "b")), NOW, opts)  # exactly half: not enough
    assert not d.formed and "split brain" in d.reason
    d = decide_quorum(state(g, requests("a", "b", "c")), NOW, opts)
    assert d.formed and ids(d) == ["a", "b", "c"]


def test_split_brain_guard_also_blocks_fast_quorum():
    # Previous quorum {a} but b, c are live: {a} alone would allow a disjoint {b, c}.
    d = decide_quorum(state(groups("a", "b", "c"), requests("a"), prev=quorum(5, "a")), NOW, OPTS)
    assert not d.formed and "split brain" in d.reason


# ---------------------------------------------------------------------------------- fast quorum


def test_fast_quorum_forms_without_waiting_for_a_new_live_group():
    g = groups("a", "b", "c")  # c is live (heartbeating) but has not asked
    d = decide_quorum(state(g, requests("a", "b"), prev=quorum(5, "a", "b")), NOW, OPTS)
    assert d.formed and ids(d) == ["a", "b"] and "fast quorum" in d.reason
    assert d.quorum_id == 5 and not d.new_id


def test_fast_quorum_includes_new_requesters():
    g = groups("a", "b", "c")
    d = decide_quorum(state(g, requests("a", "b", "c"), prev=quorum(5, "a", "b")), NOW, OPTS)
    assert ids(d) == ["a", "b", "c"] and d.new_id and d.quorum_id == 100


def test_no_fast_quorum_when_a_previous_member_is_missing():
    g = groups("a", "b", "c")
    d = decide_quorum(state(g, requests("a", "b"), prev=quorum(5, "a", "b", "c")), NOW, OPTS)
    assert not d.formed and "straggler" in d.reason


# ---------------------------------------------------------------------------------- shrink_only


def test_shrink_only_excludes_groups_outside_the_previous_quorum():
    g = groups("a", "b", "c")
    r = {**requests("a", shrink_only=True), **requests("b", "c")}
    d = decide_quorum(state(g, r, prev=quorum(5, "a", "b")), NOW, OPTS)
    assert d.formed and ids(d) == ["a", "b"] and d.quorum_id == 5


def test_shrink_only_without_previous_quorum_changes_nothing():
    d = decide_quorum(state(groups("a", "b"), requests("a", "b", shrink_only=True)), NOW, OPTS)
    assert ids(d) == ["a", "b"]


def test_shrink_only_result_still_needs_a_majority():
    g = groups("a", "b", "c", "d", "e")
    r = {**requests("a", shrink_only=True), **requests("b", "c", "d")}
    d = decide_quorum(state(g, r, prev=quorum(5, "a", "b")), NOW, OPTS)
    assert not d.formed and "split brain" in d.reason  # 2 of 5 live


# ---------------------------------------------------------------------------------- quorum id


def test_first_quorum_gets_new_id():
    d = decide_quorum(state(groups("a"), requests("a"), next_id=42), NOW, OPTS)
    assert d.new_id and d.quorum_id == 42


def test_same_members_keep_the_id():
    d = decide_quorum(state(groups("a", "b"), requests("a", "b"), prev=quorum(5, "a", "b")), NOW, OPTS)
    assert not d.new_id and d.quorum_id == 5


def test_membership_change_gets_new_id():
    g = groups("a", "b")
    d = decide_quorum(state(g, requests("a", "b"), prev=quorum(5, "a", "b", "c")), NOW, OPTS)
    assert d.formed and d.new_id and d.quorum_id == 100 and "membership changed" in d.reason


def test_commit_failures_get_new_id():
    r = {**requests("a"), **requests("b", commit_failures=1)}
    d = decide_quorum(state(groups("a", "b"), r, prev=quorum(5, "a", "b")), NOW, OPTS)
    assert d.new_id and d.quorum_id == 100 and "commit failures" in d.reason


def test_member_that_lost_liveness_gets_new_id_even_with_same_members():
    d = decide_quorum(
        state(groups("a", "b"), requests("a", "b"), prev=quorum(5, "a", "b"), broken=True), NOW, OPTS
    )
    assert d.new_id and d.quorum_id == 100


def test_participants_sorted_and_carry_request_fields():
    r = {"b": QuorumMember("b", step=7, address="x"), "a": QuorumMember("a", step=3)}
    d = decide_quorum(state(groups("a", "b"), r), NOW, OPTS)
    q = d.to_quorum(created=1.5)
    assert q.replica_ids == ("a", "b") and q.member("b").step == 7 and q.member("b").address == "x"


def test_no_requests_no_quorum():
    d = decide_quorum(state(groups("a"), {}), NOW, OPTS)
    assert not d.formed


# ---------------------------------------------------------------------------------- may_form (server fast
# path)


def test_may_form_mirrors_each_forming_rule():
    g = groups("a", "b", "c")
    # fast quorum possible although c is live and has not asked
    assert may_form(state(g, requests("a", "b"), prev=quorum(5, "a", "b")), NOW, OPTS)
    # c live and not asked, no fast quorum, join timeout running: cannot form
    assert not may_form(state(g, requests("a", "b"), round_start=NOW), NOW, OPTS)
    # ... until the join timeout passes
    assert may_form(state(g, requests("a", "b"), round_start=NOW - 10.0), NOW, OPTS)
    # every live group asked (c is silent)
    g2 = {**groups("a", "b"), **groups("c", last_seen=NOW - 6.0)}
    assert may_form(state(g2, requests("a", "b")), NOW, OPTS)
    # fewer requests than min_replicas
    assert not may_form(state(g, requests("a")), NOW, QuorumOptions(min_replicas=2))


# ---------------------------------------------------------------------------------- id encoding


def test_id_allocator_increases_and_encodes_epoch():
    alloc = QuorumIdAllocator(ID_EPOCH_BASE_MS + 5)
    a, b = alloc.take(), alloc.take()
    assert b == a + 1 and decode_quorum_id(a) == (5, 0) and decode_quorum_id(b) == (5, 1)


def test_id_allocator_counter_overflow_advances_epoch():
    alloc = QuorumIdAllocator(ID_EPOCH_BASE_MS + 5)
    taken = [alloc.take() for _ in range(5000)]
    assert taken == sorted(set(taken))
    assert decode_quorum_id(taken[-1])[0] == 6


def test_id_allocator_respects_floor():
    alloc = QuorumIdAllocator(ID_EPOCH_BASE_MS + 5, floor=encode_quorum_id(9, 3))
    assert alloc.take() > encode_quorum_id(9, 3)


def test_ids_stay_exact_in_json_doubles_until_2089():
    alloc = QuorumIdAllocator(ID_EPOCH_BASE_MS + 69 * 365 * 24 * 3600 * 1000)
    assert alloc.take() < 2**53


# ---------------------------------------------------------------------------------- (de)serialization


def test_member_json_round_trip_and_strictness():
    m = QuorumMember(
        "r0", address="h:1", store_address="h:2", step=3, world_size=2, commit_failures=1, data={"k": [1]}
    )
    assert QuorumMember.from_json(m.to_json()) == m
    with pytest.raises(ValueError, match="unknown"):
        QuorumMember.from_json({"replica_id": "a", "bogus": 1})
    with pytest.raises(ValueError, match="step"):
        QuorumMember.from_json({"replica_id": "a", "step": "3"})
    with pytest.raises(ValueError, match="step"):
        QuorumMember.from_json({"replica_id": "a", "step": True})
    with pytest.raises(ValueError, match="replica_id"):
        QuorumMember.from_json({"step": 1})
    with pytest.raises(ValueError):
        QuorumMember.from_json({"replica_id": ""})
    with pytest.raises(ValueError):
        QuorumMember.from_json(["replica_id"])


def test_quorum_json_round_trip_and_strictness():
    q = quorum(12, "b", "a")
    assert Quorum.from_json(q.to_json()) == q
    with pytest.raises(ValueError):
        Quorum.from_json({**q.to_json(), "extra": 1})
    with pytest.raises(ValueError):
        Quorum.from_json({**q.to_json(), "participants": [{"replica_id": "b"}, {"replica_id": "a"}]})


def test_options_validation():
    with pytest.raises(ValueError):
        QuorumOptions(min_replicas=0)
    with pytest.raises(ValueError):
        QuorumOptions(heartbeat_timeout=0)
    with pytest.raises(ValueError):
        QuorumOptions(join_timeout=-1)
    with pytest.raises(TypeError):
        QuorumOptions(min_replicas=True)


# ---------------------------------------------------------------------------------- properties

NAMES = [f"g{i}" for i in range(8)]


@st.composite
def scenarios(draw):
    """A random lighthouse state: known groups with random liveness, random requests, maybe a prev quorum."""
    known = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=8))
    g = {}
    for rid in known:
        age = draw(st.sampled_from([0.0, 0.0, 1.0, 4.9, 5.1, 30.0]))  # mostly live
        conn = draw(
            st.sampled_from([Connection.CONNECTED] * 4 + [Connection.DISCONNECTED, Connection.FAILED])
        )
        g[rid] = GroupState(rid, NOW - age, conn)
    # Mostly known groups ask (and then usually not all of them), sometimes anyone.
    ask_pool = known if known and draw(st.integers(0, 3)) else NAMES
    askers = draw(st.lists(st.sampled_from(ask_pool), unique=True, max_size=8))
    r = {
        rid: QuorumMember(
            rid, shrink_only=draw(st.booleans()), commit_failures=draw(st.sampled_from([0, 0, 1]))
        )
        for rid in askers
    }
    # Often a previous quorum whose members all asked again (the fast-quorum case).
    pool = askers if askers and draw(st.booleans()) else NAMES
    prev_ids = draw(st.lists(st.sampled_from(pool), unique=True, max_size=8))
    prev = quorum(draw(st.integers(1, 50)), *prev_ids) if prev_ids else None
    opts = QuorumOptions(
        min_replicas=draw(st.integers(1, 4)),
        join_timeout=draw(st.sampled_from([0.0, 3.0, 100.0])),
        heartbeat_timeout=5.0,
    )
    round_start = NOW - draw(st.sampled_from([0.0, 2.0, 200.0]))
    s = LighthouseState(g, r, round_start, prev, draw(st.booleans()), next_quorum_id=1000)
    return s, opts


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_property_never_below_min_replicas_and_only_live_requesters(scenario):
    s, opts = scenario
    d = decide_quorum(s, NOW, opts)
    if d.formed:
        live = {rid for rid, g in s.groups.items() if group_health(g, NOW, opts) is Health.LIVE}
        assert len(d.participants) >= opts.min_replicas
        assert set(ids(d)) <= live & set(s.requests)
        assert 2 * len(d.participants) > len(live)


@settings(max_examples=400, deadline=None)
@given(scenarios(), st.data())
def test_property_no_two_disjoint_quorums_from_the_same_live_set(scenario, data):
    s, opts = scenario
    # A second, independent set of requests (a partition of the job seeing the same live set),
    # drawn mostly from the groups the first one did not pick.
    first_askers = sorted(s.requests)
    rest = [n for n in NAMES if n not in first_askers]
    other = data.draw(st.lists(st.sampled_from(rest), unique=True, max_size=8)) if rest else []
    other += data.draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=2))
    other = list(dict.fromkeys(other))
    prev2_ids = data.draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=8))
    s2 = LighthouseState(
        s.groups,
        {rid: QuorumMember(rid) for rid in other},
        s.round_start,
        quorum(3, *prev2_ids) if prev2_ids else None,
        False,
        next_quorum_id=2000,
    )
    d1, d2 = decide_quorum(s, NOW, opts), decide_quorum(s2, NOW, opts)
    if d1.formed and d2.formed:
        assert set(ids(d1)) & set(ids(d2)), "two disjoint quorums from one live set: split brain"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.sampled_from(NAMES[:5]), unique=True, min_size=1), st.booleans()), max_size=30
    )
)
def test_property_ids_strictly_increase_and_repeat_only_for_same_members(rounds):
    """Drive decide_quorum round after round as the server does; ids never go back."""
    alloc = QuorumIdAllocator(ID_EPOCH_BASE_MS + 1000)
    prev: Quorum | None = None
    seen: list[int] = []
    for members, failed in rounds:
        s = LighthouseState(
            groups(*members),
            {rid: QuorumMember(rid, commit_failures=int(failed)) for rid in members},
            NOW,
            prev,
            False,
            next_quorum_id=alloc.peek(),
        )
        d = decide_quorum(s, NOW, QuorumOptions(join_timeout=0.0))
        assert d.formed
        if d.new_id:
            assert alloc.take() == d.quorum_id
        q = d.to_quorum(created=0.0)
        if seen:
            assert q.quorum_id >= seen[-1]
            if q.quorum_id == seen[-1]:
                assert prev is not None and q.replica_ids == prev.replica_ids and not failed
            else:
                assert q.quorum_id not in seen
        seen.append(q.quorum_id)
        prev = q


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 20), st.integers(0, 5000), st.integers(1, 10**4))
def test_property_ids_increase_across_restarts(start_ms, run_ms, changes, downtime_ms):
    """A lighthouse restarted later (wall clock) hands out larger ids than its predecessor ever did.

    Model: the predecessor ran ``run_ms`` ms and formed at most 4096 new quorums per ms of that
    (far beyond any real rate); the restart happens at least 1 ms after it stopped.
    """
    changes = min(changes, run_ms * 4096)
    first = QuorumIdAllocator(ID_EPOCH_BASE_MS + start_ms)
    last = first.take()
    for _ in range(changes):
        nxt = first.take()
        assert nxt > last
        last = nxt
    restarted = QuorumIdAllocator(ID_EPOCH_BASE_MS + start_ms + run_ms + downtime_ms)
    assert restarted.take() > last


@settings(max_examples=600, deadline=None)
@given(scenarios())
def test_property_may_form_is_a_necessary_condition(scenario):
    """The server skips the full decision when may_form is False: that must never lose a quorum."""
    s, opts = scenario
    if decide_quorum(s, NOW, opts).formed:
        assert may_form(s, NOW, opts)


# -- rule 5: the first quorum waits for the groups the launcher announced

ANNOUNCED = QuorumOptions(min_replicas=1, join_timeout=10.0, heartbeat_timeout=5.0, expected_replicas=2)


def test_first_quorum_waits_for_the_announced_groups():
    # One group started first: alone it is "every live group", but two were announced.
    d = decide_quorum(state(groups("a"), requests("a")), NOW + 1, ANNOUNCED)
    assert not d.formed and "announced" in d.reason and d.wake_at == NOW + 5.0  # its heartbeat expiry first
    assert decide_quorum(state(groups("a"), requests("a")), NOW + 1, OPTS).formed  # unannounced: at once
    both = decide_quorum(state(groups("a", "b"), requests("a", "b")), NOW + 1, ANNOUNCED)
    assert both.formed and ids(both) == ["a", "b"]


def test_first_quorum_forms_without_the_missing_group_after_the_join_timeout():
    d = decide_quorum(state(groups("a", last_seen=NOW + 9), requests("a")), NOW + 10, ANNOUNCED)
    assert d.formed and ids(d) == ["a"]


def test_announced_groups_do_not_matter_after_the_first_quorum():
    # min_replicas keeps its meaning: a survivor of a 2-group job forms alone at once.
    d = decide_quorum(
        state(groups("a"), requests("a"), prev=quorum(7, "a", "b"), broken=True), NOW + 1, ANNOUNCED
    )
    assert d.formed and ids(d) == ["a"]


def test_expected_replicas_is_validated():
    with pytest.raises(ValueError):
        QuorumOptions(expected_replicas=-1)
    with pytest.raises(TypeError):
        QuorumOptions(expected_replicas=True)


# -- rule 6: when no live group holds the state, the previous quorum's members are waited for


def at(qid: int, steps: dict[str, int]) -> Quorum:
    """A previous quorum whose members asked at ``steps``."""
    return Quorum(qid, tuple(QuorumMember(r, step=steps[r]) for r in sorted(steps)), created=0.0)


WHOLE = QuorumOptions(min_replicas=1, join_timeout=10.0, heartbeat_timeout=5.0)


def test_every_group_lost_the_first_back_waits_for_the_others():
    # Both groups of quorum 7 (step 13) died; a's agent restarted it from the checkpoint of step 10;
    # b is still down (its old process disconnected). Alone, a is "every live group".
    g = {**groups("a"), **groups("b", connection=Connection.DISCONNECTED)}
    prev = at(7, {"a": 13, "b": 13})
    d = decide_quorum(state(g, requests("a", step=10), prev=prev, broken=True), NOW + 1, WHOLE)
    assert not d.formed and "come back" in d.reason and "step 13" in d.reason and "(b)" in d.reason
    assert d.wake_at == NOW + 5.0  # a's heartbeat expiry comes before the join timeout
    # From scratch (no checkpoint) it is the same: step 0 is behind too.
    assert not decide_quorum(state(g, requests("a", step=0), prev=prev), NOW + 1, WHOLE).formed
    # b is back and asks (it heals from a or loads the same checkpoint): both form at once.
    both = decide_quorum(
        state(groups("a", "b"), {**requests("a", step=10), **requests("b", step=0)}, prev=prev, broken=True),
        NOW + 2, WHOLE,
    )  # fmt: skip
    assert both.formed and ids(both) == ["a", "b"] and "fast quorum" in both.reason


def test_every_group_lost_forms_without_the_missing_after_the_join_timeout():
    g = {**groups("a", last_seen=NOW + 9), **groups("b", connection=Connection.FAILED)}
    d = decide_quorum(state(g, requests("a", step=10), prev=at(7, {"a": 13, "b": 13})), NOW + 10, WHOLE)
    assert d.formed and ids(d) == ["a"]
    early = decide_quorum(state(g, requests("a", step=10), prev=at(7, {"a": 13, "b": 13})), NOW + 9.9, WHOLE)
    assert not early.formed and early.wake_at == NOW + 10


def test_a_survivor_at_the_reached_step_never_waits():
    # b died; a survived at the step of the previous quorum (or one past it): the job goes on from
    # a at once, whether b is down or already restarted and asking from behind.
    prev = at(7, {"a": 13, "b": 13})
    down = {**groups("a"), **groups("b", connection=Connection.DISCONNECTED)}
    for step in (13, 14):
        d = decide_quorum(state(down, requests("a", step=step), prev=prev, broken=True), NOW, WHOLE)
        assert d.formed and ids(d) == ["a"]
    r = {**requests("a", step=14), **requests("b", step=0)}
    d = decide_quorum(state(groups("a", "b"), r, prev=prev, broken=True), NOW, WHOLE)
    assert d.formed and ids(d) == ["a", "b"]
    # Three groups, c died: a and b hold the state and form without it.
    prev3 = at(8, {"a": 20, "b": 20, "c": 20})
    g3 = {**groups("a", "b"), **groups("c", connection=Connection.DISCONNECTED)}
    d = decide_quorum(state(g3, requests("a", "b", step=21), prev=prev3, broken=True), NOW, WHOLE)
    assert d.formed and ids(d) == ["a", "b"]


def test_the_group_that_healed_waits_when_its_only_source_died_mid_heal():
    # b restarted (step 0) and was in quorum 9 to heal from a (step 30); a died before b had the state.
    g = {**groups("b"), **groups("a", connection=Connection.DISCONNECTED)}
    d = decide_quorum(state(g, requests("b", step=0), prev=at(9, {"a": 30, "b": 0})), NOW, WHOLE)
    assert not d.formed and "(a)" in d.reason


def test_a_member_no_longer_known_is_not_waited_for():
    # b left, or its slot went to a hot spare (the lighthouse forgot it): nobody restarts it.
    d = decide_quorum(state(groups("a"), requests("a", step=10), prev=at(7, {"a": 13, "b": 13})), NOW, WHOLE)
    assert d.formed and ids(d) == ["a"]


def test_an_adopted_quorum_does_not_make_groups_wait():
    # A restarted lighthouse adopts the reported quorum without steps (0): nobody is behind it.
    g = {**groups("a"), **groups("b", connection=Connection.DISCONNECTED)}
    d = decide_quorum(state(g, requests("a", step=10), prev=quorum(7, "a", "b"), broken=True), NOW, WHOLE)
    assert d.formed and ids(d) == ["a"]
