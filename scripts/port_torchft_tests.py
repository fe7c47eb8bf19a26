"""Run torchft's own shipped tests against ftlaunch, ported by README's rules, and count.

A torchft user ports by changing the import. This script does exactly that to the
``*_test.py`` files torchft ships in its wheel: it copies them (and the test helpers they import)
into a temporary directory, rewrites every ``torchft`` module name by README's porting rules
(``torchft.ddp`` -> ``ftlaunch``, ``torchft._torchft`` -> ``ftlaunch.coordination``, every other
``torchft.X`` -> ``ftlaunch.X``; a test module importing another test module keeps importing the
copy), runs each file under pytest with ``FTLAUNCH_TOKEN`` set, and prints passed/failed counts
per file, split into the tests of public behaviour and those of torchft's internals (a Rust client
mocked, a private helper: nothing a user's code touches).

``--torchft`` runs the same copies against torchft itself (imports unchanged), for the baseline
in the same environment: install torchft in a separate virtual environment and pass its python
with ``--python``. The tests are torchft's code; they are never copied into this repository.

    pip download --no-deps torchft-nightly==2026.10.26 -d /tmp/tft
    python -m venv --system-site-packages /tmp/tftvenv
    /tmp/tftvenv/bin/pip install parameterized expecttest pytest-timeout   # what the tests import
    python scripts/port_torchft_tests.py --wheel /tmp/tft/torchft_nightly-*.whl \\
        --python /tmp/tftvenv/bin/python
    # torchft's own count (torchft installed in the venv):
    python scripts/port_torchft_tests.py --wheel ... --python /tmp/tftvenv/bin/python --torchft
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "torchft_tests"  # the copies' package: a test importing another test gets the copy

# Tests of torchft's internals: they mock its Rust client or test private helpers that have no
# counterpart a user would call. Matched against "file::Class::test" by prefix.
INTERNAL = {
    "manager_test.py": "mocks torchft's Rust ManagerClient (ftlaunch has no per-group manager server)",
    "futures_test.py": "torchft.futures: private timeout helpers",
    "checkpointing/rwlock_test.py": "torchft.checkpointing._rwlock: a private lock",
    "_test/managed_work_test.py": "torchft.manager._ManagedWork: private",
    "multiprocessing_test.py": "torchft.multiprocessing._MonitoredPipe: private",
    "utils_test.py": "torchft.utils: private helpers (record_event, streams)",
    "torchcomms_test.py": "torchft.torchcomms: a backend on torchcomms, not installed here",
    "checkpointing/transport_test.py": "a helper module, no tests of its own",
    "process_group_test.py::ProcessGroupTest::test_baby_gloo_timeout": "patches torchft's private "
    "stream_timeout/context_timeout helpers",
    "process_group_test.py::ProcessGroupTest::test_error_swallowing_": "mocks _DummyWork internals",
    "process_group_test.py::ProcessGroupTest::test_functional_collectives": "torch's functional "
    "collectives over a private registration",
    "process_group_test.py::MultiPgBaseTest": "a base class",
    "checkpointing/http_transport_test.py::TestHTTPTransport::test_benchmark": "runs torchft's own "
    "benchmark module",
    "checkpointing/http_transport_test.py::TestHTTPTransport::test_checkpoint_server_locking": "reads "
    "the private _checkpoint_lock/_disallowed/_step",
    "process_group_test.py::ProcessGroupTest::test_reconfigure_baby_process_group": "reads the "
    "private _future_thread/_future_pipe/_p",
    "reconfigure_test.py::ReconfigureTest::test_rendezvous": "the private _rendezvous/_handle_id "
    "and torchft's store prefix",
    "reconfigure_test.py::ReconfigureTest::test_manager_reconfigure_pg": "the private "
    "Manager._reconfigure_pg on a Manager built without __init__",
    "local_sgd_test.py::DiLoCoTest::test_bucketization_correctness": "drives the private "
    "Fragment._grads/_average_grads/_set_grads",
    "local_sgd_test.py::DiLoCoTest::test_gradient_correctness": "drives the private "
    "Fragment._save_grads/_average_grads/_set_grads",
}

#: torchft's benchmark modules, which some test files import: torchft's own tools, not ported (the
#: tests that run them skip). ftlaunch's benchmarks are its scripts/bench_*.py.
_BENCH_STUB = """import unittest


