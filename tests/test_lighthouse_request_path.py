"""The quorum request path's shortcuts (issue 17 item 6) decide exactly as the long ways they skip."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ftlaunch.lighthouse.bodies import expect_fields as _expect
from ftlaunch.lighthouse.bodies import loads as _loads
from ftlaunch.lighthouse.http import HttpError
from ftlaunch.lighthouse.server import GC_THRESHOLDS

QUORUM_FIELDS = ({"member": (dict,)}, {"timeout": (float, int), "progress": (dict,), "known": (str,)})


def test_bodies_in_other_encodings_still_parse() -> None:
    obj = {"member": {"replica_id": "g\u00e9", "step": 1}}
    for encoding in ("utf-8", "utf-16", "utf-32"):
        assert _loads(json.dumps(obj, ensure_ascii=False).encode(encoding)) == obj
    with pytest.raises(ValueError):
        _loads(b"{not json")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"member": {}, "timeout": True}, "field 'timeout' must be float, got bool"),
        ({"member": {}, "extra": 1, "zzz": 2}, "unknown field(s): 'extra', 'zzz'"),
        ({"timeout": 1}, "missing field 'member'"),
        ({"member": []}, "field 'member' must be dict, got list"),
    ],
)
def test_field_checks_name_what_is_wrong(body: dict, message: str) -> None:
    with pytest.raises(HttpError) as e:
        _expect(body, *QUORUM_FIELDS)
    assert e.value.status == 400 and e.value.message == message


def test_well_formed_bodies_pass() -> None:
    _expect({"member": {}, "timeout": 60, "known": "r-1"}, *QUORUM_FIELDS)
    _expect({"member": {}, "timeout": 0.5}, *QUORUM_FIELDS)


def test_collect_less_freezes_and_raises_the_threshold_in_its_process_only() -> None:
    code = (
        "import gc; from ftlaunch.lighthouse.server import collect_less; collect_less(); "
        "print(gc.get_threshold(), gc.get_freeze_count() > 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == [f"({GC_THRESHOLDS[0]},", f"{GC_THRESHOLDS[1]},", f"{GC_THRESHOLDS[2]})", "True"]
    import gc

    assert gc.get_threshold() != GC_THRESHOLDS  # importing the server changed nothing here
