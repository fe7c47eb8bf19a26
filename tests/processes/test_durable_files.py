"""Durable checkpoint files: DCP layout, atomic publish, verification and the fallback to the
previous checkpoint -- a truncated or bit-flipped newest one, a writer SIGKILLed mid-save (a real
process), a full disk (a real, small tmpfs) -- and ``dcp.load`` of a checkpoint outside ftlaunch."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ftlaunch.checkpointing import durable
from ftlaunch.checkpointing import durable_plan as dp
from ftlaunch.checkpointing.staging import stage
from ftlaunch.worker.durable import DurableCheckpoints, DurableConfig, reshard_sampler_states
from ftlaunch.worker.recovery import StateRegistry

pytestmark = pytest.mark.timeout(120)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))


def trained(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    m = model()
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        o.zero_grad()
        m(torch.randn(5, 8, generator=g)).pow(2).mean().backward()
        o.step()
    return m, o


def state_of(m: nn.Module, o: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {
        "ftlaunch_manager": {"step": step, "batches_committed": 2 * step},
        "default": {"model": m.state_dict(), "optim": o.state_dict()},
        "sampler": {"version": 1, "epoch": 0, "position": 32 * step, "dataset_len": 4096, "num_shards": 2},
    }


def save(root: Path, step: int) -> Path:
    m, o = trained(step)
    published = durable.write(stage(state_of(m, o, step), step).state, root, step)
    assert published is not None
    return published.path


class Holder:
    """A process's registered state: the Manager's step, a model and optimizer, a sampler position."""

    def __init__(self) -> None:
        self.m = model()
        self.o = torch.optim.Adam(self.m.parameters(), lr=0.01)
        self.own = {"step": 0, "batches_committed": 0}
        self.sampler = {"version": 1, "epoch": 0, "position": 0, "dataset_len": 4096, "num_shards": 2}
        self.registry = StateRegistry(lambda sd: self.own.update(sd), lambda: dict(self.own))

        def load(sd: dict[str, Any]) -> None:
            self.m.load_state_dict(sd["model"])
            self.o.load_state_dict(sd["optim"])

        self.registry.register(
            "default", load, lambda: {"model": self.m.state_dict(), "optim": self.o.state_dict()}
        )

    def register_sampler(self) -> None:
        self.registry.register("sampler", lambda sd: self.sampler.update(sd), lambda: dict(self.sampler))

    def resume(self, root: Path) -> tuple[int | None, DurableCheckpoints]:
        hook = DurableCheckpoints(
            DurableConfig(str(root)), self.registry, lambda: None, logging.getLogger("test")
        )
        return hook.resume(), hook


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_round_trip_is_bit_identical_and_dcp_loads_it_outside_ftlaunch(tmp_path: Path) -> None:
    path = save(tmp_path, 7)
    assert path.name == "step-00000007" and durable.verify(path) is None
    assert {".metadata", durable.MANIFEST} <= set(os.listdir(path))

    h = Holder()
    step, _ = h.resume(tmp_path)
    h.register_sampler()  # registered after the resume (as ft.sampler after ftlaunch.init): loaded then
    ref, ref_opt = trained(7)
    assert step == 7 and h.own == {"step": 7, "batches_committed": 14}
    assert same(h.m, ref)
    assert torch.equal(h.o.state_dict()["state"][0]["exp_avg"], ref_opt.state_dict()["state"][0]["exp_avg"])
    assert h.sampler["position"] == 7 * 32

    # Torch's own loader, a plain model, no ftlaunch: the names are DCP's.
    plain = model()
    sd = {"default": {"model": plain.state_dict()}}
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    plain.load_state_dict(sd["default"]["model"])
    assert same(plain, ref)


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "no-manifest"])
def test_damaged_newest_falls_back_to_the_previous_with_one_line(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    save(tmp_path, 10)
    newest = save(tmp_path, 20)
    data = newest / "__0_0.distcp"
    if damage == "truncate":
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    elif damage == "bitflip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    else:
        (newest / durable.MANIFEST).unlink()
    h = Holder()
    with caplog.at_level(logging.WARNING, logger="test"):
        step, hook = h.resume(tmp_path)
    assert step == 10 and h.own["step"] == 10
    assert same(h.m, trained(10)[0])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "step-00000020 is not usable" in warnings[0], warnings
    assert [s for s, _ in hook.stats.refused] == [20]


def test_no_checkpoint_starts_from_scratch(tmp_path: Path) -> None:
    h = Holder()
    assert h.resume(tmp_path / "none")[0] is None and h.own["step"] == 0


def test_sampler_position_reshards_onto_another_number_of_groups() -> None:
    saved = {"sampler": {"version": 1, "epoch": 2, "position": 96, "dataset_len": 4096, "num_shards": 2}}
    here = {"sampler": {"version": 1, "epoch": 0, "position": 0, "dataset_len": 4096, "num_shards": 3}}
    out = reshard_sampler_states(saved, here)
    assert (
        out["sampler"]["num_shards"] == 3
        and out["sampler"]["position"] == 64
        and out["sampler"]["epoch"] == 2
    )
    assert reshard_sampler_states(saved, saved) == saved


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, torch
    from ftlaunch.checkpointing import durable
    # A state big enough that its write is still going when the test kills this process.
    state = {"ftlaunch_manager": {"step": 20, "batches_committed": 40},
             "default": {"model": {f"w{i}": torch.randn(1 << 20) for i in range(32)}}}
    print("writing", flush=True)
    durable.write(state, sys.argv[1], 20)
    print("published", flush=True)
    """
)


