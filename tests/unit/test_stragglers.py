"""The straggler rule as pure functions (lighthouse/stragglers.py): property tests of what it may and
must declare over generated compute times, and what `StragglerWatch` remembers. The membership
applying it, step by step with a hand-driven clock: tests/unit/test_stragglers_membership.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlaunch.lighthouse.stragglers import (
    REPLACEMENT_TIMEOUT,
    Standing,
    StragglerRule,
    StragglerWatch,
    judge,
    to_replace,
)

RULE = StragglerRule()
#: A job's groups differ by nature at most this much (well under the rule's `leave`).
SPREAD = 1.15

groups = st.integers(min_value=2, max_value=8)
bases = st.floats(min_value=0.01, max_value=2.0)
jitter = st.floats(min_value=1.0, max_value=SPREAD)


def ids(n: int) -> list[str]:
    return [f"rg{i}" for i in range(n)]


@st.composite
def job(draw: st.DrawFn) -> tuple[dict[str, list[float]], float]:
    """Each group's compute times (one base per job, each sample within `SPREAD` of it), and the base."""
    n = draw(groups)
    base = draw(bases)
    count = draw(st.integers(min_value=RULE.min_steps, max_value=3 * RULE.window))
    windows = {rid: [base * draw(jitter) for _ in range(count)] for rid in ids(n)}
    return windows, base


def counts(windows: dict[str, list[float]]) -> dict[str, int]:
    return {rid: len(w) for rid, w in windows.items()}


@st.composite
def previous(draw: st.DrawFn, rids: list[str]) -> dict[str, Standing]:
    """Any earlier verdicts (stragglers or not)."""
    out = {}
    for rid in rids:
        if draw(st.booleans()):
            out[rid] = Standing(rid, 2.0, 0.1, 0.05, 10, True, 0)
    return out


@settings(max_examples=200, deadline=None)
@given(data=st.data(), scale=st.floats(min_value=0.01, max_value=100.0))
def test_a_uniformly_slow_job_has_no_straggler(data: st.DataObject, scale: float) -> None:
    """Everybody slowed alike (a slower model, a loaded cluster): no straggler, whatever was before
    (an earlier straggler is one no more once it stayed calm for `calm_steps` steps)."""
    windows, _ = data.draw(job())
    slowed = {rid: [v * scale for v in w] for rid, w in windows.items()}
    before = data.draw(previous(list(windows)))
    verdicts = judge(slowed, counts(slowed), before, RULE)
    assert set(verdicts) == set(windows)
    assert [rid for rid, s in verdicts.items() if s.straggler] == [r for r in verdicts if r in before], (
        verdicts
    )
    assert all(s.slowdown <= SPREAD * 1.0001 for s in verdicts.values())
    later = judge(slowed, {rid: n + RULE.calm_steps for rid, n in counts(slowed).items()}, verdicts, RULE)
    assert not any(s.straggler for s in later.values()), later


@settings(max_examples=200, deadline=None)
@given(data=st.data(), k=st.floats(min_value=2.0, max_value=50.0))
def test_a_group_k_times_slower_for_a_window_is_flagged(data: st.DataObject, k: float) -> None:
    """A group whose last `window` steps took k x (k >= 2) its usual time, among groups that did not
    change, is a straggler with a slowdown near k; nobody else is."""
    windows, base = data.draw(job())
    slow = data.draw(st.sampled_from(sorted(windows)))
    tail = [base * data.draw(jitter) * k for _ in range(RULE.window)]
    windows[slow] = windows[slow] + tail  # what it did before counts no more
    verdicts = judge(windows, counts(windows), {}, RULE, NOW)
    assert verdicts[slow].straggler, verdicts[slow]
    assert verdicts[slow].since_time == NOW
    assert k / SPREAD <= verdicts[slow].slowdown * 1.0001 and verdicts[slow].slowdown <= k * SPREAD * 1.0001
    assert [rid for rid, s in verdicts.items() if s.straggler] == [slow]
    assert verdicts[slow].since == len(windows[slow])


