"""scripts/soak_breakdown.py: the soak's lost time, split per cause, adds up and names the right cause.

Synthetic timelines (no processes): a fault-free run of 4 groups stepping every 0.1 s, and the same
run with a 12 s lighthouse outage, a 3 s SIGSTOP stall, a SIGKILL the survivors do not notice, and
a slower end of run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from soak_breakdown import Timeline, breakdown  # noqa: E402


def steady(start: float, steps: range, groups: tuple[int, ...] = (0, 1, 2, 3), dt: float = 0.1):
    return [(start + i * dt, g, s) for i, s in enumerate(steps) for g in groups]


def test_lost_time_adds_up_and_is_attributed() -> None:
    base_commits = steady(0.0, range(1, 201))
    base = Timeline(base_commits, first_step_at=0.0, last_final_at=19.9 + 0.5)
    # Chaos: steps 1-50 as usual; the lighthouse is down from 5.0 to 17.0 (the job stalls until 17.2);
    # steps 51-100; a SIGSTOP of group 3 at 22.2 blocks everybody for 3 s; group 2 is SIGKILLed at
    # 30.15 s and comes back 13 s later, the others stepping on; the last group ends 1.5 s after the
    # last step instead of 0.5 s.
    commits = steady(0.0, range(1, 51))
    commits += steady(17.2, range(51, 101))
    commits += steady(25.3, range(101, 150), groups=(0, 1, 2, 3))
    commits += steady(30.2, range(150, 201), groups=(0, 1, 3))
    commits += [(43.0, 2, 180)]
    last_step_at = 30.2 + 50 * 0.1
    chaos = Timeline(
        commits,
        first_step_at=0.0,
        last_final_at=last_step_at + 1.5,
        injections=[(22.2, "SIGSTOP", "workers", 3), (30.15, "SIGKILL", "workers", 2)],
        lighthouse_down=(5.0, 17.0),
    )
    b = breakdown(chaos, base, stop_for=3.0, lighthouse_down=12.0)
    assert b is not None
    assert b["imposed_by_the_faults_s"] == pytest.approx(15.0)
    assert b["design_bound_goodput"] == pytest.approx(20.4 / (20.4 + 15.0), abs=0.001)
    causes = b["lost_by_cause_s"]
    assert sum(causes.values()) == pytest.approx(b["lost_s"], abs=0.05)
    assert b["lost_s"] == pytest.approx((last_step_at + 1.5) - 20.4, abs=0.01)
    lighthouse = causes["lighthouse restart (outage, reconnect, resume quorum)"]
    stop = causes["SIGSTOP: survivors blocked until the group is declared hung or resumes"]
    assert lighthouse == pytest.approx(12.3 - 0.1, abs=0.05)
    assert stop == pytest.approx(3.2 - 0.1, abs=0.05)
    assert causes["end of run (last step -> last group's final line)"] == pytest.approx(1.0, abs=0.01)
    assert not any(k.startswith("SIGKILL") for k in causes)  # the survivors never stopped for it
    kill = next(i for i in b["injections"] if i["signal"] == "SIGKILL")
    assert kill["victim_back_after_s"] == pytest.approx(43.0 - 30.15, abs=0.01)


def test_no_breakdown_without_steps() -> None:
    empty = Timeline([], None, None)
    assert breakdown(empty, empty, stop_for=3.0) is None


def test_a_short_pause_while_a_group_is_stopped_counts_for_the_stop() -> None:
    """A stopped group declared hung within ~0.6 s pauses the job below the stall threshold (1 s):
    that pause is the SIGSTOP's, not "slower steps"; a pause as long with no stop nearby stays there."""
    base = Timeline(steady(0.0, range(1, 201)), first_step_at=0.0, last_final_at=19.9 + 0.5)
    # Steps 1-50; group 3 SIGSTOPped at 5.0, the job pauses 0.6 s; steps 51-100; a pause of 0.6 s
    # at 15.7 with no fault; steps 101-200.
    commits = steady(0.0, range(1, 51))
    commits += steady(5.5, range(51, 101))
    commits += steady(10.5 + 0.5, range(101, 201))
    chaos = Timeline(commits, first_step_at=0.0, last_final_at=20.9 + 0.5,
                     injections=[(4.95, "SIGSTOP", "workers", 3)])  # fmt: skip
    b = breakdown(chaos, base, stop_for=3.0)
    assert b is not None
    causes = b["lost_by_cause_s"]
    assert sum(causes.values()) == pytest.approx(b["lost_s"], abs=0.05)
    assert causes["SIGSTOP: survivors blocked until the group is declared hung or resumes"] == pytest.approx(
        0.5, abs=0.01
    )
    assert causes["slower steps (CPU shared with restarting groups)"] == pytest.approx(0.5, abs=0.01)
    assert not b["stalls"]  # both pauses are below the stall threshold