@pytest.mark.slow
def test_writer_sigkilled_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    save(tmp_path, 10)
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        tmp = tmp_path / dp.dir_name(20, tmp=True)
        deadline = time.monotonic() + 60
        while not (tmp.is_dir() and any(tmp.iterdir())) and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the writer finished before it was killed"
    assert not (tmp_path / dp.dir_name(20)).exists()  # never published
    h = Holder()
    assert h.resume(tmp_path)[0] == 10
    # Retention after the next publish removes what the killed writer left (and, keep_last=1, step 10).
    save(tmp_path, 30)
    assert durable.retain(tmp_path, 1, 30) == [dp.dir_name(20, tmp=True), dp.dir_name(10)]
    assert sorted(os.listdir(tmp_path)) == [dp.dir_name(30)]


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_keeps_the_previous_checkpoint(small_tmpfs: Path) -> None:
    save(small_tmpfs, 10)
    big = {"ftlaunch_manager": {"step": 20, "batches_committed": 40}, "default": {"w": torch.randn(2 << 20)}}
    with pytest.raises(durable.DurableCheckpointError, match="step 20.*no space left"):
        durable.write(big, small_tmpfs, 20)
    assert sorted(os.listdir(small_tmpfs)) == [dp.dir_name(10)]  # the partial save is gone
    assert durable.verify(small_tmpfs / dp.dir_name(10)) is None
    h = Holder()
    assert h.resume(small_tmpfs)[0] == 10


def test_one_writer_by_turn_and_a_save_still_running_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    from types import SimpleNamespace

    from ftlaunch.worker import durable as worker_durable

    h = Holder()
    plan = SimpleNamespace(participant_rank=0, num_participants=2)
    hook = DurableCheckpoints(
        DurableConfig(str(tmp_path), every=10, keep_last=2),
        h.registry,
        lambda: plan,
        logging.getLogger("test"),
    )
    hook.first_boundary(0)
    hook.at_boundary(10)  # (10 // 10) % 2 == 1: the other participant's turn
    hook.close()
    assert os.listdir(tmp_path) == [] and hook.stats.saves == 0

    release = threading.Event()
    real_write = worker_durable.durable.write

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        release.wait(30)  # a disk that takes its time
        return real_write(*args, **kwargs)

    monkeypatch.setattr(worker_durable.durable, "write", slow_write)
    hook = DurableCheckpoints(
        DurableConfig(str(tmp_path), every=10, keep_last=2),
        h.registry,
        lambda: plan,
        logging.getLogger("test"),
    )
    h.own["step"] = 20
    hook.at_boundary(20)  # our turn: handed to the writer thread, the boundary returns at once
    hook.at_boundary(40)  # due again while the first is still being written: skipped, counted
    assert hook.stats.skipped == 1
    release.set()
    hook.close()
    assert hook.stats.saves == 1 and os.listdir(tmp_path) == [dp.dir_name(20)]


