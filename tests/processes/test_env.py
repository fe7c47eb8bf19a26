"""ftlaunch.env: every variable read in one module, with one grammar, and in README's table.

The launcher->worker contract is written once and parsed once; the AST of every other module reads
no environment; a flag reads ``0``/``false``/``no``/``off`` alike; durations and counts have bounds;
and a bad value, or an unreachable lighthouse, ends a script in one line, not a traceback.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from workers.helpers import free_port

from ftlaunch import env, timeouts
from ftlaunch.bootstrap import prestart, zygote_proxy
from ftlaunch.env import Count, Duration, GroupEnv, JobEnv, SyncEnv, WorkerEnv
from ftlaunch.errors import ConfigurationError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ftlaunch"


def test_round_trip() -> None:
    job = JobEnv(replica_group_id=1, num_replica_groups=3, lighthouse="127.0.0.1:29510", token="t")
    assert job.lighthouse == "http://127.0.0.1:29510" and job.replica_id == "rg1"
    assert JobEnv.from_environ(job.to_environ()) == job
    assert env.FTLAUNCH_TOKEN not in JobEnv(0, 1, "http://h:1").to_environ()
    placed = JobEnv(1, 3, "http://10.0.0.1:5", local_addr="10.0.0.7")
    assert placed.to_environ()[env.FTLAUNCH_LOCAL_ADDR] == "10.0.0.7"
    assert JobEnv.from_environ(placed.to_environ()) == placed


def test_explicit_values_win_and_torchft_name_is_accepted() -> None:
    environ = {
        env.REPLICA_GROUP_ID: "0",
        env.NUM_REPLICA_GROUPS: "2",
        env.TORCHFT_LIGHTHOUSE: "http://[::1]:5",
    }
    job = JobEnv.from_environ(environ, replica_group_id=1)
    assert (job.replica_group_id, job.num_replica_groups, job.lighthouse) == (1, 2, "http://[::1]:5")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "(?s)REPLICA_GROUP_ID and FTLAUNCH_LIGHTHOUSE not set.*ftlaunch --replicas"),
        ({env.REPLICA_GROUP_ID: "0", env.FTLAUNCH_LIGHTHOUSE: "h:1"}, "NUM_REPLICA_GROUPS is not set"),
        (
            {env.REPLICA_GROUP_ID: "abc", env.NUM_REPLICA_GROUPS: "2", env.FTLAUNCH_LIGHTHOUSE: "h:1"},
            "not an integer",
        ),
        (
            {env.REPLICA_GROUP_ID: "2", env.NUM_REPLICA_GROUPS: "2", env.FTLAUNCH_LIGHTHOUSE: "h:1"},
            r"outside 0\.\.1",
        ),
        (
            {env.REPLICA_GROUP_ID: "0", env.NUM_REPLICA_GROUPS: "0", env.FTLAUNCH_LIGHTHOUSE: "h:1"},
            "NUM_REPLICA_GROUPS='0' is out of range: use an integer 1 or more",
        ),
        (
            {env.REPLICA_GROUP_ID: "0", env.NUM_REPLICA_GROUPS: "1", env.FTLAUNCH_LIGHTHOUSE: "ftp://x"},
            "FTLAUNCH_LIGHTHOUSE='ftp://x' is not a lighthouse address",
        ),
    ],
)
def test_bad_environment_is_a_configuration_error(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        JobEnv.from_environ(environ)


def test_group_env() -> None:
    g = GroupEnv.from_environ(
        {
            env.RANK: "1",
            env.WORLD_SIZE: "2",
            env.MASTER_ADDR: "h",
            env.MASTER_PORT: "5",
            env.TORCHELASTIC_RESTART_COUNT: "3",
        }
    )
    # Outside the ftlaunch rendezvous the incarnation is the restart count (one-node groups) ...
    assert g == GroupEnv(rank=1, world_size=2, master_addr="h", master_port=5, restart_count=3, incarnation=3)
    assert GroupEnv.from_environ({}) == GroupEnv()
    # ... under it, the group's round count, the same on every node (this node restarted 0 times).
    g = GroupEnv.from_environ({env.TORCHELASTIC_RESTART_COUNT: "0", env.FTLAUNCH_GROUP_INCARNATION: "1"})
    assert (g.restart_count, g.incarnation) == (0, 1)
    with pytest.raises(ConfigurationError, match="outside WORLD_SIZE"):
        GroupEnv.from_environ({env.RANK: "2", env.WORLD_SIZE: "2"})


# ================================================================================== the grammar
@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 30.0),
        ("30s", 30.0),
        (" 2.5 ", 2.5),
        ("1.5m", 90.0),
        ("1.5M", 90.0),
        (".5", 0.5),
        ("1e-3", 0.001),
    ],
)
def test_a_duration_is_seconds_or_minutes(text: str, seconds: float) -> None:
    assert env.duration_seconds(text) == seconds
    assert timeouts.parse_duration is env.parse_duration  # one parser: the timeouts read the same


@pytest.mark.parametrize("text", ["", "soon", "30 sec", "1h", "inf", "nan", "-inf", "1e999", "30ss"])
def test_what_is_not_a_duration(text: str) -> None:
    with pytest.raises(ValueError, match="is not a (finite )?duration"):
        env.duration_seconds(text)


def test_bounds_refuse_what_does_not_do_what_the_setting_says() -> None:
    beat = Duration(0.5)
    assert beat.parse("0.5") == 0.5 and beat.parse("24m") == 1440.0 and beat.describe() == "0.5 s to 24 h"
    for text in ("0.4", "1e-9", "0", "-1", "1441m"):
        with pytest.raises(ValueError, match="is out of range: use a duration of 0.5 s to 24 h"):
            beat.parse(text)
    for value in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ConfigurationError, match="^heartbeat timeout="):
            beat.checked(value, "heartbeat timeout")
    off = Duration(1.0, off=True)
    assert off.parse("0") == 0.0 and off.describe() == "1 s to 24 h, or 0 (off)"
    with pytest.raises(ValueError, match="out of range"):
        off.parse("0.5")
    assert Duration(0.01, 60.0).describe() == "10 ms to 60 s"
    groups = Count(1, 1024)
    assert groups.parse(" 7 ") == 7
    for text, reason in (
        ("0", "out of range: use an integer 1 to 1024"),
        ("2.0", "not an integer"),
        ("x", "not an integer"),
    ):
        with pytest.raises(ValueError, match=reason):
            groups.parse(text)
    with pytest.raises(ValueError, match="not an integer"):
        groups.check(True)


def test_worker_settings_are_read_once_with_their_bounds() -> None:
    assert WorkerEnv.from_environ({}) == WorkerEnv()
    tuned = WorkerEnv.from_environ(
        {
            env.FTLAUNCH_BACKEND: "Baby_Gloo",
            env.FTLAUNCH_TRANSPORT: "http",
            env.FTLAUNCH_OUTAGE_STEPS: "no",
            env.FTLAUNCH_HEAL_CLAIMS: "off",
            env.FTLAUNCH_LIGHTHOUSE_OUTAGE: "5m",
            env.FTLAUNCH_PROGRESS_TIMEOUT: "0",
        }
    )
    assert tuned == WorkerEnv("baby-gloo", "http", False, False, 300.0, 0.0)
    assert SyncEnv.from_environ({}) == SyncEnv()
    assert SyncEnv.from_environ({env.FTLAUNCH_SYNC_EVERY: "12", env.FTLAUNCH_QUANTIZE: "4"}) == SyncEnv(
        12, quantize=4
    )
    for name, value, reason in (
        (env.FTLAUNCH_BACKEND, "mpi", "is not one of baby-gloo"),
        (env.FTLAUNCH_LIGHTHOUSE_OUTAGE, "inf", "is not a duration"),
        (env.FTLAUNCH_PROGRESS_TIMEOUT, "1e-9", "is out of range: use a duration of 1 s to 24 h, or 0 (off)"),
        (env.FTLAUNCH_SYNC_EVERY, "0", "is out of range: use an integer 1 or more"),
        (env.FTLAUNCH_FRAGMENT_UPDATE_ALPHA, "2", "is out of range: use a number from 0 to 1"),
        (env.FTLAUNCH_QUANTIZE, "16", "is not one of 0, 4, 8"),
        (env.MASTER_PORT, "70000", "is out of range: use an integer 0 to 65535"),
    ):
        with pytest.raises(
            ConfigurationError, match=re.escape(f"environment variable {name}='{value}' {reason}")
        ):
            WorkerEnv.from_environ({name: value})
            SyncEnv.from_environ({name: value})
            GroupEnv.from_environ({name: value})


# ============================================================== one reader: the source is scanned
#: ``os`` names that read or change the process environment.
_OS_ENVIRON = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}

#: The only places outside env.py that touch an environment directly: (file, function) -> why.
ALLOWED_ENVIRON_ACCESS: dict[tuple[str, str], str] = {
    ("ftlaunch/bootstrap/zygote.py", "Job.run"): "a forked standby becomes the worker: it replaces its whole "
    "environment with the one the worker's proxy sent (no variable is read there)",
    ("ftlaunch/launcher/agent.py", "WorkerWatcher._tick"): "psutil's snapshot of a child's "
    "environment, parsed by env.ProcessMarks",
    ("ftlaunch/launcher/procs.py", "marks_of"): "psutil's snapshot of another process's environment, "
    "parsed by env.ProcessMarks",
}

#: env.py's readers: a call outside env.py that names an FTLAUNCH_* variable is a read outside it.
_READERS = {"flag", "duration", "count", "number", "text", "choice", "path", "is_set", "parse_duration"}


def _sources() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(ROOT)), ast.parse(path.read_text(), filename=str(path))


def _with_scopes(tree: ast.Module) -> Iterator[tuple[ast.AST, str]]:
    """Every node with the qualified name of the functions and classes around it."""

    def walk(node: ast.AST, scope: list[str]) -> Iterator[tuple[ast.AST, str]]:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = [*scope, child.name]
            yield child, ".".join(inner)
            yield from walk(child, inner)

    yield from walk(tree, [])


def _environ_access(tree: ast.Module) -> Iterator[tuple[int, str, str]]:
    """(line, scope, what) of every direct environment access: ``os.environ``, ``os.getenv``,
    ``x.environ()`` (psutil), ``from os import environ``."""
    for node, scope in _with_scopes(tree):
        if isinstance(node, ast.Attribute) and node.attr in _OS_ENVIRON:
            yield node.lineno, scope, ast.unparse(node)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in _OS_ENVIRON:
                    yield node.lineno, scope, f"from os import {alias.name}"


def _ftlaunch_reads(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, call) of every reader call naming an FTLAUNCH_* variable (``env.flag(env.FTLAUNCH_X)``,
    ``text("FTLAUNCH_X")``)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        arg = node.args[0]
        named = (
            arg.attr if isinstance(arg, ast.Attribute)
            else arg.id if isinstance(arg, ast.Name)
            else arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            else ""
        )  # fmt: skip
        if name in _READERS and named.startswith("FTLAUNCH_"):
            yield node.lineno, ast.unparse(node)


def test_nothing_outside_env_py_reads_the_environment() -> None:
    """Every variable is read through env.py: no other module touches an environment, but for the
    allow-listed places, each with its reason (a stale entry fails too)."""
    found, used = [], set()
    for rel, tree in _sources():
        if rel == "ftlaunch/env.py":
            continue
        for line, scope, what in _environ_access(tree):
            if (rel, scope) in ALLOWED_ENVIRON_ACCESS:
                used.add((rel, scope))
            else:
                found.append(f"{rel}:{line} ({scope or 'module'}): {what}")
    assert not found, "read the variable through ftlaunch/env.py instead:\n" + "\n".join(found)
    assert used == set(ALLOWED_ENVIRON_ACCESS), f"stale entries: {set(ALLOWED_ENVIRON_ACCESS) - used}"


def test_no_ftlaunch_variable_is_read_outside_env_py() -> None:
    """An FTLAUNCH_* variable is read in env.py, into a typed object (`WorkerEnv`, `SyncEnv`, ...)
    or by a function named after it, and handed down from there."""
    found = [
        f"{rel}:{line}: {call}"
        for rel, tree in _sources()
        if rel != "ftlaunch/env.py"
        for line, call in _ftlaunch_reads(tree)
    ]
    assert not found, "read these in ftlaunch/env.py:\n" + "\n".join(found)


def test_the_scans_find_each_kind_of_read() -> None:
    tree = ast.parse(
        "import os\nfrom os import getenv\nfrom ftlaunch import env\n"
        "def f(p):\n    os.environ.get('X'); os.getenv('Y'); p.environ()\n"
        "class C:\n    def g(self):\n        return env.flag(env.FTLAUNCH_ZYGOTE, True), "
        "text('FTLAUNCH_TOKEN')\n"
    )
    access = {(scope, what) for _, scope, what in _environ_access(tree)}
    assert access == {
        ("", "from os import getenv"),
        ("f", "os.environ"),
        ("f", "os.getenv"),
        ("f", "p.environ"),
    }
    assert [line for line, _ in _ftlaunch_reads(tree)] == [8, 8]


# ================================================================================== one table
def _declared() -> set[str]:
    """Every FTLAUNCH_* name env.py declares (a module constant spelled as its value)."""
    return {v for k, v in vars(env).items() if k.startswith("FTLAUNCH_") and v == k}


def _readme_rows() -> set[str]:
    """The variables in the first cells of README's environment table (``A_{B,C}_D`` expanded)."""
    section = (ROOT / "README.md").read_text().split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        for cell in re.findall(r"`([^`]+)`", line.split("|")[1]):
            m = re.fullmatch(r"(\w*)\{([\w,]+)\}(\w*)", cell)
            names.update([f"{m[1]}{part}{m[3]}" for part in m[2].split(",")] if m else [cell])
    return names


