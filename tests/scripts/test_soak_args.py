"""scripts/soak.py's runs: which lighthouse outage the soak injects, and that the long one is run too.

No processes: the argument handling and the report's side-by-side line only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import soak  # noqa: E402

from ftlaunch.launcher.options import ChaosSpec  # noqa: E402
from ftlaunch.launcher.supervisor import LIGHTHOUSE_CHECK_S  # noqa: E402


def parsed(*argv: str) -> object:
    """The namespace `soak.main` would run with (its parser, without running anything)."""
    captured: dict[str, object] = {}

    def fake_run(args: object, chaos: str | None, label: str) -> soak.Run:
        captured.setdefault("args", args)
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(soak, "run_ftlaunch", fake_run)
        with pytest.raises(SystemExit):
            soak.main(list(argv))
    return captured["args"]


def test_the_default_outage_is_the_launchers_own_restart_and_the_long_one_runs_beside() -> None:
    args = parsed()
    assert args.lighthouse_down == LIGHTHOUSE_CHECK_S  # the supervisor restarts it at its next check
    assert ChaosSpec.parse(soak.chaos_spec(args)).lighthouse_down == LIGHTHOUSE_CHECK_S  # a valid spec
    long_args = soak.long_outage_args(args)
    assert long_args is not None and long_args.lighthouse_down == 12.0  # always run and reported
    assert "lighthouse_down=12" in soak.chaos_spec(long_args) and args.lighthouse_down == LIGHTHOUSE_CHECK_S
    assert soak.long_outage_args(parsed("--long-outage", "0")) is None
    assert soak.long_outage_args(parsed("--lighthouse-at", "-1")) is None  # no crash: nothing to vary
    assert soak.long_outage_args(parsed("--lighthouse-down", "12")) is None  # the same run twice


def test_both_goodputs_are_printed_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    short, long_ = (
        {"goodput": 0.93, "chaos": "x,lighthouse_down=0.05"},
        {"goodput": 0.79, "chaos": "x,lighthouse_down=12"},
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(soak, "print_report", lambda r: None)
        soak.print_long_outage(short, long_)
    out = capsys.readouterr().out
    assert "93.0% with the launcher's own lighthouse restart" in out and "79.0% with the long outage" in out
    assert "lighthouse kept down 12 s" in out
