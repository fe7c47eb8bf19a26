"""The ``ftlaunch`` command line: parsing, validation, one-line errors (real subprocesses for the
errors, since their output format and exit status are the contract)."""

from __future__ import annotations

import socket
import sys

import pytest
from workers.helpers import FTLAUNCH, WORKER, free_port, run

from ftlaunch.errors import ConfigurationError
from ftlaunch.launcher.cli import options_from_args
from ftlaunch.launcher.options import ChaosSpec, LaunchOptions


def test_defaults_and_torchrun_style_command() -> None:
    opts = options_from_args([WORKER, "--steps", "3"])
    assert opts.replicas == 2 and opts.nproc_per_node == 1 and opts.min_replicas == 1
    assert opts.entrypoint == sys.executable
    assert opts.args == ["-u", WORKER, "--steps", "3"]  # what torchrun builds: python -u script args
    assert opts.tee == "3" and opts.max_restarts == 3 and opts.chaos is None


def test_torchrun_flag_spellings() -> None:
    opts = options_from_args(
        [
            "--nproc_per_node",
            "3",
            "--max_restarts",
            "5",
            "--monitor_interval",
            "0.5",
            "--rdzv_id",
            "job7",
            "--rdzv_conf",
            "join_timeout=30,read_timeout=9",
            "--standalone",
            "--role",
            "trainer",
            "--replicas",
            "4",
            "--min-replicas",
            "2",
            WORKER,
        ]
    )
    assert (opts.nproc_per_node, opts.max_restarts, opts.monitor_interval) == (3, 5, 0.5)
    assert opts.run_id == "job7" and opts.role == "trainer"
    assert opts.rdzv_conf == {"join_timeout": "30", "read_timeout": "9"}
    assert (opts.replicas, opts.min_replicas) == (4, 2)


def test_script_arguments_are_not_parsed_as_ours() -> None:
    opts = options_from_args(["--replicas", "1", WORKER, "--replicas", "9", "-m"])
    assert opts.replicas == 1
    assert opts.args[-3:] == ["--replicas", "9", "-m"]


def test_module_and_no_python() -> None:
    opts = options_from_args(["-m", "json.tool", "--help"])
    assert opts.args[:3] == ["-u", "-m", "json.tool"]
    opts = options_from_args(["--no-python", "true"])
    assert opts.entrypoint == "true" and opts.args == []
    opts = options_from_args(["--run-path", WORKER, "--steps", "2"])
    assert opts.run_path and opts.args == [WORKER, "--steps", "2"]


def test_lighthouse_alias_rdzv_endpoint() -> None:
    assert options_from_args(["--rdzv-endpoint", "h:1", WORKER]).lighthouse == "h:1"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5", ChaosSpec(every=5.0)),
        ("every=2.5,count=3,seed=1", ChaosSpec(every=2.5, count=3, seed=1)),
        (
            "steps=40/20,group=1,signal=sigstop,stop_for=2",
            ChaosSpec(steps=(20, 40), group=1, signal="STOP", stop_for=2),
        ),
        ("every=1,target=agent,start=0", ChaosSpec(every=1, target="agent", start=0.0)),
        ("steps=20,group=1,slow=2,slow_for=60", ChaosSpec(steps=(20,), group=1, slow=2.0, slow_for=60.0)),
        ("every=1m,slow=1.5x", ChaosSpec(every=60.0, slow=1.5)),
    ],
)
def test_chaos_spec_parse(text: str, expected: ChaosSpec) -> None:
    assert ChaosSpec.parse(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("group=1", "every=SECONDS or steps"),
        ("every=-1", "every='-1' is out of range: use a duration of 10 ms to 24 h"),
        ("every=x", "every='x' is not a duration"),
        ("every=inf", "is not a duration"),
        ("every=1,stop_for=1e-9", "stop_for='1e-9' is out of range"),
        ("lighthouse=5,lighthouse_down=nan", "is not a duration"),
        ("every=1,bogus=2", "unknown key"),
        ("every=1,signal=HUP", "must be one of"),
        ("every=1,target=agent,signal=STOP", "applies to workers"),
        ("steps=a/b", "expected integers"),
        ("every=1,every=2", "given twice"),
        ("every", "not key=value"),
        ("steps=1,slow=1", "slow=1 must be > 1 and <= 4"),
        ("steps=1,slow=5", "slow=5 must be > 1 and <= 4"),
        ("steps=1,slow=nan", "slow=nan must be"),
        ("steps=1,slow=fast", "slow='fast' is not a number"),
        ("steps=1,slow=2,signal=STOP", "takes no signal= or target="),
        ("steps=1,target=agent,slow=2", "takes no signal= or target="),
        ("steps=1,slow=2,slow_for=0", "slow_for='0' is out of range"),
    ],
)
def test_chaos_spec_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        ChaosSpec.parse(text)