def main(argv=None):
    raise unittest.SkipTest("torchft's own benchmark module is not ported (see scripts/bench_*.py)")
"""


def rename_module(name: str, to_torchft: bool) -> str:
    """The module a ported test imports for torchft's module ``name`` (``torchft`` or ``torchft.X``)."""
    parts = name.split(".")
    tail = parts[1:]
    is_test_code = any(
        p.endswith("_test") or p in ("_test", "_test_utils") or p.endswith("_bench") for p in tail
    )
    if is_test_code:
        return ".".join([PACKAGE, *tail])
    if to_torchft:
        return name
    if not tail:
        return "ftlaunch"
    if tail[0] == "ddp":
        return ".".join(["ftlaunch", *tail[1:]])
    if tail[0] == "_torchft":
        return ".".join(["ftlaunch", "coordination", *tail[1:]])
    return ".".join(["ftlaunch", *tail])


_MODULE = re.compile(r"\btorchft(?!\w)((?:\.[A-Za-z_]\w*)*)")


def rewrite(source: str, to_torchft: bool) -> str:
    """Rewrite every dotted ``torchft...`` reference: imports and ``mock.patch`` strings alike.

    A dotted name in a patch string ends with an attribute (``torchft.process_group.TCPStore``);
    the module prefix is what is renamed, so the longest prefix naming a module decides.
    """

    def one(match: re.Match[str]) -> str:
        dotted = "torchft" + match.group(1)
        parts = dotted.split(".")
        # Attributes are CamelCase or follow a module; rename the module prefix only.
        for cut in range(len(parts), 0, -1):
            head = ".".join(parts[:cut])
            if cut == 1 or _looks_like_module(parts[cut - 1]):
                renamed = rename_module(head, to_torchft)
                return ".".join([renamed, *parts[cut:]])
        return dotted

    # ``from torchft import _test_utils``: a helper imported by name, not by a dotted path.
    source = re.sub(r"\bfrom torchft import (_test_utils|_test)\b", rf"from {PACKAGE} import \1", source)
    return _MODULE.sub(one, source)


def _looks_like_module(part: str) -> bool:
    return part.islower() or part.startswith("_") and part[1:2].islower()


@dataclass
class Counts:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)