def test_every_ftlaunch_variable_has_a_readme_row_and_every_row_a_variable() -> None:
    rows, declared = _readme_rows(), _declared()
    assert declared <= set(env.ALL_FTLAUNCH_VARS), (
        f"not in ALL_FTLAUNCH_VARS: {declared - set(env.ALL_FTLAUNCH_VARS)}"
    )
    missing = sorted(v for v in env.ALL_FTLAUNCH_VARS if v not in rows)
    assert not missing, f"README.md's environment table has no row for {missing}"
    unknown = sorted(r for r in rows if r.startswith("FTLAUNCH_") and r not in declared)
    assert not unknown, f"README.md's environment table names variables env.py does not declare: {unknown}"
    others = {env.LOGLEVEL, env.PYTHON_EXEC, env.OMP_NUM_THREADS, env.CUDA_VISIBLE_DEVICES}
    assert others <= rows, f"README.md's environment table has no row for {others - rows}"


def test_every_ftlaunch_name_in_the_code_is_declared_in_env_py() -> None:
    """A misspelt variable in a message or a docstring names a variable nobody reads."""
    declared = _declared()
    found = [
        f"{path.relative_to(ROOT)}: {m[0]}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for m in re.finditer(r"\bFTLAUNCH_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())
        if m[0] not in declared
    ]
    assert not found, "names env.py does not declare:\n" + "\n".join(found)


