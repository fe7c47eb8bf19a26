"""``scripts/bench_lighthouse.py --compare`` prints the lighthouse beside the harness's floor, and
torchft's lighthouse beside them when torchft is importable -- else one line saying its rows are
skipped (the benchmark still runs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_lighthouse_sim  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_compare_prints_the_lighthouse_beside_the_floor_and_torchft_or_says_it_is_skipped() -> None:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_lighthouse.py"), "--compare", "--sizes", "2",
         "--rounds64", "5", "--hb-seconds", "0.2"],
        capture_output=True, text=True, timeout=150, env=env, check=True,
    ).stdout  # fmt: skip
    # The table's rows: groups, clients, processes (2), measured rounds (5), then the figures.
    kinds = {m.group(1) for m in re.finditer(r"^\s+2\s+(\S.*?)\s+2\s+5\s+\d", out, re.M)}
    assert {"lean, burst", "lean, burst, FLOOR"} <= kinds, out
    if bench_lighthouse_sim.torchft_native() is None:
        assert "torchft is not installed: its rows are skipped" in out
        assert not any("torchft" in k for k in kinds)
    else:
        assert "torchft LighthouseClient" in kinds, out