@settings(max_examples=200, deadline=None)
@given(
    n=groups,
    base=bases,
    ratios=st.lists(
        st.floats(min_value=RULE.leave * 1.001, max_value=RULE.enter * 0.999), min_size=1, max_size=20
    ),
    start=st.booleans(),
)
def test_hysteresis_between_leave_and_enter_nothing_flips(
    n: int, base: float, ratios: list[float], start: bool
) -> None:
    """A group whose slowdown moves about between `leave` and `enter` keeps its verdict, straggler or
    not, however often it is judged: no flapping."""
    rids = ids(n)
    target = rids[-1]
    before: dict[str, Standing] = (
        {target: Standing(target, 1.6, base * 1.6, base, 20, True, 3, NOW)} if start else {}
    )
    steps = 20
    for ratio in ratios:
        steps += 1
        windows = {rid: [base] * RULE.window for rid in rids}
        windows[target] = [base * ratio] * RULE.window
        counts_now = {rid: steps for rid in rids}
        verdicts = judge(windows, counts_now, before, RULE, NOW + steps)
        assert verdicts[target].straggler is start, (ratio, verdicts[target])
        if start:  # a straggler since then, not since each verdict
            assert (verdicts[target].since, verdicts[target].since_time) == (3, NOW)
        before = verdicts


def test_it_takes_enter_to_become_one_and_leave_to_stop() -> None:
    rids = ids(3)
    windows = {rid: [0.1] * RULE.window for rid in rids}
    windows["rg2"] = [0.1 * RULE.enter] * RULE.window
    first = judge(windows, counts(windows), {}, RULE)
    assert first["rg2"].straggler and first["rg2"].slowdown == pytest.approx(RULE.enter)
    windows["rg2"] = [0.1 * RULE.leave] * RULE.window
    second = judge(windows, counts(windows), first, RULE)
    assert second["rg2"].straggler and second["rg2"].calm_since == RULE.window  # calm from here...
    calm = {rid: RULE.window + RULE.calm_steps for rid in rids}
    third = judge(windows, calm, second, RULE)
    assert not third["rg2"].straggler and third["rg2"].since is None  # ... for `calm_steps` steps


def test_a_straggler_that_looks_fast_for_a_moment_stays_one() -> None:
    """Its window looks fast for fewer than `calm_steps` steps (its peers slowed by a burst of load),
    then slow again: it stayed a straggler throughout, since the step it became one -- the persistence
    that ``replace`` waits for runs on."""
    rids = ids(3)
    windows = {rid: [0.1] * RULE.window for rid in rids}
    windows["rg2"] = [0.2] * RULE.window
    verdict = judge(windows, counts(windows), {}, RULE, NOW)
    assert verdict["rg2"].straggler and verdict["rg2"].since == RULE.window
    n = RULE.window
    for step in range(RULE.calm_steps - 1):  # the others as slow as it for a while
        n += 1
        looks = {rid: [0.19] * RULE.window for rid in rids[:2]} | {"rg2": [0.2] * RULE.window}
        verdict = judge(looks, dict.fromkeys(rids, n), verdict, RULE, NOW + step)
        assert verdict["rg2"].straggler and verdict["rg2"].calm_since == RULE.window + 1
    n += 1
    verdict = judge(windows, dict.fromkeys(rids, n), verdict, RULE, NOW + 60)
    assert verdict["rg2"].straggler and verdict["rg2"].calm_since is None
    assert (verdict["rg2"].since, verdict["rg2"].since_time) == (RULE.window, NOW)
    assert verdict["rg2"].persistent(RULE, NOW + 60) == (n - RULE.window >= RULE.persist)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), short=st.integers(min_value=0, max_value=RULE.min_steps - 1), k=st.floats(2.0, 100.0))
def test_no_verdict_before_min_steps(data: st.DataObject, short: int, k: float) -> None:
    """A group with fewer than `min_steps` committed steps (just joined, just restarted) gets no
    verdict however slow; and with fewer than two groups to compare, nobody does."""
    windows, base = data.draw(job())
    newcomer = "new"
    windows[newcomer] = [base * k] * short
    verdicts = judge(windows, counts(windows), {}, RULE)
    assert newcomer not in verdicts and not any(s.straggler for s in verdicts.values())
    alone = {"rg0": [base] * RULE.window, newcomer: [base * k] * short}
    assert judge(alone, counts(alone), {}, RULE) == {}


def test_two_groups_the_slow_one_is_compared_with_the_other() -> None:
    """With two groups the median of both would halve a slowdown: each is compared with the other."""
    windows = {"rg0": [0.05] * 20, "rg1": [0.10] * 20}
    verdicts = judge(windows, counts(windows), {}, RULE)
    assert verdicts["rg1"].straggler and verdicts["rg1"].slowdown == pytest.approx(2.0)
    assert not verdicts["rg0"].straggler and verdicts["rg0"].slowdown == pytest.approx(0.5)


