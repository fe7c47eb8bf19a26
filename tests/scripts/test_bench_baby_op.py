"""scripts/bench_baby_op.py in CPU mode (Gloo and Baby Gloo): both ranks run, each figure is printed
beside its baseline, and the profile of the Baby ops follows."""

from __future__ import annotations

import re
import sys

import pytest
from workers.helpers import REPO, run


@pytest.mark.timeout(240)
def test_prints_each_op_beside_the_plain_backend_and_a_profile() -> None:
    res = run(
        [sys.executable, f"{REPO}/scripts/bench_baby_op.py", "--cpu", "--rounds", "2", "--iters", "5",
         "--bucket-mib", "1"],
        timeout=220,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = re.findall(
        r"plain Gloo +([\d.]+) ms +Baby Gloo +([\d.]+) ms +hop \+?-?[\d.]+ ms \(([\d.]+)x\)", res.stdout
    )
    assert len(rows) == 2, res.stdout
    assert all(float(p) > 0 and float(b) > 0 for p, b, _ in rows)
    profile = res.stdout.split("by own time:", 1)[1]
    assert "Ordered by: internal time" in profile and re.search(r"\d+ function calls", profile), profile
