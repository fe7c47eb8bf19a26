"""Each replica group of an ``ftlaunch`` job gets its own GPUs when the machine has enough.

The rule is pure (`launcher/devices.py`); the real-process test lists four "GPUs" through
``CUDA_VISIBLE_DEVICES`` (the launcher never asks a driver then) and reads what each worker saw.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ftlaunch import env
from ftlaunch.launcher.devices import group_devices, sharing_warning


def test_each_group_gets_its_own_slice_in_order() -> None:
    assert group_devices(["0", "1", "2", "3"], 2, 2) == [("0", "1"), ("2", "3")]
    assert group_devices(["3", "1", "GPU-a", "GPU-b"], 1, 3) == [("3",), ("1",), ("GPU-a",)]
    assert group_devices([str(i) for i in range(8)], 4, 2) == [("0", "1", "2", "3"), ("4", "5", "6", "7")]


def test_too_few_gpus_means_sharing_and_a_warning() -> None:
    assert group_devices(["0", "1"], 2, 2) is None
    assert group_devices([], 1, 2) is None
    warning = sharing_warning(2, 2, 2)
    assert warning is not None and "share GPUs" in warning and "2 GPU(s)" in warning
    assert sharing_warning(0, 2, 2) is None  # a CPU machine: nothing to share
    assert sharing_warning(4, 2, 2) is None  # enough for everyone
    assert sharing_warning(1, 1, 1) is None  # one group has no peer to collide with


def test_visible_gpus_reads_cuda_visible_devices() -> None:
    assert env.visible_gpus({}) is None
    assert env.visible_gpus({env.CUDA_VISIBLE_DEVICES: ""}) == []
    assert env.visible_gpus({env.CUDA_VISIBLE_DEVICES: "-1"}) == []
    assert env.visible_gpus({env.CUDA_VISIBLE_DEVICES: "2, 0,GPU-x"}) == ["2", "0", "GPU-x"]


_SCRIPT = """\
import json, os, sys
print("SEEN " + json.dumps({"group": os.environ["REPLICA_GROUP_ID"], "rank": os.environ["LOCAL_RANK"],
      "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}), flush=True)
"""


@pytest.mark.timeout(240)
def test_ftlaunch_gives_every_group_its_own_devices(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "ftlaunch.launcher.cli", "--replicas", "2", "--spares", "1",
         "--nproc-per-node", "2", "--no-status", "--no-summary", str(script)],
        env={**env.inherited(), env.CUDA_VISIBLE_DEVICES: "7,6,5,4,3,2", "FTLAUNCH_ZYGOTE": "0"},
        capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    seen = [json.loads(line.split("SEEN ", 1)[1]) for line in proc.stdout.splitlines() if "SEEN " in line]
    by_group = {(s["group"], s["rank"]): s["devices"] for s in seen}
    assert by_group == {
        ("0", "0"): "7,6", ("0", "1"): "7,6",
        ("1", "0"): "5,4", ("1", "1"): "5,4",
        ("2", "0"): "3,2", ("2", "1"): "3,2",  # the hot spare has its own too
    }, proc.stdout[-2000:] + proc.stderr[-2000:]  # fmt: skip
    assert "share GPUs" not in proc.stderr
