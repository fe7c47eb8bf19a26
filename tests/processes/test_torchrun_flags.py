"""Every torchrun flag of the installed torch, walked from torch's own parser: ``ftlaunch`` accepts it
with torchrun's meaning (checked down to the agent's ``LaunchConfig``) or refuses it with a one-line
reason. A new torch flag fails `test_every_torchrun_flag_is_decided` until it is decided."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys

import pytest
from workers.helpers import FTLAUNCH, WORKER, alive, finish, kill_tree, run, start, wait_for

from ftlaunch.errors import ConfigurationError
from ftlaunch.launcher import torchrun_flags
from ftlaunch.launcher.cli import build_parser, options_from_args
from ftlaunch.launcher.options import LaunchOptions
from ftlaunch.launcher.torchrun_flags import TORCHRUN_FLAGS, launch_config, torchrun_actions

#: One value per torchrun flag that ftlaunch accepts, and what it becomes in `LaunchOptions`
#: (None: accepted without a field of its own, e.g. a no-op or the entrypoint mode).
ACCEPTED: dict[str, tuple[list[str], tuple[str, object] | None]] = {
    "nnodes": (["1"], None),
    "nproc_per_node": (["3"], ("nproc_per_node", 3)),
    "rdzv_backend": (["ftlaunch"], None),
    "rdzv_endpoint": (["lh.example:29510"], ("lighthouse", "lh.example:29510")),
    "rdzv_id": (["job7"], ("run_id", "job7")),
    "rdzv_conf": (["join_timeout=30"], ("rdzv_conf", {"join_timeout": "30"})),
    "standalone": ([], None),
    "max_restarts": (["5"], ("max_restarts", 5)),
    "monitor_interval": (["0.5"], ("monitor_interval", 0.5)),
    "start_method": (["fork"], ("start_method", "fork")),
    "event_log_handler": (["console"], ("event_log_handler", "console")),
    "role": (["trainer"], ("role", "trainer")),
    "module": ([], ("args", ["-u", "-m", "json.tool"])),
    "no_python": ([], ("entrypoint", "true")),
    "run_path": ([], ("run_path", True)),
    "log_dir": (["/tmp/ftlogs"], ("log_dir", "/tmp/ftlogs")),
    "redirects": (["1"], ("redirects", "1")),
    "tee": (["2"], ("tee", "2")),
    "local_ranks_filter": (["0,1"], ("local_ranks_filter", "0,1")),
    "duplicate_stdout_filters": (["loss,step"], ("duplicate_stdout_filters", ["loss", "step"])),
    "duplicate_stderr_filters": (["Error"], ("duplicate_stderr_filters", ["Error"])),
    "node_rank": (["0"], None),
    "master_addr": (["localhost"], None),
    "master_port": None,  # never accepted
    "local_addr": (["127.0.0.1"], ("local_addr", "127.0.0.1")),
    "logs_specs": (["ftlaunch_test_specs"], ("logs_specs", "ftlaunch_test_specs")),  # installed by a fixture
    "numa_binding": (["node"], ("numa_binding", "node")),
    "signals_to_handle": (["SIGTERM,SIGUSR1"], ("signals_to_handle", "SIGTERM,SIGUSR1")),
    "shutdown_timeout": (["7"], ("shutdown_timeout", 7)),
    "virtual_local_rank": ([], ("virtual_local_rank", True)),
}

#: The training script a flag needs instead of the test worker.
SCRIPT = {"module": "json.tool", "no_python": "true"}

#: One value per refusable flag and the reason ftlaunch must give.
REFUSED: dict[str, tuple[str, str]] = {
    "nnodes": ("2", "one node on this machine"),
    "rdzv_backend": ("c10d", "always use the ftlaunch rendezvous"),
    "node_rank": ("1", "its node rank is 0"),
    "master_addr": ("10.1.2.3", "rank 0 runs on this machine"),
    "master_port": ("29511", "binds its own free port"),
    "logs_specs": ("no_such_logs_spec", "no entry point named 'no_such_logs_spec'"),
    "event_log_handler": ("no_such_handler", "not a registered torchelastic event log handler"),
    "signals_to_handle": ("SIGNOPE", "SIGNOPE is not a signal"),
}


def _flag_dests() -> set[str]:
    return {a.dest for a in torchrun_actions()}


def test_every_torchrun_flag_is_decided() -> None:
    """The drift guard: torch's parser and ftlaunch's table name the same flags."""
    torch_flags = _flag_dests()
    assert torch_flags - set(TORCHRUN_FLAGS) == set(), "new torchrun flags: decide them in TORCHRUN_FLAGS"
    assert set(TORCHRUN_FLAGS) - torch_flags == set(), "flags this torch's torchrun no longer has"
    assert set(ACCEPTED) == torch_flags  # and this test covers each one


def test_ftlaunch_parses_every_option_string_of_torchrun() -> None:
    ours = {s for a in build_parser()._actions for s in a.option_strings}
    for action in torchrun_actions():
        assert set(action.option_strings) <= ours, action.option_strings


@pytest.fixture
def logs_specs_entry_point(tmp_path, monkeypatch) -> str:
    """A real ``torchrun.logs_specs`` entry point: an installed-distribution record on sys.path."""
    import importlib

    dist = tmp_path / "ftlaunch_test_specs-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ftlaunch-test-specs\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[torchrun.logs_specs]\nftlaunch_test_specs = ftlaunch_test_specs_mod:Specs\n"
    )
    (tmp_path / "ftlaunch_test_specs_mod.py").write_text(
        "from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs\n\n\n"
        "class Specs(DefaultLogsSpecs):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return "ftlaunch_test_specs"


@pytest.mark.parametrize("dest", sorted(d for d, case in ACCEPTED.items() if case is not None))
def test_accepted_flag_reaches_the_options(dest: str, logs_specs_entry_point: str) -> None:
    case = ACCEPTED[dest]
    assert case is not None
    values, effect = case
    action = next(a for a in torchrun_actions() if a.dest == dest)
    for spelling in action.option_strings:  # every spelling: --nproc-per-node and --nproc_per_node
        opts = options_from_args([spelling, *values, SCRIPT.get(dest, WORKER)])
        if effect is not None:
            field, expected = effect
            assert getattr(opts, field) == expected, (spelling, getattr(opts, field))


@pytest.mark.parametrize("dest", sorted(REFUSED))
def test_refused_flag_gives_its_reason(dest: str, capsys) -> None:
    value, reason = REFUSED[dest]
    flag = "--" + dest.replace("_", "-")
    with pytest.raises(SystemExit) as e:
        options_from_args([flag, value, WORKER])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ftlaunch: error: {flag} {value}: ") and reason in err[0], err


def test_torchruns_own_master_port_default_is_not_refused() -> None:
    """torch before 2.13 gives ``--master-port`` the default 29500 (2.13's parser: None), so an
    untouched flag reads 29500 there: refusing it refused every ``ftlaunch`` command on that torch."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--master-port", "--master_port", type=int, default=29500)
    actions = [a for a in parser._actions if a.dest == "master_port"]
    torchrun_flags.check(parser.parse_args([]), actions)  # no error
    with pytest.raises(ConfigurationError, match="binds its own free port"):
        torchrun_flags.check(parser.parse_args(["--master-port", "29511"]), actions)


