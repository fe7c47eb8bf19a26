"""scripts/port_torchft_tests.py: README's porting rules as the script applies them to torchft's
shipped tests, and (slow, needs the network for torchft's wheel) a run of two of those files."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "port_torchft_tests.py"
_spec = importlib.util.spec_from_file_location("port_torchft_tests", SCRIPT)
assert _spec is not None and _spec.loader is not None
port = importlib.util.module_from_spec(_spec)
sys.modules["port_torchft_tests"] = port
_spec.loader.exec_module(port)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("from torchft.ddp import DistributedDataParallel", "from ftlaunch import DistributedDataParallel"),
        (
            "from torchft.coordination import LighthouseServer",
            "from ftlaunch.coordination import LighthouseServer",
        ),
        (
            "from torchft._torchft import LighthouseServer",
            "from ftlaunch.coordination import LighthouseServer",
        ),
        ("from torchft import Manager", "from ftlaunch import Manager"),
        ('patch("torchft.process_group.TCPStore")', 'patch("ftlaunch.process_group.TCPStore")'),
        (
            "from torchft.manager_integ_test import Runner",
            "from torchft_tests.manager_integ_test import Runner",
        ),
        ("from torchft._test.diloco_trainer import X", "from torchft_tests._test.diloco_trainer import X"),
        ("import torchft_tests.x", "import torchft_tests.x"),  # the copies' package is left alone
    ],
)
def test_readmes_rules(before: str, after: str) -> None:
    assert port.rewrite(before, to_torchft=False) == after


def test_the_torchft_baseline_keeps_torchft_but_imports_the_copied_tests() -> None:
    src = "from torchft.manager import Manager\nfrom torchft.manager_integ_test import Runner\n"
    assert port.rewrite(src, to_torchft=True) == (
        "from torchft.manager import Manager\nfrom torchft_tests.manager_integ_test import Runner\n"
    )


def test_tests_of_torchfts_internals_are_counted_apart() -> None:
    assert port.internal_reason("manager_test.py::ManagerTest::test_quorum_happy") is not None
    assert port.internal_reason("lighthouse_test.py::TestLighthouse::test_join_timeout_behavior") is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ports_and_runs_torchfts_own_tests(tmp_path: Path) -> None:
    try:
        pytest.importorskip("parameterized", reason="torchft's tests import parameterized")
        got = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "torchft-nightly==2026.10.26",
                "-d",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.skip("no network: torchft's wheel cannot be downloaded")
    wheels = list(tmp_path.glob("*.whl"))
    if got.returncode != 0 or not wheels:
        pytest.skip(f"torchft's wheel cannot be downloaded here: {got.stderr.strip()[-200:]}")
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--wheel", str(wheels[0]), "--files", "data_test.py", "ddp_test.py"],
        capture_output=True,
        text=True,
        timeout=500,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "public behaviour: 5 of 5 pass against ftlaunch" in res.stdout, res.stdout
