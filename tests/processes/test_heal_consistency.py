"""Heals of models whose forward pass updates buffers (BatchNorm statistics, a counter): real
processes, a real lighthouse, a real SIGKILL, over both transports.

The forward pass of the next step runs while a source serves its state to a healer, and changes
those buffers in place. A heal must carry the state the source committed, not tensors changing
under the transfer: such heals fail their checksums (the claim, or the transport's own) again and
again, and since a failed heal fails the step everywhere, the whole job stops committing. Here every
group draws the same batches (``--same-data``), so honest groups hold bit-identical state at every
step, buffers included, and the restarted group must too from its heal on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_launcher_e2e import checksums
from workers.helpers import FTLAUNCH, run, wait_for

from ftlaunch.lighthouse.server import LighthouseServer
from tests.mp_harness import Group

pytestmark = pytest.mark.timeout(300)

STEPS = 60


def committed(g: Group, rank: int = 0) -> dict[int, str]:
    """Step reached -> checksum of the whole state (parameters, buffers, optimizer state)."""
    return {r["after"]: r["checksum"] for r in g.steps(rank) if r["committed"]}


def heal_and_end_identical(
    tmp_path: Path, groups: list[Group], model: str, transport: str, nworkers: int
) -> None:
    hold = tmp_path / "hold"  # while it exists, the survivor steps slowly: it cannot finish alone
    args = ["--steps", str(STEPS), "--model", model, "--same-data", "--transport", transport,
            "--step-sleep", "0.02", "--hold-file", str(hold), "--timeout", "20", "--max-seconds",
            "200"]  # fmt: skip
    with LighthouseServer(
        "127.0.0.1:0", min_replicas=1, join_timeout=5.0, heartbeat_timeout=5.0, quorum_tick=0.05
    ).start() as lh:
        gs = [Group(i, nworkers, lh.address, tmp_path, args) for i in range(2)]
        groups.extend(gs)
        for g in gs:
            g.start()
        # Both groups hold step 6: a group that joined late may still be healing, and the kill would
        # then leave no survivor holding the state.
        wait_for(lambda: all(max(committed(g), default=0) >= 6 for g in gs), 120, "step 6 in both groups")
        hold.touch()
        t_kill = gs[1].kill()
        gs[1].restart()
        wait_for(lambda: any(r["t"] > t_kill and r["committed"] for r in gs[1].steps()), 120, "the heal")
        hold.unlink()
        for g in gs:
            assert g.wait(240) == [0] * nworkers, g.log_tail()
    for rank in range(nworkers):
        # The restarted group healed (it did not start over at step 0) ...
        tries = [r for r in gs[1].steps(rank) if r["pid"] == gs[1].procs[rank].pid]  # the restarted process's
        restarted = [r for r in tries if r["committed"]]
        assert restarted and restarted[0]["after"] > 6, restarted[:3]
        # ... at once (a step that waits for its sources' snapshot, maybe one more), and from then on
        # it holds exactly its source's state after every step.
        assert sum(not r["committed"] for r in tries) <= 2, gs[1].log_tail()
        source, healer = committed(gs[0], rank), committed(gs[1], rank)
        after_heal = [s for s in healer if s >= restarted[0]["after"]]
        assert len(after_heal) >= 10 and all(healer[s] == source[s] for s in after_heal), [
            (s, healer[s], source.get(s)) for s in after_heal
        ][:5]
        finals = [g.final(rank) for g in gs]
        assert all(f is not None and f["step"] == STEPS for f in finals), finals
        assert finals[0]["checksum"] == finals[1]["checksum"], finals  # type: ignore[index]
    # The survivor was not held up for long: one step waits for the heal at most.
    failed = [r for r in gs[0].steps() if r["t"] > t_kill and not r["committed"]]
    assert len(failed) <= 2, failed


def test_a_batchnorm_cnn_heals_over_the_pg_transport_and_ends_bit_identical(
    tmp_path: Path, groups: list[Group]
) -> None:
    heal_and_end_identical(tmp_path, groups, "bn-cnn", "pg", 1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "transport", "nworkers"),
    [("bn-cnn", "http", 1), ("counter", "pg", 1), ("counter", "http", 1), ("bn-cnn", "pg", 2)],
)
def test_a_model_whose_forward_updates_buffers_heals_and_ends_bit_identical(
    tmp_path: Path, groups: list[Group], model: str, transport: str, nworkers: int
) -> None:
    heal_and_end_identical(tmp_path, groups, model, transport, nworkers)


def test_a_batchnorm_model_under_ftlaunch_heals_and_the_summary_says_bit_identical() -> None:
    """As a user runs it: scripts/train_ddp.py's BatchNorm CNN, a group SIGKILLed by --chaos, the
    default transport. The victim heals at once, and the summary compares what the groups share --
    parameters and optimizer state; each group's BatchNorm statistics follow its own data, as each
    replica's do in torch's DDP -- so it says 2/2 bit-identical, as the script's own checksums do."""
    res = run([*FTLAUNCH, "--replicas", "2", "--no-status", "--chaos", "steps=15,group=1",
               "scripts/train_ddp.py",
               "--model", "bn-cnn", "--steps", "60", "--step-sleep", "0.05"], timeout=280)  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    sums = checksums(res.stdout)
    assert set(sums) == {0, 1} and len(set(sums.values())) == 1, sums
    assert "2/2 groups ended bit-identical" in res.stdout and "WARNING" not in res.stdout, res.stdout[-3000:]
    assert "group committed again" in res.stdout
    log = res.stdout + res.stderr
    assert "rejected" not in log and "checksum mismatch" not in log, log[-3000:]