def test_a_wide_natural_spread_needs_more_and_milliseconds_are_noise() -> None:
    """1.6x the others' median is not enough when the others themselves differ that much (robust
    deviations), nor when the whole difference is under `min_excess` seconds."""
    spread = {"a": [1.0] * 20, "b": [0.6] * 20, "c": [1.4] * 20, "d": [0.8] * 20, "e": [1.6] * 20}
    assert not judge(spread, counts(spread), {}, RULE)["e"].straggler  # 1.6 / 0.9: within the spread
    tiny = {"a": [0.001] * 20, "b": [0.001] * 20, "c": [0.004] * 20}
    verdicts = judge(tiny, counts(tiny), {}, RULE)
    assert verdicts["c"].slowdown == pytest.approx(4.0) and not verdicts["c"].straggler


def test_one_slow_step_is_not_a_straggler() -> None:
    """A checkpoint, a collection: a few slow steps in a window move its median nothing."""
    windows = {rid: [0.05] * 20 for rid in ids(3)}
    windows["rg1"][-5:] = [5.0] * 5
    assert not judge(windows, counts(windows), {}, RULE)["rg1"].straggler


NOW = 1000.0


def standing(rid: str, slowdown: float, steps: int, since: int | None, since_time: float = 0.0) -> Standing:
    return Standing(
        rid,
        slowdown,
        0.1 * slowdown,
        0.1,
        steps,
        since is not None,
        since,
        since_time if since is not None else None,
    )


def test_to_replace_only_a_persistent_live_straggler_one_at_a_time_above_min_replicas() -> None:
    persist = RULE.persist
    long_ago = NOW - RULE.persist_seconds
    s = {
        "rg0": standing("rg0", 1.0, 50, None),
        "rg1": standing("rg1", 2.0, 50, 50 - persist, long_ago),
        "rg2": standing("rg2", 3.0, 50, 50 - persist + 1, long_ago),  # slower, but not for enough steps
        "rg3": standing("rg3", 4.0, 90, 10, NOW - 1.0),  # slower, but for a second only: a burst
    }
    live = ["rg0", "rg1", "rg2", "rg3"]
    chosen = to_replace(s, live, 1, False, RULE, NOW)
    assert chosen is not None and chosen.replica_id == "rg1"
    assert to_replace(s, live, 1, True, RULE, NOW) is None  # one in flight
    assert to_replace(s, live, 4, False, RULE, NOW) is None  # would leave 3 < --min-replicas 4
    assert to_replace(s, ["rg0", "rg2", "rg3"], 1, False, RULE, NOW) is None  # rg1 is not a live member now
    s["rg2"] = standing("rg2", 3.0, 51, 50 - persist + 1, long_ago)
    chosen = to_replace(s, live, 1, False, RULE, NOW)
    assert chosen is not None and chosen.replica_id == "rg2"  # the slowest persistent one first
    chosen = to_replace(s, live, 1, False, RULE, NOW + RULE.persist_seconds)
    assert chosen is not None and chosen.replica_id == "rg3"  # its burst lasted: now it counts
    assert to_replace({"rg0": standing("rg0", 1.0, 50, None)}, live, 1, False, RULE, NOW) is None


def test_the_rule_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="leave < enter"):
        StragglerRule(enter=1.2, leave=1.5)
    with pytest.raises(ValueError, match="min_steps"):
        StragglerRule(window=5, min_steps=6)
    with pytest.raises(ValueError, match="policy"):
        StragglerWatch("evict")


def feed(watch: StragglerWatch, rid: str, session: str, computes: list[float], start: int = 0) -> None:
    for i, c in enumerate(computes, start=start + 1):
        watch.report(rid, session, i, c, wall=float(i))


def test_watch_windows_are_per_process_and_reports_count_once() -> None:
    w = StragglerWatch()
    feed(w, "rg0", "s0", [0.1] * 15)
    feed(w, "rg1", "s1", [0.3] * 15)
    w.report("rg1", "s1", 15, 0.3, wall=16.0)  # a heartbeat repeating the last report: not a step
    became, cleared = w.judge(["rg0", "rg1"], {"rg0", "rg1"}, now=0.0, wall=100.0)
    assert [s.replica_id for s in became] == ["rg1"] and not cleared
    assert w.standings["rg1"].steps == 15 and w.flagged_at("rg1") == 100.0
    feed(w, "rg1", "s1-restarted", [0.1] * 3)  # its process restarted: what the old one measured is gone
    assert not w.due(0.1)  # a verdict at most every JUDGE_EVERY
    became, cleared = w.judge(["rg0", "rg1"], {"rg0", "rg1"}, now=1.0, wall=101.0)
    assert "rg1" not in w.standings and w.flagged_at("rg1") is None
    w.judge(["rg0"], {"rg0"}, now=2.0, wall=102.0)  # rg1 is forgotten with the group
    feed(w, "rg1", "s1-restarted", [0.1], start=3)
    assert w.standings == {}


