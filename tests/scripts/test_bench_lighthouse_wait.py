"""scripts/bench_lighthouse.py notices a benchmark worker that died instead of waiting out its
10-minute barrier and queue timeouts (a worker that cannot import ftlaunch ends at once).

Spawned processes that end with a known code (``os._exit``) or do the worker's part (wait at the
barrier, put a result) stand in for the benchmark's workers; the helpers are given 300 s, far
beyond this test's own timeout, so only noticing the dead worker can end them in time.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_lighthouse  # noqa: E402

pytestmark = pytest.mark.timeout(60)

ctx = mp.get_context("spawn")


def test_a_worker_that_dies_before_the_barrier_ends_the_wait_with_its_exit_code() -> None:
    barrier = ctx.Barrier(3)
    waiting = ctx.Process(target=barrier.wait, args=(120,))  # a healthy worker: released by the abort
    dead = ctx.Process(target=os._exit, args=(3,))
    workers = [waiting, dead]
    for w in workers:
        w.start()
    with pytest.raises(SystemExit, match=r"exit code 3"):
        bench_lighthouse._wait_ready(barrier, workers, timeout=300)
    assert all(w.exitcode is not None for w in workers)  # none left running


def test_the_parent_joins_the_barrier_once_every_worker_waits_there() -> None:
    barrier = ctx.Barrier(2)
    w = ctx.Process(target=barrier.wait, args=(120,))
    w.start()
    bench_lighthouse._wait_ready(barrier, [w], timeout=300)
    w.join(30)
    assert w.exitcode == 0


def test_a_worker_that_dies_before_its_results_ends_the_wait_with_its_exit_code() -> None:
    out = ctx.Queue()
    w = ctx.Process(target=os._exit, args=(5,))
    w.start()
    with pytest.raises(SystemExit, match=r"exit code 5"):
        bench_lighthouse._get(out, [w], timeout=300)


def test_results_are_read_and_workers_that_ended_without_sending_them_all_are_noticed() -> None:
    out = ctx.Queue()
    w = ctx.Process(target=out.put, args=(("g0", 1.5),))
    w.start()
    assert bench_lighthouse._get(out, [w], timeout=300) == ("g0", 1.5)
    w.join(30)
    with pytest.raises(SystemExit, match=r"without sending every result"):
        bench_lighthouse._get(out, [w], timeout=300)
