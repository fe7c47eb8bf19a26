"""The decisions of durable checkpointing, in one process: when a save is due, which group writes it
(every group agrees without a message, and the turn moves on), what retention removes, which
checkpoint a job resumes from."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ftlaunch.checkpointing import durable_plan as dp

steps = st.integers(min_value=0, max_value=10**7)
every = st.integers(min_value=1, max_value=1000)


@given(step=steps, every=every)
def test_due_every_n_committed_steps_never_at_zero(step: int, every: int) -> None:
    assert dp.save_due(step, every) == (step > 0 and step % every == 0)
    assert not dp.save_due(step, 0)
    assert not dp.save_due(step, every, resumed_at=step)  # the step resumed from is on disk already


@given(step=steps, every=every, n=st.integers(min_value=1, max_value=64))
def test_exactly_one_participant_writes(step: int, every: int, n: int) -> None:
    writers = [r for r in range(n) if dp.is_writer(step, every, r, n)]
    assert len(writers) == 1
    assert not dp.is_writer(step, every, None, n)  # a healer or a spare writes nothing


@given(k=st.integers(min_value=0, max_value=10**5), every=every, n=st.integers(min_value=2, max_value=64))
def test_the_turn_moves_to_another_group_at_the_next_due_save(k: int, every: int, n: int) -> None:
    # A writer that died mid-save (or is slow) does not get the next save as well.
    assert dp.writer_index(k * every, every, n) != dp.writer_index((k + 1) * every, every, n)


@given(complete=st.lists(steps, unique=True, max_size=30), keep=st.integers(min_value=0, max_value=10))
def test_retention_keeps_the_newest(complete: list[int], keep: int) -> None:
    removed = dp.to_delete(complete, keep)
    kept = sorted(set(complete) - set(removed))
    if keep == 0:
        assert removed == []
    else:
        assert kept == sorted(complete)[-keep:]


@given(tmp=st.lists(steps, unique=True, max_size=20), published=steps)
def test_only_older_temporaries_are_stale(tmp: list[int], published: int) -> None:
    assert set(dp.stale(tmp, published)) == {s for s in tmp if s < published}


@given(
    complete=st.lists(st.integers(min_value=1, max_value=10**6), unique=True, max_size=20),
    damaged=st.sets(st.integers(min_value=1, max_value=10**6)),
)
def test_resume_from_the_newest_intact_one(complete: list[int], damaged: set[int]) -> None:
    choice = dp.choose_resume(complete, lambda s: "damaged" if s in damaged else None)
    intact = [s for s in complete if s not in damaged]
    assert choice.step == (max(intact) if intact else None)
    newer = sorted(
        (s for s in complete if s in damaged and (choice.step is None or s > choice.step)), reverse=True
    )
    assert [s for s, _ in choice.refused] == newer


@given(step=steps)
def test_names_sort_and_parse_back(step: int) -> None:
    assert dp.parse_name(dp.dir_name(step)) == (step, True)
    assert dp.parse_name(dp.dir_name(step, tmp=True)) == (step, False)
    listing = dp.list_dir([dp.dir_name(step), dp.dir_name(step + 1, tmp=True), "notes.txt", "step-12"])
    assert listing == dp.Listing((step,), (step + 1,))


@given(checkpoint=st.none() | steps, peers=st.lists(steps, max_size=6), reached=st.none() | steps)
def test_a_restarted_group_reads_the_disk_only_when_no_live_peer_holds_the_state(
    checkpoint: int | None, peers: list[int], reached: int | None
) -> None:
    load = dp.resume_from_disk(checkpoint, peers, reached)
    if checkpoint is None:
        assert not load  # nothing to read: heal (or start) as without checkpoints
    elif any(p > checkpoint for p in peers):
        assert not load  # a live peer holds a newer state: live recovery, no disk
    elif checkpoint in peers and (reached is None or checkpoint >= reached):
        assert not load  # a survivor at the checkpoint's step, the job's step: live recovery
    else:
        assert load  # no live group holds it (one at it is back from the same loss): the checkpoint


@given(checkpoint=st.integers(1, 10**7), groups=st.integers(1, 8), lost=st.integers(0, 50))
def test_groups_restarting_together_all_load_the_same_checkpoint(
    checkpoint: int, groups: int, lost: int
) -> None:
    reached = checkpoint + lost  # the step of the job's last quorum before every group died
    # (no checkpoint is of step 0: `save_due`)
    # Every group died: none is live while each decides, so each loads the checkpoint; one back
    # but not asked yet reads as step 0.
    assert all(dp.resume_from_disk(checkpoint, [], reached) for _ in range(groups))
    assert dp.resume_from_disk(checkpoint, [0] * (groups - 1), reached)
    if lost:
        # One asked its quorum at the checkpoint's step already (it loaded it): a later one loads
        # it too, so both train the first step after it.
        assert dp.resume_from_disk(checkpoint, [checkpoint], reached)
    # A survivor at the checkpoint's step, the job's: healed from, the disk is not read.
    assert not dp.resume_from_disk(checkpoint, [checkpoint], checkpoint)
    assert not dp.resume_from_disk(checkpoint, [checkpoint + 1], reached)


def test_a_group_saves_on_its_own_what_the_groups_do_not_share() -> None:
    keys = ["default", "diloco", "ftlaunch_manager", "sampler", "scheduler"]
    own = dp.own_keys(keys, shared={"diloco", "ftlaunch_manager"}, positions=["sampler"])
    assert own == ["default", "scheduler"]  # the model with its inner optimizer, and the rest
    assert dp.own_keys(keys, shared=keys, positions=[]) == []


@given(group=st.integers(min_value=0, max_value=10**4), step=steps)
def test_group_directories_are_not_taken_for_checkpoints(group: int, step: int) -> None:
    name = dp.group_dir_name(group)
    assert dp.parse_name(name) is None
    assert dp.list_dir([name, dp.dir_name(step)]).complete == (step,)
