"""What README runs, run the way a new user would: with only the declared dependencies importable
(NumPy made absent in every process of the job), output with each worker tag once, and README's
two-line script leaving the lighthouse cleanly without calling ``shutdown()``."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest
from workers.helpers import FTLAUNCH, REPO, run

from ftlaunch.launcher.output import without_repeated_tag

#: Makes NumPy absent exactly as in an environment without it: the path finder does not see it, so
#: ``import numpy`` raises ModuleNotFoundError and ``importlib.util.find_spec("numpy")`` is None
#: (torch probes both). Loaded by every Python process of the job through PYTHONPATH.
NO_NUMPY = """
import importlib.machinery as _m

_find_spec = _m.PathFinder.find_spec


def _without_numpy(fullname, path=None, target=None):
    if fullname == "numpy" or fullname.startswith("numpy."):
        return None
    return _find_spec(fullname, path, target)


_m.PathFinder.find_spec = staticmethod(_without_numpy)
"""

#: README's "Two lines in your training script", as written there: no ``shutdown()`` call.
TWO_LINES = """
import os
import sys

import torch
from torch import nn

import ftlaunch

model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
ft = ftlaunch.init(model, optimizer)
model, optimizer = ft.wrap(model, optimizer)
for step in range(3):
    optimizer.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
if os.environ["REPLICA_GROUP_ID"] == sys.argv[1]:
    raise RuntimeError("this group crashes after training")
print("done", flush=True)
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), **extra}


def _no_numpy_env(tmp_path: Path) -> dict[str, str]:
    shim = tmp_path / "no_numpy"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(NO_NUMPY)
    return _env(PYTHONPATH=os.pathsep.join([str(shim), REPO]))


def test_the_shim_really_hides_numpy(tmp_path) -> None:
    res = run(
        [
            sys.executable,
            "-c",
            "import importlib.util, torch; print(importlib.util.find_spec('numpy'));import numpy",
        ],
        timeout=60,
        env=_no_numpy_env(tmp_path),
    )
    assert res.stdout.strip() == "None" and "No module named 'numpy'" in res.stderr


@pytest.mark.timeout(150)
def test_demo_trains_without_numpy_and_tags_each_line_once(tmp_path) -> None:
    """README's demo (scripts/train_ddp.py under ftlaunch) without NumPy: it finishes, the groups end
    bit-identical, nothing crashes; the only trace of the missing NumPy is torch's own warning."""
    res = run(
        [*FTLAUNCH, "--replicas", "2", "--no-status", "scripts/train_ddp.py", "--steps", "5"],
        timeout=140,
        env=_no_numpy_env(tmp_path),
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert re.search(r"2/2 groups ended bit-identical", res.stdout), res.stdout
    assert "Traceback" not in out and "Numpy is not available" not in out
    numpy_lines = [line for line in out.splitlines() if "numpy" in line.lower()]
    assert numpy_lines and all("Failed to initialize NumPy" in line for line in numpy_lines), numpy_lines
    # Each worker line names its group and rank once: torchelastic's prefix, not the script's or the
    # Manager's.
    worker_lines = [line for line in out.splitlines() if re.match(r"\[rg\d/r\d\]", line)]
    assert any("[step " in line for line in worker_lines)
    for line in worker_lines:
        tag = line[: line.index("]") + 1]
        assert line.count(tag[:-1]) == 1, line


def test_repeated_tags_are_dropped_behind_the_prefix() -> None:
    line = "[rg1/r0] 2026-01-01 INFO [rg1/r0] [rg1/r0 step 42] healed"
    assert without_repeated_tag(line) == "[rg1/r0] 2026-01-01 INFO [step 42] healed"
    assert (
        without_repeated_tag("[rg1/r0] peer [rg0/r0 step 3] differs")
        == "[rg1/r0] peer [rg0/r0 step 3] differs"
    )
    assert without_repeated_tag("[rg1/r0] step=3 committed=True") == "[rg1/r0] step=3 committed=True"
    assert without_repeated_tag("no prefix [rg1/r0]") == "no prefix [rg1/r0]"


@pytest.mark.timeout(150)
def test_two_line_script_leaves_once_without_calling_shutdown(tmp_path) -> None:
    """README's two-line form never calls ``ft.shutdown()``: the interpreter's exit leaves the quorum
    (once per group). A group that dies of an uncaught exception does *not* leave: its closed
    connection is what tells the lighthouse it failed."""
    script = tmp_path / "two_lines.py"
    script.write_text(TWO_LINES)
    res = run(
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--max-restarts",
            "0",
            "--no-status",
            "--no-summary",
            str(script),
            "1",
        ],
        timeout=140,
        env=_env(LOGLEVEL="INFO"),
    )
    err = res.stderr
    assert res.returncode == 1, err[-4000:]  # group 1 crashed for good
    assert "[rg0/r0] done" in res.stdout
    assert err.count("replica rg0 left") == 1, err[-4000:]
    assert "rg0 disconnected" not in err
    assert "replica rg1 left" not in err and "rg1 disconnected: connection closed without leave" in err


def test_no_numpy_in_the_package_or_the_scripts() -> None:
    """NumPy is not something ftlaunch needs: no import of it and no ``.numpy()`` in what README runs."""
    offenders = []
    for path in [
        *Path(REPO, "ftlaunch").rglob("*.py"),
        *Path(REPO, "scripts").glob("*.py"),
        *Path(REPO, "components").glob("*.py"),
    ]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(n == "numpy" or n.startswith("numpy.") for n in names):
                offenders.append(f"{path}:{node.lineno} imports numpy")
            if isinstance(node, ast.Attribute) and node.attr == "numpy":
                offenders.append(f"{path}:{node.lineno} .numpy()")
    assert offenders == []
