"""The folder layout is the architecture: no module imports a layer above (or beside) its own.

docs/architecture.md draws the same table. Every ``import ftlaunch...`` counts, also one inside a
function or under ``TYPE_CHECKING``: a lazy import up the layers is still a dependency up the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ftlaunch"

#: layer -> the module prefixes that make it up (longest prefix wins).
LAYERS: dict[str, tuple[str, ...]] = {
    "foundation": (
        "ftlaunch.errors",
        "ftlaunch.env",
        "ftlaunch.timeouts",
        "ftlaunch.addresses",
        "ftlaunch.lifetime",
        "ftlaunch.phases",
        "ftlaunch.cli_args",
        "ftlaunch.streams",
    ),
    # How a worker process starts: torch imported once, the Baby child forked, the warm standby.
    "bootstrap": ("ftlaunch.bootstrap",),
    "lighthouse": ("ftlaunch.lighthouse",),
    "process_group": ("ftlaunch.process_group",),
    "checkpointing": ("ftlaunch.checkpointing",),
    # fairseq2's Gang API over torch.distributed; its fault-tolerant gang lives in worker/.
    "gang": ("ftlaunch.gang",),
    "worker": ("ftlaunch.worker",),
    "launcher": ("ftlaunch.launcher", "ftlaunch.health"),
    # The public face: the package itself and torchft's module paths (one-line re-exports).
    "api": (
        "ftlaunch",
        "ftlaunch.manager",
        "ftlaunch.optim",
        "ftlaunch.data",
        "ftlaunch.parameter_server",
        "ftlaunch.local_sgd",
        "ftlaunch.coordination",
        "ftlaunch.run",
        "ftlaunch.work",
    ),
}

#: layer -> the layers it may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "foundation": set(),
    "bootstrap": {"foundation"},
    "lighthouse": {"foundation"},
    "process_group": {"foundation", "bootstrap"},
    "checkpointing": {"foundation", "process_group"},
    "gang": {"foundation"},
    "worker": {"foundation", "bootstrap", "lighthouse", "process_group", "checkpointing", "gang"},
    "launcher": {"foundation", "bootstrap", "lighthouse"},
    "api": set(LAYERS),
}


#: The only imports allowed up the layers, each a lazy alias that keeps a torchft module path working.
#: torchft users write ``torchft.process_group.ManagedProcessGroup``; it reduces through the Manager, so
#: it lives in worker/, and process_group's ``__getattr__`` resolves the old path on first use.
COMPAT_ALIASES: set[tuple[str, str]] = {
    ("ftlaunch.process_group", "ftlaunch.worker.managed_pg"),
    ("ftlaunch.process_group", "ftlaunch.worker.hsdp"),  # ft_init_device_mesh
}


def layer_of(module: str) -> str:
    best, length = None, -1
    for layer, prefixes in LAYERS.items():
        for p in prefixes:
            # The bare package name matches only itself: a new top-level module must be placed.
            if (module == p or (p != "ftlaunch" and module.startswith(p + "."))) and len(p) > length:
                best, length = layer, len(p)
    if best is None:
        raise AssertionError(
            f"module {module} belongs to no layer: add it to LAYERS (and docs/architecture.md)"
        )
    return best


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, module: str) -> set[str]:
    """Every ftlaunch module ``path`` imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "ftlaunch")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] != "ftlaunch":
                continue
            # `from ftlaunch.x import y` may name a submodule y: count the deeper one when it exists.
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").exists() or (
                    PACKAGE.parent / Path(*sub.split(".")) / "__init__.py"
                ).exists()
                found.add(sub if is_module else target)
    return found


def all_modules() -> list[tuple[Path, str]]:
    return [(p, module_name(p)) for p in sorted(PACKAGE.rglob("*.py"))]


def test_every_module_has_a_layer() -> None:
    for _, module in all_modules():
        layer_of(module)


def test_no_import_runs_up_a_layer() -> None:
    violations = []
    for path, module in all_modules():
        mine = layer_of(module)
        for target in sorted(imports_of(path, module)):
            theirs = layer_of(target)
            if (module, target) in COMPAT_ALIASES:
                continue
            if theirs != mine and theirs not in ALLOWED[mine]:
                violations.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not violations, "imports against the layer table:\n" + "\n".join(violations)


def test_the_check_sees_violations(tmp_path: Path) -> None:
    """The walker finds absolute, relative and function-level imports (so the test above can fail)."""
    src = tmp_path / "m.py"
    src.write_text(
        "from ftlaunch.worker import manager\n"
        "def f():\n    from ..launcher import supervisor\n    import ftlaunch.lighthouse.client\n"
    )
    found = imports_of(src, "ftlaunch.process_group.m")
    assert {layer_of(t) for t in found} == {"worker", "launcher", "lighthouse"}
    assert "ftlaunch.lighthouse.client" in found
    assert layer_of("ftlaunch.worker.manager") == "worker" and layer_of("ftlaunch.manager") == "api"


