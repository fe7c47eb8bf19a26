"""Shared test fixtures, and the layout of the suite.

``tests/unit``: one process, fakes (`ftlaunch.process_group.fake`, the in-process lighthouse),
no sockets. ``tests/processes``: real processes, sockets and kills, each bounded by a timeout;
every test collected there carries the ``processes`` marker (``-m "not processes"`` runs the unit
tests alone). ``tests/scripts``: the tools in ``scripts/`` (benchmarks, soak, GPU check). A long
scenario is also marked ``slow`` and runs only with ``FTLAUNCH_TESTS=all``. The shared harnesses
(``mp_harness``, ``pg_helpers``, ``workers/``...) stay at the top of ``tests/``, importable from
every folder.

Every test that starts processes must leave none behind. Children inherit a per-session marker in
their environment, so the leak check also finds orphans that were re-parented to init (torchelastic
workers live in their own process groups and survive their agent).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

_TESTS = Path(__file__).resolve().parent
for _folder in (_TESTS, _TESTS / "unit", _TESTS / "processes", _TESTS / "scripts"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

MARKER = "FTLAUNCH_TEST_SESSION"
os.environ.setdefault(MARKER, uuid.uuid4().hex)
_SESSION = os.environ[MARKER]


def marked_processes() -> list[psutil.Process]:
    """Processes (other than this one and its ancestors) carrying this session's marker."""
    me = os.getpid()
    ancestors = {p.pid for p in psutil.Process(me).parents()}
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me or proc.pid in ancestors:
            continue
        try:
            if proc.environ().get(MARKER) == _SESSION and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything under ``tests/processes`` carries the ``processes`` marker: one marker, set by
    where a test lives, instead of a decorator each file might forget."""
    processes = _TESTS / "processes"
    for item in items:
        if processes in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.processes)


@pytest.fixture(scope="session", autouse=True)
def _unmarked_resource_tracker() -> None:
    """multiprocessing's resource tracker outlives tests by design: start it without the marker."""
    from multiprocessing import resource_tracker

    marker = os.environ.pop(MARKER)
    try:
        resource_tracker.ensure_running()
    finally:
        os.environ[MARKER] = marker


@pytest.fixture(autouse=True)
def no_leaked_environment(request: pytest.FixtureRequest):
    """Fail a test that leaves an ``FTLAUNCH_``/``TORCHFT_`` variable changed, then restore it: the
    processes later tests start inherit this environment (a stale checkpoint directory would make
    them resume from another test's checkpoint)."""
    before = {k: v for k, v in os.environ.items() if k.startswith(("FTLAUNCH_", "TORCHFT_"))}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith(("FTLAUNCH_", "TORCHFT_"))}
    if after != before:
        for k in after.keys() - before.keys():
            del os.environ[k]
        os.environ.update(before)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        pytest.fail(f"test left environment variables changed: {changed}")


@pytest.fixture(autouse=True)
def no_leaked_processes(request: pytest.FixtureRequest):
    """Fail a test that leaves processes behind (after a short grace period), then clean up."""
    yield
    deadline = time.monotonic() + 10.0
    left = marked_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = marked_processes()
    if left:
        desc = [f"{p.pid}:{' '.join(p.cmdline()[:6])}" for p in left if p.is_running()]
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=5)
        if desc:
            pytest.fail(f"test left processes behind: {desc}")


@pytest.fixture
def groups() -> Iterator[list[Any]]:
    """Real-process replica groups a test starts (anything with ``close()``, e.g.
    `mp_harness.Group`): closed at the end, so a failing test leaves none running."""
    made: list[Any] = []
    yield made
    for g in made:
        g.close()