def test_a_torch_whose_torchrun_lacks_a_newer_flag(monkeypatch) -> None:
    """``--shutdown-timeout`` is new in torch 2.13: on an older torch ``ftlaunch`` has no such flag
    (it copies the installed torchrun's) and must still build every group's config."""
    real = torchrun_flags.torchrun_parser

    def older() -> argparse.ArgumentParser:
        parser = real()
        action = next(a for a in parser._actions if a.dest == "shutdown_timeout")
        parser._actions.remove(action)
        for group in parser._action_groups:
            if action in group._group_actions:
                group._group_actions.remove(action)
        for spelling in action.option_strings:
            del parser._option_string_actions[spelling]
        return parser

    monkeypatch.setattr(torchrun_flags, "torchrun_parser", older)
    assert "--shutdown-timeout" not in {s for a in build_parser()._actions for s in a.option_strings}
    opts = options_from_args(["--grace-period", "9", WORKER])
    assert opts.shutdown_timeout is None and opts.agent_shutdown_timeout == 7
    config = launch_config(opts, run_id="j", log_dir="/tmp", lighthouse="h:1", rdzv_configs={},
                           log_line_prefix_template="")  # fmt: skip
    assert config.run_id == "j"


def test_ftlaunch_defaults_that_differ_from_torchrun() -> None:
    opts = options_from_args([WORKER])
    assert opts.max_restarts == 3 and opts.tee == "3"
    assert build_parser().parse_args([WORKER]).rdzv_backend == "ftlaunch"