def test_options_validation() -> None:
    with pytest.raises(ConfigurationError, match="--replicas=0 is out of range: use an integer 1 to 1024"):
        LaunchOptions(entrypoint="x", replicas=0)
    with pytest.raises(ConfigurationError, match="more than the 1024 replica groups"):
        LaunchOptions(entrypoint="x", replicas=1000, spares=100)
    with pytest.raises(ConfigurationError, match="--monitor-interval=1e-09 is out of range"):
        LaunchOptions(entrypoint="x", monitor_interval=1e-9)
    with pytest.raises(ConfigurationError, match="--grace-period=inf is out of range"):
        LaunchOptions(entrypoint="x", grace_period=float("inf"))
    with pytest.raises(ConfigurationError, match="--heartbeat-timeout=nan is out of range"):
        LaunchOptions(entrypoint="x", heartbeat_timeout=float("nan"))
    with pytest.raises(ConfigurationError, match="--min-replicas must be in 1..2"):
        LaunchOptions(entrypoint="x", replicas=2, min_replicas=3)
    with pytest.raises(ConfigurationError, match="only 2 groups"):
        LaunchOptions(entrypoint="x", replicas=2, chaos=ChaosSpec(every=1, group=2))
    with pytest.raises(ConfigurationError, match="--stragglers 'evict' must be one of report, replace"):
        LaunchOptions(entrypoint="x", stragglers="evict")
    with pytest.raises(ConfigurationError, match="the one at --lighthouse has its own"):
        LaunchOptions(entrypoint="x", stragglers="replace", lighthouse="http://h:1")


def test_the_health_check_reaches_every_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--health-check`` (else ``FTLAUNCH_HEALTH_CHECK``) and its timeout go into every agent's
    environment, where the group's rendezvous reads them."""
    from ftlaunch import env

    monkeypatch.delenv("FTLAUNCH_HEALTH_CHECK", raising=False)
    opts = options_from_args(
        ["--health-check", "python -m ftlaunch.health", "--health-check-timeout", "30s", WORKER]
    )
    assert (opts.health_check, opts.health_check_timeout) == ("python -m ftlaunch.health", 30.0)
    assert env.health_check_environ(opts.health_check, opts.health_check_timeout) == {
        "FTLAUNCH_HEALTH_CHECK": "python -m ftlaunch.health",
        "FTLAUNCH_HEALTH_CHECK_TIMEOUT": "30",
    }
    assert options_from_args([WORKER]).health_check is None
    monkeypatch.setenv("FTLAUNCH_HEALTH_CHECK", "true")
    assert options_from_args([WORKER]).health_check == "true"
    assert env.health_check_environ(None, 5.0) == {}


def test_the_stragglers_policy_reaches_the_lighthouse(monkeypatch: pytest.MonkeyPatch) -> None:
    from ftlaunch import env
    from ftlaunch.launcher.lighthouse_keeper import LighthouseKeeper
    from ftlaunch.launcher.output import Console

    assert options_from_args([WORKER]).stragglers is None
    assert options_from_args(["--stragglers", "replace", WORKER]).stragglers == "replace"
    seen = []
    monkeypatch.setattr(
        "ftlaunch.launcher.lighthouse_keeper.open_job_lighthouse",
        lambda _addr, settings: seen.append(settings),
    )
    for given, environ, policy in (
        (None, None, "report"),
        (None, "replace", "replace"),
        ("report", "replace", "report"),
    ):
        if environ is None:
            monkeypatch.delenv(env.FTLAUNCH_STRAGGLERS, raising=False)
        else:
            monkeypatch.setenv(env.FTLAUNCH_STRAGGLERS, environ)
        LighthouseKeeper(LaunchOptions(entrypoint="x", stragglers=given), "t", Console()).open()
        assert seen[-1].stragglers == policy


