"""ftlaunch.worker.sample_pool: the exactly-once sampler's bookkeeping, as pure functions.

The property tests replay random jobs -- groups failing, returning, standing by, added past the
group count the job started with, steps that do not commit -- with every worker drawing exactly
as the sampler does (`Layout.index` on the pool it holds), and check the promise: the positions the
committed steps' participants drew are distinct, are exactly what the pool lost, and cover every
position below the pool's first one. So every sample of every finished epoch is trained exactly once.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlaunch.worker.sample_pool import Cursor, Layout, LayoutError, Pool, commit, frontier, merge


def untrained(pool: Pool, limit: int) -> set[int]:
    return {p for p in range(limit) if p >= pool.cursor or any(a <= p < b for a, b in pool.holes)}


# ---------------------------------------------------------------------------------------- the pool
def test_pool_positions_walk_the_holes_then_the_cursor() -> None:
    pool = Pool(10, ((2, 4), (6, 7)))
    assert [pool.position(i) for i in range(6)] == [2, 3, 6, 10, 11, 12]
    assert pool.below_cursor == 3 and pool.first() == 2
    assert pool.positions([(1, 4)]) == [(3, 4), (6, 7), (10, 11)]
    assert pool.untrained_in(0, 12) == 5


def test_pool_remove_turns_gaps_past_the_cursor_into_holes_and_merges_back() -> None:
    pool = Pool(5).remove([(5, 7), (9, 10)])
    assert pool == Pool(10, ((7, 9),))
    assert pool.remove([(7, 9)]) == Pool(10)
    assert Pool(10, ((2, 4),)).remove([(2, 3)]) == Pool(10, ((3, 4),))
    with pytest.raises(ValueError, match="already trained"):
        Pool(10, ((2, 4),)).remove([(4, 5)])
    with pytest.raises(ValueError, match="already trained"):
        Pool(10).remove([(3, 12)])


def test_pool_rejects_malformed_holes() -> None:
    for holes, cursor in [(((3, 2),), 10), (((1, 3), (3, 5)), 10), (((1, 3),), 3), (((5, 6), (1, 2)), 10)]:
        with pytest.raises(ValueError):
            Pool(cursor, holes)
    with pytest.raises(ValueError):
        Pool(-1)
    assert Pool.of([(1, 3), (3, 5), (8, 12)], 10) == Pool(8, ((1, 5),))


def test_skip_to_drops_only_what_lies_before() -> None:
    pool = Pool(20, ((3, 5), (12, 15)))
    assert pool.skip_to(13) == Pool(20, ((13, 15),))
    assert pool.skip_to(2) is pool
    assert pool.skip_to(30) == Pool(30)


def test_frontier_is_the_first_epoch_with_untrained_samples() -> None:
    assert frontier(Pool(0), 10) == (0, 0)
    assert frontier(Pool(25, ((7, 8),)), 10) == (0, 9)
    assert frontier(Pool(25), 10) == (2, 5)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 60), st.integers(1, 8)), max_size=12),
    st.integers(0, 80),
)
def test_pool_matches_a_set_model(removals: list[tuple[int, int]], skip: int) -> None:
    pool = Pool()
    model: set[int] = set()  # trained
    for start, size in removals:
        # Remove the `size` untrained positions at pool index `start` (what a slice does).
        want = [pool.position(start + i) for i in range(size)]
        ranges = pool.positions([(start, start + size)])
        assert sorted(p for a, b in ranges for p in range(a, b)) == want
        pool = pool.remove(ranges)
        assert not model & set(want)
        model |= set(want)
        assert untrained(pool, 200) == set(range(200)) - model
    skipped = pool.skip_to(skip)
    assert untrained(skipped, 200) == {p for p in range(200) if p >= skip} - model


# ---------------------------------------------------------------------------------------- layouts
def test_known_per_step_gives_consecutive_slices_in_group_order() -> None:
    layout = Layout(workers=2, per_step=3, groups=2)
    assert [layout.index(1, 0, j) for j in range(3)] == [6, 7, 8]
    assert layout.slice(1, 1) == (9, 12)
    assert layout.consumed([0, 1], 3) == [(0, 12)]
    assert layout.consumed([1], 2) == [(6, 8), (9, 11)]
    with pytest.raises(ValueError):
        layout.index(0, 0, 3)


def test_first_step_deals_rows_to_the_groups_started_with() -> None:
    layout = Layout(workers=2, per_step=None, groups=3)
    assert [layout.index(0, 1, j) for j in range(3)] == [1, 7, 13]
    assert layout.slice(0, 0) is None
    assert layout.consumed([0], 2) == [(0, 2), (6, 8)]
    assert layout.consumed([0, 1, 2], 2) == [(0, 12)]


def test_first_step_refuses_a_group_past_the_count_when_it_shares_the_step() -> None:
    layout = Layout(workers=1, per_step=None, groups=2)
    with pytest.raises(LayoutError, match="started with 2 groups"):
        commit(Cursor(), layout, [0, 2], 3)
    assert commit(Cursor(), layout, [2], 3).pool == Pool(0, ()).remove([(2, 3), (4, 5), (6, 7)])
    with pytest.raises(LayoutError, match="same replica group"):
        commit(Cursor(per_step=2), Layout(1, 2, 2), [1, 1], 2)


def test_commit_learns_the_samples_per_step_and_counts_the_step() -> None:
    c = commit(Cursor(), Layout(1, None, 2), [0], 4)
    assert c.per_step == 4 and c.step == 1
    assert commit(c, Layout(1, 4, 2), [], 4) == Cursor(c.pool, 2, 4)
    assert commit(c, Layout(1, 4, 2), [0, 1], 0) == Cursor(c.pool, 2, 4)


# ---------------------------------------------------------------------------------------- jobs
steps = st.lists(
    st.tuples(
        st.sets(st.integers(0, 5), max_size=5),  # the step's participants (replica groups)
        st.booleans(),  # committed
        st.integers(0, 100),  # per-mille chance-like knob: a short step (fewer draws than per_step)
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(
    length=st.integers(1, 23),
    workers=st.integers(1, 3),
    started=st.integers(1, 4),
    first_draws=st.integers(1, 9),
    steps=steps,
)
def test_every_position_is_trained_exactly_once(
    length: int, workers: int, started: int, first_draws: int, steps: list[tuple[set[int], bool, int]]
) -> None:
    cursor = Cursor()
    trained: list[int] = []  # positions the committed steps' participants drew, with repeats
    for participants, committed, short in steps:
        groups = sorted(participants)
        layout = Layout(workers, cursor.per_step, started)
        if cursor.per_step is None:
            drawn = first_draws
            if len(groups) > 1 and groups[-1] >= started:
                groups = [g for g in groups if g < started]  # past the count: see the test above
        else:
            drawn = cursor.per_step if short < 80 else short % (cursor.per_step + 1)
        # What every worker of every participant drew, placed exactly as the sampler places it.
        draws = [
            cursor.pool.position(layout.index(g, r, j))
            for g in groups
            for r in range(workers)
            for j in range(drawn)
        ]
        if not committed:
            continue  # nothing trained, nothing taken: the same samples are drawn again
        before = cursor.pool
        cursor = commit(cursor, layout, groups, drawn)
        assert len(set(draws)) == len(draws), "two workers drew one sample in one step"
        limit = max([*draws, before.cursor, cursor.pool.cursor]) + 1
        assert untrained(before, limit) - untrained(cursor.pool, limit) == set(draws)
        trained.extend(draws)
    assert len(set(trained)) == len(trained), "a sample was trained twice"
    done = cursor.pool.first()
    assert set(range(done)) <= set(trained)
    assert not set(trained) & untrained(cursor.pool, max([*trained, cursor.pool.cursor]) + 1)
    # Hence per epoch: every epoch below the frontier has each of its `length` samples exactly once.
    epoch, position = frontier(cursor.pool, length)
    assert sum(1 for p in trained if p < epoch * length) == epoch * length
    assert position == sum(1 for p in trained if epoch * length <= p < (epoch + 1) * length)


@settings(max_examples=100, deadline=None)
@given(steps=steps, workers=st.integers(1, 3))
def test_same_failures_give_the_same_slices(steps: list[tuple[set[int], bool, int]], workers: int) -> None:
    """Determinism: the cursor is a function of what committed, with whom, and the draws."""

    def run() -> Cursor:
        cursor = Cursor()
        for participants, committed, _ in steps:
            if committed:
                layout = Layout(workers, cursor.per_step, 6)
                cursor = commit(cursor, layout, sorted(participants), cursor.per_step or 3)
        return cursor

    assert run() == run()


def test_merge_joins_touching_and_drops_empty_ranges() -> None:
    assert merge([(5, 6), (1, 3), (3, 4), (7, 7)]) == [(1, 4), (5, 6)]