def test_pet_environment_defaults_are_torchruns(monkeypatch) -> None:
    """torchrun reads ``PET_<FLAG>`` as the default of every flag; so does ftlaunch, over its own defaults."""
    monkeypatch.setenv("PET_MAX_RESTARTS", "7")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "2")
    opts = options_from_args([WORKER])
    assert (opts.max_restarts, opts.nproc_per_node) == (7, 2)


def test_lighthouse_and_rdzv_endpoint_must_agree(capsys) -> None:
    assert options_from_args(["--lighthouse", "h:1", "--rdzv-endpoint", "h:1", WORKER]).lighthouse == "h:1"
    with pytest.raises(SystemExit):
        options_from_args(["--lighthouse", "h:1", "--rdzv-endpoint", "h:2", WORKER])
    assert "name different lighthouses" in capsys.readouterr().err


def test_logs_specs_entry_point_is_loaded_by_the_agent(logs_specs_entry_point: str) -> None:
    opts = options_from_args(["--logs-specs", logs_specs_entry_point, WORKER])
    config = launch_config(
        opts,
        run_id="j",
        log_dir="/tmp/x",
        lighthouse="http://127.0.0.1:1",
        rdzv_configs={},
        log_line_prefix_template="",
    )
    specs = config.logs_specs
    assert (
        type(specs).__qualname__ == "Specs" and specs.root_log_dir == "/tmp/x"
    )  # loaded by torch's own code


def test_an_unknown_future_flag_is_refused_unless_default() -> None:
    """What a newer torch's flag does before it is decided: parsed, listed, refused when used."""
    p = argparse.ArgumentParser()
    future = p.add_argument("--future-flag", default="off")
    torchrun_flags.check(argparse.Namespace(future_flag="off"), [future])
    with pytest.raises(
        ConfigurationError, match="--future-flag: this torch's torchrun flag is not supported"
    ):
        torchrun_flags.check(argparse.Namespace(future_flag="on"), [future])


def test_bad_local_ranks_filter_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="--local-ranks-filter 'a,b'"):
        LaunchOptions(entrypoint="x", local_ranks_filter="a,b")


@pytest.mark.timeout(60)
def test_help_lists_every_torchrun_flag() -> None:
    res = run([*FTLAUNCH, "--help"], timeout=50)
    assert res.returncode == 0, res.stderr
    for action in torchrun_actions():
        for spelling in action.option_strings:
            assert spelling in res.stdout, spelling