def _one_line_error(args: list[str], expected: str) -> None:
    res = run([*FTLAUNCH, *args], timeout=60)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("ftlaunch: error: ") and expected in lines[0], lines[0]
    assert res.stdout == ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args, expected",
    [
        (["does/not/exist.py"], "training script not found: does/not/exist.py"),
        (["--replicas", "0", WORKER], "--replicas=0 is out of range"),
        (["--replicas", "two", WORKER], "'two' is not an integer"),
        (["--heartbeat-timeout", "soon", WORKER], "'soon' is not a duration"),
        (["--heartbeat-timeout", "1e-9", WORKER], "'1e-9' is out of range: use a duration of 50 ms to 24 h"),
        (["--log-dir", "/dev/null/x", WORKER], "--log-dir /dev/null/x: cannot create it: Not a directory"),
        (["--bogus-flag", WORKER], "unrecognized arguments: --bogus-flag"),
        (["--min-replicas", "3", "--replicas", "2", WORKER], "--min-replicas must be in 1..2"),
        (["--nnodes", "2", WORKER], "one `torchrun --rdzv-backend ftlaunch` per node"),
        (["--chaos", "every=-2", WORKER], "every='-2' is out of range"),
        (["--chaos", "steps=5,slow=9", WORKER], "slow=9 must be > 1 and <= 4"),
        (["--stragglers", "evict", WORKER], "argument --stragglers: invalid choice: 'evict'"),
        (["--tee", "7", WORKER], "--tee '7'"),
        (["-m", "no_such_module_xyz"], "module not found: no_such_module_xyz"),
        (["--no-python", "no-such-program-xyz"], "program not found"),
        (["--rdzv-backend", "c10d", WORKER], "always use the ftlaunch rendezvous"),
        (["--nproc-per-node", "lots", WORKER], "must be an integer or cpu"),
        ([], "the following arguments are required: training_script"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], expected: str) -> None:
    _one_line_error(args, expected)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--replicas", "100000"], "--replicas=100000 is out of range: use an integer 1 to 1024"),
        (["--replicas", "1000", "--spares", "100"], "more than the 1024 replica groups"),
        (["--nproc-per-node", "5000"], "--nproc-per-node=5000 is out of range: use an integer 1 to 1024"),
        (["--join-timeout", "inf"], "argument --join-timeout/--join_timeout: 'inf' is not a duration"),
        (["--join-timeout", "-1"], "'-1' is out of range: use a duration of 0 s to 24 h"),
        (["--heartbeat-timeout", "nan"], "'nan' is not a duration"),
        (
            ["--grace-period", "0"],
            "--grace-period/--grace_period: '0' is out of range: use a duration of 1 s to 1 h",
        ),
        (
            ["--monitor-interval", "1e-7"],
            "--monitor-interval=1e-07 is out of range: use a duration of 10 ms to 60 s",
        ),
        (["--monitor-interval", "inf"], "--monitor-interval=inf is out of range"),
        (
            ["--shutdown-timeout", "99999"],
            "--shutdown-timeout=99999 is out of range: use an integer 0 to 3600",
        ),
        (["--chaos", "every=1,stop_for=inf"], "stop_for='inf' is not a duration"),
        (["--health-check-timeout", "0"], "'0' is out of range: use a duration of 0.1 s to 1 h"),
    ],
)
def test_every_number_flag_is_bounded(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """No duration flag takes 0, a negative, NaN or inf where they would hang or spin, and no count
    forks a machine to a standstill (the shared bounds of `ftlaunch.env`)."""
    with pytest.raises(SystemExit) as exit_:
        options_from_args([*args, WORKER])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("ftlaunch: error: ") and expected in err, err
    assert len(err.strip().splitlines()) == 1


def test_durations_take_the_one_grammar() -> None:
    opts = options_from_args(
        ["--join-timeout", "1.5m", "--heartbeat-timeout", "2s", "--grace-period", "30", WORKER]
    )
    assert (opts.join_timeout, opts.heartbeat_timeout, opts.grace_period) == (90.0, 2.0, 30.0)
    assert ChaosSpec.parse("every=1.5m,stop_for=500e-3").every == 90.0


def test_a_bad_log_level_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ftlaunch.launcher.cli import main

    monkeypatch.setenv("LOGLEVEL", "chatty")
    with pytest.raises(SystemExit) as exit_:
        main([WORKER])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert (
        err == "ftlaunch: error: environment variable LOGLEVEL='chatty' is not one of debug, info, warning, "
        "error, critical\n"
    )


@pytest.mark.parametrize(
    "variable, value",
    [
        ("FTLAUNCH_HEAL_CLAIMS", "maybe"),
        ("FTLAUNCH_ZYGOTE", "2"),
        ("FTLAUNCH_QUANTIZE", "3"),
        ("FTLAUNCH_TIMEOUT", "1h"),
        ("FTLAUNCH_HEALTH_CHECK_TIMEOUT", "forever"),
    ],
)
def test_the_workers_environment_is_checked_before_anything_starts(
    variable: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ftlaunch.launcher.cli import main

    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_:
        main([WORKER])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("ftlaunch: error: "), err
    assert f"environment variable {variable}='{value}'" in err and len(err.splitlines()) == 1, err


@pytest.mark.timeout(120)
def test_port_in_use_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _one_line_error(
            ["--lighthouse-bind", f"127.0.0.1:{port}", WORKER],
            f"cannot start the lighthouse on 127.0.0.1:{port}",
        )


@pytest.mark.timeout(120)
def test_unreachable_lighthouse_is_one_line() -> None:
    port = free_port()  # nothing listens there
    _one_line_error(
        ["--lighthouse", f"127.0.0.1:{port}", WORKER], f"no lighthouse answers at http://127.0.0.1:{port}"
    )


@pytest.mark.timeout(60)
def test_help_names_the_flags() -> None:
    res = run([*FTLAUNCH, "--help"], timeout=30)
    assert res.returncode == 0
    for flag in (
        "--replicas",
        "--nproc-per-node",
        "--max-restarts",
        "--chaos",
        "--lighthouse",
        "--min-replicas",
        "--join-timeout",
        "--heartbeat-timeout",
        "--lighthouse-bind",
        "--tee",
        "--redirects",
        "--log-dir",
        "--run-path",
        "--no-python",
        "--standalone",
        "--rdzv-conf",
        "REPLICA_GROUP_ID",
        "exit status",
    ):
        assert flag in res.stdout, flag