def test_a_clean_end_off_the_interval_writes_the_final_checkpoint(tmp_path: Path) -> None:
    from types import SimpleNamespace

    def hook_of(h: Holder, rank: int | None) -> DurableCheckpoints:
        plan = SimpleNamespace(participant_rank=rank, num_participants=2)
        hook = DurableCheckpoints(
            DurableConfig(str(tmp_path), every=10, keep_last=2),
            h.registry,
            lambda: plan,
            logging.getLogger("t"),
        )
        hook.first_boundary(0)
        return hook

    h = Holder()
    h.register_sampler()
    h.own["step"] = 17
    h.sampler["position"] = 17 * 64
    other = hook_of(h, 1)  # (17 // 10) % 2 == 1: the writer of step 17 is participant 1
    mine = hook_of(h, 0)
    for hook in (other, mine):
        hook.committed(17)  # the last committed step: its sampler position is the one to resume from
    h.sampler["position"] += 64  # the loop drew the next batch before it saw the end
    mine.final(17)
    mine.close()
    assert os.listdir(tmp_path) == [] and mine.stats.saves == 0  # not its turn
    other.final(17)
    other.close()
    assert os.listdir(tmp_path) == [dp.dir_name(17)] and other.stats.saves == 1
    other.final(17)  # written already: nothing more
    assert other.stats.saves == 1

    fresh = Holder()
    fresh.register_sampler()
    step, _ = fresh.resume(tmp_path)
    assert step == 17 and same(fresh.m, h.m) and fresh.sampler["position"] == 17 * 64


def test_after_a_sync_each_group_saves_its_own_state_and_loads_it_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """LocalSGD/DiLoCo: nothing at the sync point's quorum; after the sync that committed a due
    step, the writer saves the job's checkpoint (with the Manager's state of the sync point) and
    every group its own model and optimizer; at resume each group gets its own back, and a group
    the job did not have keeps the writer's, with one line."""
    from types import SimpleNamespace

    def group(g: int, steps: int) -> tuple[Holder, DurableCheckpoints]:
        h = Holder()
        m, o = trained(steps)  # each group's own inner training
        h.m.load_state_dict(m.state_dict())
        h.o.load_state_dict(o.state_dict())
        h.register_sampler()
        h.registry.register("diloco", lambda sd: None, lambda: {"global": torch.ones(3), "syncs": 4})
        plan = SimpleNamespace(participant_rank=g, num_participants=2)
        hook = DurableCheckpoints(
            DurableConfig(str(tmp_path), every=2),
            h.registry,
            lambda: plan,
            logging.getLogger("t"),
            group_id=g,
        )
        hook.first_boundary(0)
        hook.save_after_syncs({"diloco"})
        return h, hook

    groups = [group(0, 3), group(1, 5)]
    for h, hook in groups:
        h.own.update(step=1, batches_committed=2)
        hook.at_boundary(1)  # the sync point's quorum: noted, nothing written
    assert os.listdir(tmp_path) == []
    for h, hook in groups:
        h.own.update(step=2, batches_committed=4)  # the sync committed step 2, its update applied
        h.sampler["position"] = 64
        hook.after_sync(2)
        hook.close()
    # (2 // 2) % 2 == 1: participant 1 writes the job's checkpoint; both write their own state.
    assert sorted(os.listdir(tmp_path)) == ["group-0", "group-1", dp.dir_name(2)]
    for g in (0, 1):
        assert os.listdir(tmp_path / dp.group_dir_name(g)) == [dp.dir_name(2)]

    caplog.set_level(logging.INFO)
    for g, own_of in ((0, groups[0][0]), (1, groups[1][0]), (2, groups[1][0])):
        fresh = Holder()
        hook = DurableCheckpoints(
            DurableConfig(str(tmp_path), every=2),
            fresh.registry,
            lambda: None,
            logging.getLogger("t"),
            group_id=g,
        )
        assert hook.resume() == 2
        fresh.register_sampler()
        fresh.registry.register("diloco", lambda sd: None, lambda: {"global": torch.zeros(3), "syncs": 0})
        hook.save_after_syncs({"diloco"})  # loads this group's own state
        assert fresh.own == {"step": 1, "batches_committed": 2}  # the join after the resume commits 2
        assert fresh.sampler["position"] == 64
        assert same(fresh.m, own_of.m)
        assert torch.equal(
            fresh.o.state_dict()["state"][0]["exp_avg"], own_of.o.state_dict()["state"][0]["exp_avg"]
        )
    assert "loaded this group's own default" in caplog.text
    assert caplog.text.count("no state of this group's own (none was saved)") == 1  # group 2's
