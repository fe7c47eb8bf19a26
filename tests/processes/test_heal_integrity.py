"""Tampered heals under real Managers: real processes, the HTTP transport, a real lighthouse.

A source that serves other state than it claimed (valid payload, poisoned weights), and a source
whose payload is corrupted or cut off on the wire: the healer rejects it (by its source's claim,
or by the transport's checksums), the step is committed by nobody, the healer heals again from a
source that serves honestly, and every group ends bit-identical. The rules themselves are pinned
down in one process by tests/unit/test_plan.py and tests/unit/test_manager_protocol.py; the hostile header
by tests/processes/test_checkpointing_http.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from workers.helpers import wait_for

from ftlaunch.lighthouse.server import LighthouseServer
from tests.mp_harness import Group

pytestmark = pytest.mark.timeout(300)

ARGS = [
    "--step-sleep",
    "0.1",
    "--timeout",
    "10",
    "--quorum-timeout",
    "20",
    "--connect-timeout",
    "2",
    "--max-seconds",
    "200",
]


@pytest.fixture
def lighthouse() -> Iterator[LighthouseServer]:
    """Two groups make the first quorum: the sources never train alone into the end."""
    with LighthouseServer(
        "127.0.0.1:0", min_replicas=2, join_timeout=2.0, heartbeat_timeout=3.0, quorum_tick=0.05
    ).start() as lh:
        yield lh


def last_step(g: Group) -> int:
    return max((r["after"] for r in g.steps() if r["committed"]), default=0)


def run_to_the_end(gs: list[Group], steps: int) -> None:
    for g in gs:
        codes = g.wait(240)
        assert codes == [0] * g.nworkers, g.log_tail()
    finals = [g.final() for g in gs]
    assert all(f is not None and f["step"] == steps for f in finals), finals
    assert len({f["checksum"] for f in finals if f is not None}) == 1, finals


def rejected_then_healed(healer: Group, source: Group, reason: str) -> None:
    """The healer's first heal was rejected for ``reason``, committed by nobody, and a later one took."""
    tampered = [r for r in source.records() if "tampered" in r]
    assert tampered, "the source never served tampered state (the scenario did not happen)"
    log = (healer.tmp / f"rg{healer.gid}_r0_a0.log").read_text(errors="replace")
    assert reason in log, log[-3000:]
    steps = healer.steps()
    assert not steps[0]["committed"] and steps[0]["after"] == 0, steps[:3]  # the tampered heal: not committed
    healed = next(r for r in steps if r["committed"])
    assert healed["after"] > tampered[0]["step"]
    # From its heal on, the healer holds exactly its source's weights after every step (the end
    # alone proves little: this tiny model's weights converge to the same values from anywhere).
    theirs = {r["after"]: r["checksum"] for r in source.steps() if r["committed"]}
    mine = [(r["after"], r["checksum"]) for r in steps if r["committed"]]
    assert mine and all(theirs.get(after) == c for after, c in mine), (mine[:3], theirs.get(mine[0][0]))
    # The source committed nothing at the step it served tampered state (the vote spans all groups).
    at = [r for r in source.steps() if r["step"] == tampered[0]["step"]]
    assert at and not at[0]["committed"], at


@pytest.mark.slow
def test_a_source_that_serves_other_state_than_it_claimed_heals_nobody(
    tmp_path: Path, lighthouse: LighthouseServer, groups: list[Group]
) -> None:
    """rg0 (everyone's first source by rank) always serves poisoned weights in a valid payload once
    training is under way, while it claims its honest state like rg1. A late rg2 is assigned to
    rg0, rejects the payload by the claim, and heals from rg1 next: all three end identical.
    Before claims, rg2 took rg0's poison and ended with other weights."""
    steps = 300  # long enough for the late group's process to start on a loaded machine
    gs = [Group(0, 1, lighthouse.address, tmp_path,
                ["--steps", str(steps), "--tamper", "poison", "--tamper-from-step", "3", "--tamper-times",
                 "-1",
                 *ARGS]),
          Group(1, 1, lighthouse.address, tmp_path, ["--steps", str(steps), *ARGS])]  # fmt: skip
    groups.extend(gs)
    for g in gs:
        g.start()
    wait_for(lambda: min(last_step(gs[0]), last_step(gs[1])) >= 4, 120, "4 steps in both")
    late = Group(2, 1, lighthouse.address, tmp_path, ["--steps", str(steps), *ARGS])
    groups.append(late)
    late.start()
    run_to_the_end([*gs, late], steps)
    rejected_then_healed(late, gs[0], "does not match the checksum it claimed")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["corrupt", "truncate"])
def test_a_corrupted_or_truncated_heal_payload_is_rejected_and_healed_again(
    tmp_path: Path, lighthouse: LighthouseServer, groups: list[Group], mode: str
) -> None:
    """The only source's first heal payload (the start's sync from the primary) is corrupted after
    its checksums were taken (or cut off halfway): the healer's transport rejects it, the step
    commits nowhere, and the next quorum's heal (served honestly) makes the healer bit-identical
    to its peer."""
    steps = 10
    src = Group(
        0,
        1,
        lighthouse.address,
        tmp_path,
        ["--steps", str(steps), "--tamper", mode, "--tamper-from-step", "0", *ARGS],
    )
    healer = Group(1, 1, lighthouse.address, tmp_path, ["--steps", str(steps), *ARGS])
    groups.extend([src, healer])
    src.start()
    healer.start()
    run_to_the_end([src, healer], steps)
    rejected_then_healed(healer, src, "checksum mismatch" if mode == "corrupt" else "truncated transfer")