#: Inside the lighthouse, bottom up: a module imports only lighthouse modules of a lower rank, so the
#: decision and the bookkeeping never see HTTP, and the transport never sees a quorum.
LIGHTHOUSE_RANKS: dict[str, int] = {
    "timeline": -1,  # a job's timeline as data, and the bounded series progress keeps (pure)
    "protocol": 0,  # wire constants
    "quorum": 0,  # the pure decision
    "slots": 0,  # the pure rule: which spare takes which replica-group slot
    "progress": 0,  # training progress the group leaders report, and its totals (pure)
    "stragglers": 0,  # slow groups found from the progress reports (pure rule) and its memory
    "health": 0,  # the groups' health-check reports, and what the lighthouse keeps of them
    "quorum_delta": 1,  # a quorum as the difference from one a member holds (pure; server and client)
    "status": 1,  # the typed status document
    "spares": 1,  # the slot table of a job with hot spares (no HTTP)
    "tickets": 1,  # a parked quorum request and the membership's domain errors
    "resume": 1,  # a restarted lighthouse's adoption of the groups' resume reports (pure rules)
    "roster": 2,  # the groups' records, the only place they change, and the rules that read them
    "round": 2,  # the parked quorum requests and the quorum they are compared with
    "hung": 3,  # the evidence-based loss of hung quorum members (pure rule) and the blocked reports
    "admission": 3,  # who may make a request of the membership (pure rules), evictions not yet told
    "membership": 4,  # the bookkeeping: holds the above, applies their rules under one lock
    "http": 2,  # request/response types, http.server's head parsing
    "bodies": 3,  # a request body: JSON decoded, nesting bounded, fields checked
    "limits": 2,  # connection cap, warnings per client: bounds a client cannot push
    "timeline_svg": 1,  # a timeline drawn as SVG (pure; the dashboard's and the launcher's picture)
    "dashboard": 2,  # HTML from a status
    "metrics": 2,  # Prometheus text from a status (prometheus_client)
    "channel": 1,  # one keep-alive HTTP connection to the lighthouse, retries, how answers read
    "client": 2,
    "reconnect": 3,  # the leader's client riding out a lighthouse outage
    "torchft_client": 3,  # torchft's form of the client (ftlaunch.coordination.LighthouseClient)
    "connection": 3,  # one client connection: parsing, answering, long polls, deadlines
    "transport": 4,  # the asyncio server: listening, the connection cap, identities
    "answers": 3,  # quorum answers encoded once per quorum and held revision (whole or delta)
    "routes": 5,  # endpoints: JSON, token, domain errors -> status codes
    "server": 6,  # composes them
    "cli": 7,
    "__main__": 8,
    "__init__": 8,  # the package's re-exports
}

#: Lighthouse modules that do no I/O: they may not import sockets, event loops or HTTP.
LIGHTHOUSE_NO_IO = {
    "protocol",
    "health",
    "stragglers",
    "quorum",
    "quorum_delta",
    "progress",
    "slots",
    "status",
    "spares",
    "tickets",
    "resume",
    "roster",
    "round",
    "hung",
    "admission",
    "membership",
    "dashboard",
    "timeline",
    "timeline_svg",
}
_IO_MODULES = {"socket", "selectors", "select", "asyncio", "http", "urllib", "ssl"}


def test_lighthouse_inner_layers() -> None:
    folder = PACKAGE / "lighthouse"
    assert {p.stem for p in folder.glob("*.py")} == set(LIGHTHOUSE_RANKS), (
        "place every lighthouse module in LIGHTHOUSE_RANKS"
    )
    violations = []
    for path in sorted(folder.glob("*.py")):
        mine = path.stem
        module = module_name(path)
        for target in sorted(imports_of(path, module)):
            if not target.startswith("ftlaunch.lighthouse."):
                continue
            theirs = target.split(".")[2]
            if LIGHTHOUSE_RANKS[theirs] >= LIGHTHOUSE_RANKS[mine]:
                violations.append(
                    f"lighthouse/{mine} (rank {LIGHTHOUSE_RANKS[mine]}) imports {theirs} (rank "
                    f"{LIGHTHOUSE_RANKS[theirs]})"
                )
        if mine in LIGHTHOUSE_NO_IO:
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and not node.level
                    else []
                )
                violations += [
                    f"lighthouse/{mine} imports {n}" for n in names if n.split(".")[0] in _IO_MODULES
                ]
    assert not violations, "imports against the lighthouse's inner layers:\n" + "\n".join(violations)


def test_no_import_circle() -> None:
    """No module reaches itself through imports -- counting those under ``TYPE_CHECKING`` and inside
    functions, which hide a circle without removing it. The torchft compatibility aliases are the
    only lazy imports left out (they resolve an old module path on first use)."""
    graph = {
        module: {t for t in imports_of(path, module) if (module, t) not in COMPAT_ALIASES and t != module}
        for path, module in all_modules()
    }
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)