def extract(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(into)
    return into / "torchft"


def copy_tests(src: Path, dst: Path, to_torchft: bool) -> list[str]:
    """Copy torchft's test files and helpers under ``dst/PACKAGE``, rewritten; return the test files."""
    pkg = dst / PACKAGE
    tests = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        name = rel.name
        helper = name == "_test_utils.py" or name.endswith("_bench.py") or rel.parts[0] == "_test"
        if not (name.endswith("_test.py") or helper):
            continue
        out = pkg / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        bench = name.endswith("_bench.py") and not to_torchft
        out.write_text(_BENCH_STUB if bench else rewrite(path.read_text(), to_torchft))
        if name.endswith("_test.py"):
            tests.append(str(rel))
    for d in [pkg, *[p for p in pkg.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    return tests


def internal_reason(nodeid: str) -> str | None:
    for prefix, reason in INTERNAL.items():
        if nodeid.startswith(prefix):
            return reason
    return None


def run_file(
    python: str, root: Path, rel: str, timeout: float, per_test: float, env: dict[str, str]
) -> dict[str, str]:
    """Run one ported file; return {nodeid: outcome}."""
    xml = root / (rel.replace("/", "_") + ".xml")
    cmd = [
        python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
        f"--timeout={per_test:.0f}",
        str(Path(PACKAGE) / rel),
    ]
    try:
        subprocess.run(
            cmd,
            cwd=root,
            env=env,
            timeout=timeout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        pass
    outcomes: dict[str, str] = {}
    if not xml.exists():
        return {f"{rel}::<collection>": "not imported"}
    for case in ET.parse(xml).getroot().iter("testcase"):
        cls = case.get("classname", "").split(".")[-1]
        nodeid = f"{rel}::{cls}::{case.get('name')}"
        error = case.find("error")
        if error is not None and error.get("message") == "collection failure":
            # pytest's entry for a module that failed to import: its tests were never collected.
            outcomes[f"{rel}::<collection>"] = "not imported"
            continue
        if case.find("skipped") is not None:
            outcomes[nodeid] = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            outcomes[nodeid] = "failed"
        else:
            outcomes[nodeid] = "passed"
    return outcomes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--wheel", type=Path, help="torchft's wheel (pip download --no-deps ...)")
    src.add_argument("--wheel-dir", type=Path, help="an unpacked wheel: the directory holding torchft/")
    ap.add_argument("--python", default=sys.executable, help="the interpreter to run pytest with")
    ap.add_argument("--torchft", action="store_true", help="run against torchft itself (baseline)")
    ap.add_argument("--files", nargs="*", help="only these test files (relative, e.g. ddp_test.py)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per file")
    ap.add_argument("--per-test-timeout", type=float, default=120, help="seconds per test")
    ap.add_argument("--keep", type=Path, help="write the ported copies here and keep them")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every failing test")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="torchft-port-"))
    try:
        if args.wheel:
            torchft_dir = extract(args.wheel, work / "wheel")
        else:
            torchft_dir = args.wheel_dir / "torchft"
        if not torchft_dir.is_dir():
            print(f"error: no torchft/ package in {torchft_dir.parent}", file=sys.stderr)
            return 2
        root = args.keep or (work / "ported")
        root.mkdir(parents=True, exist_ok=True)
        files = copy_tests(torchft_dir, root, args.torchft)
        if args.files:
            files = [f for f in files if f in args.files]
        env = dict(os.environ)
        path = [str(root)] if args.torchft else [str(root), str(REPO)]
        env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("FTLAUNCH_TOKEN", secrets.token_hex(16))
        target = "torchft" if args.torchft else "ftlaunch"
        print(f"torchft's tests against {target}, {len(files)} files, {args.python}")
        print(f"{'file':<42}{'public':>14}{'internal':>14}{'skipped':>9}{'secs':>7}")
        pub_total = Counts()
        int_total = Counts()
        skipped = 0
        unimported = 0
        for rel in files:
            t0 = time.monotonic()
            outcomes = run_file(args.python, root, rel, args.timeout, args.per_test_timeout, env)
            pub, internal = Counts(), Counts()
            broken = [n for n, o in outcomes.items() if o == "not imported"]
            for nodeid, outcome in sorted(outcomes.items()):
                if outcome == "not imported":
                    continue
                if outcome == "skipped":
                    skipped += 1
                    continue
                bucket = internal if internal_reason(nodeid) else pub
                if outcome == "passed":
                    bucket.passed += 1
                else:
                    bucket.failed += 1
                    bucket.failures.append(nodeid)
            n_skipped = sum(1 for o in outcomes.values() if o == "skipped")
            print(
                f"{rel:<42}{pub.passed:>6}/{pub.passed + pub.failed:<7}"
                f"{internal.passed:>6}/{internal.passed + internal.failed:<7}"
                f"{n_skipped:>9}{time.monotonic() - t0:>7.0f}"
                + ("  (no results: it did not import, or ran past --timeout)" if broken else ""),
                flush=True,
            )
            unimported += bool(broken)
            if args.verbose:
                for f in pub.failures:
                    print(f"    FAILED {f}")
            for total, part in ((pub_total, pub), (int_total, internal)):
                total.passed += part.passed
                total.failed += part.failed
                total.failures += part.failures
        print(
            f"{'total':<42}{pub_total.passed:>6}/{pub_total.passed + pub_total.failed:<7}"
            f"{int_total.passed:>6}/{int_total.passed + int_total.failed:<7}{skipped:>9}"
        )
        print(
            f"public behaviour: {pub_total.passed} of {pub_total.passed + pub_total.failed} pass "
            f"against {target}; torchft's internals: {int_total.passed} of "
            f"{int_total.passed + int_total.failed}; skipped by the tests themselves: {skipped}; "
            f"files without results (not imported or timed out): {unimported}"
        )
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