def test_watch_replacement_in_flight_until_a_new_process_commits_or_the_timeout() -> None:
    w = StragglerWatch("replace")
    feed(w, "rg0", "s0", [0.1] * 20)
    feed(w, "rg1", "s1", [0.3] * 20)
    w.judge(["rg0", "rg1"], {"rg0", "rg1"}, now=0.0, wall=0.0)
    done = w.replaced(w.standings["rg1"], "spare", now=10.0, wall=1000.0)
    assert w.busy(10.0) and w.replacing == "rg1" and w.replacements == 1 and "rg1" not in w.standings
    feed(w, "rg0", "s0", [0.1], start=20)  # a process that existed before is no replacement
    assert w.busy(11.0)
    assert w.report("rg1.1", "spare-session", 1, 0.1, wall=1005.0)  # the spare's first commit: arrived
    assert w.history == (type(done)("rg1", done.slowdown, "spare", 1000.0, arrived=1005.0),)
    assert w.busy(12.0)  # ... but in flight until it can be judged itself
    feed(w, "rg1.1", "spare-session", [0.1] * (RULE.min_steps - 1), start=1)
    assert not w.busy(12.0) and w.history[0].arrived == 1005.0
    w.replaced(w.standings.get("rg0") or standing("rg0", 2.0, 30, 10), "restart", now=20.0, wall=1010.0)
    assert w.busy(20.0 + REPLACEMENT_TIMEOUT) and not w.busy(20.0 + REPLACEMENT_TIMEOUT + 1)


@st.composite
def standings(draw: st.DrawFn) -> tuple[dict[str, Standing], list[str]]:
    """Any verdicts on up to 8 groups (stragglers for any steps and seconds, or none), and which of
    them are live members of the quorum in use."""
    rids = ids(draw(st.integers(min_value=1, max_value=8)))
    out = {}
    for rid in rids:
        steps = draw(st.integers(min_value=0, max_value=100))
        since = draw(st.one_of(st.none(), st.integers(min_value=0, max_value=steps)))
        since_time = NOW - draw(st.floats(min_value=0.0, max_value=3 * RULE.persist_seconds))
        slowdown = draw(st.sampled_from([1.0, 1.6, 2.0, 3.0]))
        out[rid] = standing(rid, slowdown, steps, since, since_time)
    live = [rid for rid in rids if draw(st.booleans())]
    return out, live


@settings(max_examples=300, deadline=None)
@given(case=standings(), min_replicas=st.integers(min_value=1, max_value=8), busy=st.booleans())
def test_to_replace_never_two_at_once_never_below_min_replicas(
    case: tuple[dict[str, Standing], list[str]], min_replicas: int, busy: bool
) -> None:
    """Whatever the verdicts: nothing while a replacement is in flight, nothing that leaves the quorum
    under ``min_replicas``, only a live persistent straggler, and then the slowest of them."""
    s, live = case
    chosen = to_replace(s, live, min_replicas, busy, RULE, NOW)
    persistent = [x for rid, x in s.items() if rid in live and x.persistent(RULE, NOW)]
    if busy or len(live) - 1 < min_replicas or not persistent:
        assert chosen is None
        return
    assert chosen is not None and chosen.replica_id in live and chosen.persistent(RULE, NOW)
    assert chosen.slowdown == max(x.slowdown for x in persistent)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), scale=st.floats(min_value=0.01, max_value=100.0))
def test_a_uniformly_slow_job_has_nobody_to_replace(data: st.DataObject, scale: float) -> None:
    """Everybody slowed alike: the verdicts, then the replacement rule on them, replace nobody --
    however long it lasts."""
    windows, _base = data.draw(job())
    slowed = {rid: [c * scale for c in w] for rid, w in windows.items()}
    verdicts = judge(slowed, counts(slowed), {}, RULE)
    again = judge(slowed, counts(slowed), verdicts, RULE)  # judged again: still nobody
    chosen = to_replace(again, list(slowed), 1, False, RULE, NOW + 10 * RULE.persist_seconds)
    assert chosen is None