def test_agent_launch_config_carries_every_flag(caplog, monkeypatch) -> None:
    """The agent's LaunchConfig comes from torch's own config_from_args: each accepted flag arrives with
    torchrun's meaning; the rendezvous, run id and prefix are the group's."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.numa.binding import AffinityMode

    opts = LaunchOptions(
        entrypoint=sys.executable,
        args=["-u", WORKER],
        nproc_per_node=2,
        max_restarts=4,
        monitor_interval=0.3,
        start_method="forkserver",
        role="trainer",
        event_log_handler="console",
        tee="2",
        redirects="1",
        local_ranks_filter="1",
        duplicate_stdout_filters=["loss"],
        duplicate_stderr_filters=["Err"],
        local_addr="127.0.0.1",
        numa_binding="socket",
        signals_to_handle="SIGTERM,SIGUSR2",
        virtual_local_rank=True,
        shutdown_timeout=9,
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # launch_config sets it, as torchrun does
    with caplog.at_level(logging.WARNING):
        config = launch_config(
            opts,
            run_id="job-rg1",
            log_dir="/tmp/x",
            lighthouse="http://127.0.0.1:1",
            rdzv_configs={"replica_group_id": "1"},
            log_line_prefix_template="[rg1/r${rank}] ",
        )
    assert "master_addr is only used" not in caplog.text  # torchrun's warning for an empty endpoint
    assert "Setting OMP_NUM_THREADS" not in caplog.text  # set quietly, once per group
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 1, 2)

    assert (config.max_restarts, config.monitor_interval, config.start_method, config.role) == (
        4,
        0.3,
        "forkserver",
        "trainer",
    )
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == (
        "ftlaunch",
        "http://127.0.0.1:1",
        "job-rg1",
    )
    assert config.rdzv_configs["replica_group_id"] == "1"
    assert config.log_line_prefix_template == "[rg1/r${rank}] "
    assert config.event_log_handler == "console" and config.local_addr == "127.0.0.1"
    assert config.duplicate_stdout_filters == ["loss"] and config.duplicate_stderr_filters == ["Err"]
    assert config.signals_to_handle == "SIGTERM,SIGUSR2" and config.virtual_local_rank is True
    assert config.numa_options is not None and config.numa_options.affinity_mode == AffinityMode.SOCKET
    assert config.shutdown_timeout == 9
    specs = config.logs_specs
    assert isinstance(specs, DefaultLogsSpecs) and specs.root_log_dir == "/tmp/x"
    # Nothing of LaunchConfig is left unset by accident: every field is what torchrun would set or ours.
    assert {f.name for f in dataclasses.fields(config)} >= {
        "numa_options",
        "virtual_local_rank",
        "signals_to_handle",
    }


@pytest.mark.timeout(120)
def test_signals_to_handle_stop_the_job_and_reach_the_workers(tmp_path) -> None:
    """``--signals-to-handle SIGTERM,SIGUSR1``: SIGUSR1 to ftlaunch stops the job (exit 128+10), the
    agents forward it and every process is gone."""
    proc = start(
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--grace-period",
            "5",
            "--signals-to-handle",
            "SIGTERM,SIGUSR1",
            "--no-summary",
            WORKER,
            "--steps",
            "100000",
            "--step-time",
            "0.05",
        ]
    )
    try:
        import psutil

        def workers() -> list[int]:
            try:
                return [
                    p.pid
                    for p in psutil.Process(proc.pid).children(recursive=True)
                    if "worker.py" in " ".join(p.cmdline())
                ]
            except psutil.Error:
                return []

        wait_for(lambda: len(workers()) == 2, timeout=60, what="both workers to start")
        pids = workers()
        proc.send_signal(signal.SIGUSR1)
        res = finish(proc, timeout=60)
    finally:
        kill_tree(proc.pid)
    assert res.returncode == 128 + signal.SIGUSR1, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == "ftlaunch: error: stopped by SIGUSR1"
    assert not [pid for pid in pids if alive(pid)]


@pytest.mark.parametrize(("nproc", "on_host", "expected"), [(1, 2, "1"), (1, 1, None), (2, None, "1")])
def test_omp_threads_are_one_when_the_host_runs_several_workers(
    monkeypatch: pytest.MonkeyPatch, nproc: int, on_host: int | None, expected: str | None
) -> None:
    """Two one-worker groups on one host count as two workers: each gets one intra-op thread
    (torch's default, the core count, makes them spin against each other's collectives)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    launch_config(
        LaunchOptions(entrypoint="train.py", nproc_per_node=nproc),
        run_id="job-rg0",
        log_dir="/tmp/x",
        lighthouse="http://127.0.0.1:1",
        rdzv_configs={"replica_group_id": "0"},
        log_line_prefix_template="[rg0/r${rank}] ",
        workers_on_host=on_host,
    )
    assert os.environ.get("OMP_NUM_THREADS") == expected
