"""The commit vote across groups (`worker.commit.CrossGroupVote`) waits for its collective on the
training thread when the Work can be waited in slices (`process_group.work.PollableWork`, the Baby
groups' Work): no future completed by another thread, and a lost peer still cuts the wait short."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ftlaunch.errors import CommunicationError
from ftlaunch.worker.commit import CrossGroupVote

pytestmark = pytest.mark.timeout(30)


class _SlicedWork(dist.Work):
    """A vote collective that completes ``after`` seconds from now (never, with None), setting the
    flag to ``result``; only ever waited in slices."""

    def __init__(self, flag: torch.Tensor, after: float | None, result: int, error: Exception | None) -> None:
        super().__init__()
        self._flag, self._result, self._error = flag, result, error
        self._done_at = None if after is None else time.monotonic() + after
        self.slices: list[float] = []
        self.thread: threading.Thread | None = None

    def done_within(self, seconds: float) -> bool:
        self.slices.append(seconds)
        self.thread = threading.current_thread()
        if self._done_at is None:
            time.sleep(seconds)
            return False
        time.sleep(max(0.0, min(seconds, self._done_at - time.monotonic())))
        return time.monotonic() >= self._done_at

    def wait(self, timeout: Any = None) -> bool:
        assert self._done_at is not None and time.monotonic() >= self._done_at, "waited before it was done"
        if self._error is not None:
            raise self._error
        self._flag.fill_(self._result)
        return True

    def get_future(self) -> torch.futures.Future:
        raise AssertionError("a sliced wait needs no future (and no thread to complete it)")


class _Group:
    def __init__(self, after: float | None, result: int = 1, error: Exception | None = None) -> None:
        self.after, self.result, self.error = after, result, error
        self.works: list[_SlicedWork] = []

    def allreduce(self, tensors: list[torch.Tensor], op: Any) -> _SlicedWork:
        assert op == dist.ReduceOp.MIN
        self.works.append(_SlicedWork(tensors[0], self.after, self.result, self.error))
        return self.works[-1]


def test_the_vote_is_waited_for_on_the_calling_thread_in_slices() -> None:
    pg = _Group(after=0.12)
    assert CrossGroupVote()(pg, True, time.monotonic() + 5, interrupted=lambda: False) is True  # type: ignore[arg-type]
    work = pg.works[0]
    assert work.thread is threading.current_thread()
    assert len(work.slices) >= 2 and max(work.slices) <= 0.05 + 1e-9  # looked at `interrupted` between


def test_a_no_from_any_group_is_the_answer() -> None:
    pg = _Group(after=0.0, result=0)
    assert CrossGroupVote()(pg, True, time.monotonic() + 5, interrupted=lambda: False) is False  # type: ignore[arg-type]


def test_a_lost_peer_cuts_a_sliced_wait_short_and_the_next_vote_uses_a_new_tensor() -> None:
    pg = _Group(after=None)
    vote = CrossGroupVote()
    lost = threading.Event()
    threading.Timer(0.1, lost.set).start()
    t0 = time.monotonic()
    with pytest.raises(CommunicationError, match="peer was lost"):
        vote(pg, True, time.monotonic() + 10, interrupted=lost.is_set)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 2
    pg.after = 0.0
    vote(pg, True, time.monotonic() + 5, interrupted=lambda: False)  # type: ignore[arg-type]
    assert pg.works[0]._flag is not pg.works[1]._flag  # the first may still be in flight somewhere


def test_a_failed_vote_collective_raises_its_error() -> None:
    pg = _Group(after=0.0, error=CommunicationError("connection reset by peer"))
    with pytest.raises(CommunicationError, match="connection reset"):
        CrossGroupVote()(pg, True, time.monotonic() + 5, interrupted=lambda: False)  # type: ignore[arg-type]


def test_the_deadline_ends_a_sliced_wait() -> None:
    pg = _Group(after=None)
    t0 = time.monotonic()
    with pytest.raises(CommunicationError, match="timed out"):
        CrossGroupVote()(pg, True, time.monotonic() + 0.2, interrupted=lambda: False)  # type: ignore[arg-type]
    assert 0.15 < time.monotonic() - t0 < 2


class _Named:
    def __init__(self, name: str) -> None:
        self._name = name

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return self._name


class _NativeNamed:
    """torch's own groups answer ``name()`` only."""

    def __init__(self, name: str) -> None:
        self._name = name

    def name(self) -> str:
        return self._name


@pytest.mark.parametrize(
    ("group", "cuda"),
    [
        (_Named("ftlaunch-baby-nccl"), True),
        (_Named("ftlaunch-nccl"), True),
        (_NativeNamed("nccl"), True),
        (_Named("ftlaunch-baby-gloo"), False),
        (_Named("ftlaunch-gloo"), False),
        (_NativeNamed("gloo"), False),
        (object(), False),
    ],
)
def test_collectives_take_tensors_on_the_backend_s_device(group: Any, cuda: bool, monkeypatch) -> None:
    """NCCL refuses CPU tensors: the vote's flag and a barrier's token are made where the group
    reduces. CUDA is stood in for (this test runs without a GPU); the GPU check runs it for real."""
    from ftlaunch.process_group.base import collective_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device(group) == (torch.device("cuda", 3) if cuda else torch.device("cpu"))


def test_the_vote_s_flag_is_made_on_the_group_s_device(monkeypatch) -> None:
    import ftlaunch.worker.commit as commit

    asked: list[Any] = []

    def device_of(pg: Any) -> torch.device:
        asked.append(pg)
        return torch.device("cpu")

    monkeypatch.setattr(commit, "collective_device", device_of)
    pg = _Group(after=0.0)
    vote = CrossGroupVote()
    assert vote(pg, True, time.monotonic() + 5, interrupted=lambda: False) is True  # type: ignore[arg-type]
    assert asked == [pg]
    assert pg.works[0]._flag.device == torch.device("cpu")