# ================================================= flags: every spelling, through each real reader
#: Every flag variable -> how the code that uses it reads it (from this process's environment).
FLAG_READERS: dict[str, Callable[[], bool]] = {
    env.FTLAUNCH_OUTAGE_STEPS: lambda: WorkerEnv.from_environ().outage_steps,
    env.FTLAUNCH_HEAL_CLAIMS: lambda: WorkerEnv.from_environ().heal_claims,
    env.FTLAUNCH_PRESTART_FORK: prestart.fork_wanted,
    env.FTLAUNCH_ZYGOTE: zygote_proxy.enabled,
    env.FTLAUNCH_LIGHTHOUSE_REACHED: lambda: (
        JobEnv.from_environ(replica_group_id=0, num_replica_groups=1, lighthouse="h:1").lighthouse_reached
    ),
}


def test_every_flag_env_py_reads_is_checked_below() -> None:
    """The flags are found in env.py's source: a new one fails here until it has a reader above."""
    tree = ast.parse((PACKAGE / "env.py").read_text())
    flags = {
        getattr(env, node.args[0].id)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "flag"
        and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id != "name"
    }  # fmt: skip
    assert flags == set(FLAG_READERS)


@pytest.mark.parametrize("variable", sorted(FLAG_READERS))
def test_a_flag_reads_every_spelling_of_on_and_off(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``0`` and ``false``/``no``/``off`` mean the same for every flag, in any case, blanks around."""
    read = FLAG_READERS[variable]
    monkeypatch.delenv(variable, raising=False)
    default = read()
    for word in ("0", "false", "no", "off", "FALSE", " Off ", "No"):
        monkeypatch.setenv(variable, word)
        assert read() is False, f"{variable}={word!r} did not read as off"
    for word in ("1", "true", "yes", "on", "TRUE", " On "):
        monkeypatch.setenv(variable, word)
        assert read() is True, f"{variable}={word!r} did not read as on"
    monkeypatch.setenv(variable, "")
    assert read() is default, "empty is the same as unset"
    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(
        ConfigurationError, match=rf"^environment variable {variable}='maybe' is not a flag: use 1, true"
    ):
        read()


# ================================================== one line, not a traceback: real processes
def _clean_env(**extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if k not in env.ALL_FTLAUNCH_VARS}
    return {**clean, "PYTHONPATH": str(ROOT), **extra}


def _python(code: str, environ: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=timeout
    )


def _error_line(proc: subprocess.CompletedProcess[str], prefix: str) -> str:
    """The one line the process ended with: no traceback, and one line starting with ``prefix``, its
    last (warnings the job logged before it may precede it)."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert [line for line in lines if line.startswith(prefix)] == lines[-1:], proc.stderr
    return lines[-1]


_STEP_SCRIPT = """\
import sys, torch, ftlaunch
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ft = ftlaunch.init(model, opt, backend="gloo")
model, opt = ft.wrap(model, opt)
opt.zero_grad()
model(torch.ones(1, 2)).sum().backward()
opt.step()
print("stepped without a lighthouse", flush=True)
"""


@pytest.mark.timeout(240)
def test_an_unreachable_lighthouse_ends_a_script_with_one_line_naming_the_fix() -> None:
    """The script's first step finds nothing at FTLAUNCH_LIGHTHOUSE: one line naming the address and
    what to do, exit status 1 (the connect timeout is FTLAUNCH_TIMEOUT / 2 = 1 s here)."""
    port = free_port()
    proc = _python(
        _STEP_SCRIPT,
        _clean_env(
            REPLICA_GROUP_ID="0",
            NUM_REPLICA_GROUPS="1",
            FTLAUNCH_LIGHTHOUSE=f"127.0.0.1:{port}",
            FTLAUNCH_TIMEOUT="2",
        ),
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _error_line(proc, "ftlaunch: error: ")
    assert line.startswith(f"ftlaunch: error: lighthouse http://127.0.0.1:{port} unreachable"), line
    assert (
        f"No lighthouse has answered there: start one (`ftlaunch-lighthouse --bind 127.0.0.1:{port}`)" in line
    )


_HOOK_SCRIPT = """\
import sys, ftlaunch
from ftlaunch.errors import install_brief_errors
seen = []
sys.excepthook = lambda *exc: seen.append(exc[0].__name__) or \
print("script's hook:", exc[0].__name__, file=sys.stderr)
install_brief_errors()  # what ftlaunch.init() does first
try:
    ftlaunch.init()
except ftlaunch.ConfigurationError as e:
    print("caught:", type(e).__name__, flush=True)
raise {raise_}
"""


@pytest.mark.parametrize(
    ("raise_", "code", "stderr"),
    [
        (
            "ftlaunch.ConfigurationError('FTLAUNCH_TIMEOUT is bad')",
            1,
            "ftlaunch: configuration error: FTLAUNCH_TIMEOUT is bad",
        ),
        ("RuntimeError('boom')", 1, "script's hook: RuntimeError"),
        ("SystemExit(3)", 3, ""),
    ],
    ids=["ours-one-line", "others-to-the-previous-hook", "exit-untouched"],
)
def test_the_hook_shortens_only_ftlaunch_errors_and_leaves_caught_ones_alone(
    raise_: str, code: int, stderr: str
) -> None:
    """Caught errors are the script's (``caught:``); an uncaught ConfigurationError is one line; any
    other exception goes to the hook that was there before."""
    proc = _python(_HOOK_SCRIPT.format(raise_=raise_), _clean_env())
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "caught: ConfigurationError\n"
    assert proc.stderr.strip() == stderr


_LATE_LOG_SCRIPT = """\
import atexit, logging, ftlaunch
from ftlaunch.errors import install_brief_errors
logging.basicConfig(level=logging.INFO)
install_brief_errors()
logging.getLogger("ftlaunch.lighthouse.client").warning("before the error")
# runs after the hook, as a background heartbeat thread still retrying would
atexit.register(lambda: logging.getLogger("ftlaunch.lighthouse.client").warning("after the error"))
raise ftlaunch.ConfigurationError("FTLAUNCH_TIMEOUT is bad")
"""


def test_nothing_ftlaunch_logs_after_the_one_line_buries_it() -> None:
    """A warning logged before the error stays; one logged after it (the heartbeat thread retrying a
    lighthouse that is down, while the interpreter exits) is muted, so the one line is the last."""
    proc = _python(_LATE_LOG_SCRIPT, _clean_env())
    assert proc.returncode == 1, proc.stderr
    assert "before the error" in proc.stderr
    assert proc.stderr.splitlines()[-1] == "ftlaunch: configuration error: FTLAUNCH_TIMEOUT is bad", (
        proc.stderr
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("environ", "code", "message"),
    [
        (
            {env.REPLICA_GROUP_ID: "abc"},
            1,
            "ftlaunch: configuration error: environment variable REPLICA_GROUP_ID='abc' is not an integer",
        ),
        (
            {env.REPLICA_GROUP_ID: "0", env.FTLAUNCH_HEAL_CLAIMS: "maybe"},
            1,
            "ftlaunch: configuration error: environment variable FTLAUNCH_HEAL_CLAIMS='maybe' is not a flag",
        ),
        ({env.REPLICA_GROUP_ID: "0"}, 1, "ftlaunch: error: lighthouse http://127.0.0.1:"),
    ],
    ids=["bad-group-id", "bad-flag", "no-lighthouse"],
)
def test_train_ddp_by_hand_fails_in_one_line(environ: dict[str, str], code: int, message: str) -> None:
    """``scripts/train_ddp.py`` run by hand, as its docstring shows, against a bad environment."""
    job = {
        env.NUM_REPLICA_GROUPS: "1",
        env.FTLAUNCH_LIGHTHOUSE: f"127.0.0.1:{free_port()}",
        env.FTLAUNCH_TIMEOUT: "2",
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_ddp.py"), "--steps", "2"],
        env=_clean_env(**job, **environ),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == code, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "Traceback" in line or message in line]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]


def test_the_straggler_policy() -> None:
    assert env.stragglers({}) is None
    assert env.stragglers({env.FTLAUNCH_STRAGGLERS: "Replace"}) == "replace"
    with pytest.raises(ConfigurationError, match="FTLAUNCH_STRAGGLERS='evict' is not one of report, replace"):
        env.stragglers({env.FTLAUNCH_STRAGGLERS: "evict"})
