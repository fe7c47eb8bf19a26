"""``ftlaunch.init()``: environment discovery, backend and transport choice, timeouts, and a real
single-process run against a lighthouse. The three launch paths run it end to end through
scripts/train_ddp.py (tests/processes/test_launcher_e2e.py, test_rendezvous.py, test_torchx.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import ftlaunch
from ftlaunch import env
from ftlaunch.errors import ConfigurationError
from ftlaunch.lighthouse.server import LighthouseServer
from ftlaunch.worker.entry import BACKENDS, default_backend, model_device

pytestmark = pytest.mark.timeout(120)

_JOB_VARS = (
    env.REPLICA_GROUP_ID,
    env.NUM_REPLICA_GROUPS,
    env.FTLAUNCH_LIGHTHOUSE,
    env.TORCHFT_LIGHTHOUSE,
    env.FTLAUNCH_BACKEND,
    env.FTLAUNCH_TRANSPORT,
    env.FTLAUNCH_TIMEOUT,
    env.RANK,
    env.WORLD_SIZE,
    env.MASTER_ADDR,
    env.MASTER_PORT,
    env.FTLAUNCH_HEAL_TIMEOUT,
    env.FTLAUNCH_QUORUM_TIMEOUT,
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _JOB_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def job(clean_env: pytest.MonkeyPatch) -> Iterator[LighthouseServer]:
    """A one-group job: what the launcher would publish, against a real lighthouse."""
    with LighthouseServer(
        "127.0.0.1:0", min_replicas=1, join_timeout=1.0, heartbeat_timeout=5.0, quorum_tick=0.05
    ).start() as lh:
        clean_env.setenv(env.REPLICA_GROUP_ID, "0")
        clean_env.setenv(env.NUM_REPLICA_GROUPS, "1")
        clean_env.setenv(env.FTLAUNCH_LIGHTHOUSE, lh.address)
        yield lh


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def test_outside_any_launcher_says_how_to_launch(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError) as e:
        ftlaunch.init(_model())
    msg = str(e.value)
    assert env.REPLICA_GROUP_ID in msg and env.FTLAUNCH_LIGHTHOUSE in msg
    for way in ("ftlaunch --replicas", "torchrun --rdzv-backend ftlaunch", "torchx run"):
        assert way in msg


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({env.REPLICA_GROUP_ID: "0", env.NUM_REPLICA_GROUPS: "2"}, env.FTLAUNCH_LIGHTHOUSE),
        ({env.FTLAUNCH_LIGHTHOUSE: "http://127.0.0.1:1", env.NUM_REPLICA_GROUPS: "2"}, env.REPLICA_GROUP_ID),
        ({env.FTLAUNCH_LIGHTHOUSE: "http://127.0.0.1:1", env.REPLICA_GROUP_ID: "0"}, env.NUM_REPLICA_GROUPS),
        (
            {
                env.FTLAUNCH_LIGHTHOUSE: "http://127.0.0.1:1",
                env.REPLICA_GROUP_ID: "2",
                env.NUM_REPLICA_GROUPS: "2",
            },
            "outside 0..1",
        ),
        (
            {
                env.FTLAUNCH_LIGHTHOUSE: "http://127.0.0.1:1",
                env.REPLICA_GROUP_ID: "x",
                env.NUM_REPLICA_GROUPS: "2",
            },
            "not an integer",
        ),
    ],
)
def test_incomplete_environment_is_named(clean_env: pytest.MonkeyPatch, environ: dict, message: str) -> None:
    for k, v in environ.items():
        clean_env.setenv(k, v)
    with pytest.raises(ConfigurationError, match=message):
        ftlaunch.init(_model())


def test_default_backend_by_device() -> None:
    assert default_backend(torch.device("cpu")) == "baby-gloo"
    assert default_backend(torch.device("cuda", 0)) == "baby-nccl"
    assert model_device(_model()) == torch.device("cpu")
    assert model_device(None) == torch.device("cpu")
    assert model_device(nn.Module()) == torch.device("cpu")  # no parameters: CPU
    meta = nn.Linear(2, 2, device="meta")
    assert model_device(meta).type == "meta"


@pytest.mark.parametrize(
    ("arg", "environ", "message"),
    [
        ("mpi", None, "backend='mpi' is not one of"),
        (None, "ucc", "FTLAUNCH_BACKEND='ucc' is not one of"),
        ("nccl", None, "needs CUDA"),
        ("baby-nccl", None, "needs CUDA"),
    ],
)
def test_bad_backend_is_rejected_before_connecting(
    job: LighthouseServer, clean_env: pytest.MonkeyPatch, arg: str | None, environ: str | None, message: str
) -> None:
    if torch.cuda.is_available() and "CUDA" in message:
        pytest.skip("CUDA is available: NCCL backends are valid here")
    if environ is not None:
        clean_env.setenv(env.FTLAUNCH_BACKEND, environ)
    with pytest.raises(ConfigurationError, match=message):
        ftlaunch.init(_model(), backend=arg)


def test_bad_transport_is_rejected(job: LighthouseServer, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(env.FTLAUNCH_TRANSPORT, "carrier-pigeon")
    with pytest.raises(ConfigurationError, match="FTLAUNCH_TRANSPORT='carrier-pigeon'"):
        ftlaunch.init(_model(), backend="gloo")


@pytest.mark.parametrize(
    ("kwargs", "environ", "rule"),
    [
        ({"timeout": 10, "heal_timeout": 20}, {}, "heal <= collective"),
        ({"timeout": 10, "quorum_timeout": 5}, {}, "collective <= quorum"),
        ({"timeout": 10}, {env.FTLAUNCH_HEAL_TIMEOUT: "30"}, "heal <= collective"),
        ({}, {env.FTLAUNCH_TIMEOUT: "soon"}, env.FTLAUNCH_TIMEOUT),
    ],
)
def test_inconsistent_timeouts_rejected_at_start(
    job: LighthouseServer, clean_env: pytest.MonkeyPatch, kwargs: dict, environ: dict, rule: str
) -> None:
    for k, v in environ.items():
        clean_env.setenv(k, v)
    with pytest.raises(ConfigurationError, match=rule):
        ftlaunch.init(_model(), backend="gloo", **kwargs)


def _train(
    ft: ftlaunch.FaultTolerance, model: nn.Module, opt: torch.optim.Optimizer, steps: int
) -> list[bool]:
    ddp, fopt = ft.wrap(model, opt)
    out = []
    for _ in range(steps):
        fopt.zero_grad()
        ddp(torch.randn(4, 8)).sum().backward()
        out.append(bool(fopt.step()))
    return out


@pytest.mark.parametrize(("backend", "transport"), [("gloo", "pg"), ("gloo", "http"), (None, None)])
def test_init_trains_and_shuts_down(
    job: LighthouseServer, clean_env: pytest.MonkeyPatch, backend: str | None, transport: str | None
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with ftlaunch.init(model, opt, timeout=15, backend=backend, transport=transport) as ft:
        assert ft.backend == (backend or "baby-gloo")  # CPU model: Baby Gloo by default
        assert ft.transport == (transport or "pg")
        assert (ft.replica_group_id, ft.num_replica_groups, ft.rank, ft.world_size) == (0, 1, 0, 1)
        assert ft.intra_group is None  # one worker per group: nothing to average inside it
        assert ft.manager.replica_id == "rg0"
        assert ft.manager.timeouts is ft.timeouts
        assert (ft.timeouts.collective, ft.timeouts.heal, ft.timeouts.quorum) == (15, 15, 30)
        assert _train(ft, model, opt, 3) == [True] * 3
        assert ft.manager.current_step() == 3
        # The state a restarted group would receive: the model's and the optimizer's.
        state = ft.manager._state.snapshot()
        assert set(state["default"]) == {"model", "optim"}
        assert set(state["default"]["model"]) == set(model.state_dict())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    ft.shutdown()  # idempotent


def test_backend_and_transport_from_environment(job: LighthouseServer, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(env.FTLAUNCH_BACKEND, "GLOO")
    clean_env.setenv(env.FTLAUNCH_TRANSPORT, "http")
    clean_env.setenv(env.FTLAUNCH_TIMEOUT, "8")
    with ftlaunch.init(_model()) as ft:
        assert (ft.backend, ft.transport, ft.timeouts.collective) == ("gloo", "http", 8.0)
        assert type(ft.pg).__name__ == "ProcessGroupGloo"
        assert type(ft.manager._transport).__name__ == "HTTPTransport"


def test_explicit_state_functions_and_more_state(job: LighthouseServer) -> None:
    box = {"x": 1}
    with ftlaunch.init(
        load_state_dict=lambda sd: box.update(sd), state_dict=lambda: dict(box), backend="gloo"
    ) as ft:
        ft.manager.register_state_dict_fn("extra", lambda sd: None, lambda: {"y": 2})
        assert ft.manager._state.snapshot()["default"] == {"x": 1}
        assert ft.manager._state.snapshot()["extra"] == {"y": 2}
    with pytest.raises(ValueError, match="both"):
        ftlaunch.init(state_dict=lambda: {}, backend="gloo")


def test_all_backend_names_are_known() -> None:
    assert set(BACKENDS) == {"baby-gloo", "baby-nccl", "gloo", "nccl"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Baby NCCL default)")
def test_cuda_model_defaults_to_baby_nccl(job: LighthouseServer) -> None:
    model = _model().cuda()
    with ftlaunch.init(model, torch.optim.SGD(model.parameters(), lr=0.1)) as ft:
        assert ft.backend == "baby-nccl" and ft.device.type == "cuda"


def test_wait_all_honours_the_deadline() -> None:
    import threading
    import time

    from ftlaunch.worker.commit import wait_all

    never: torch.futures.Future = torch.futures.Future()
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(1)
    t0 = time.monotonic()
    assert wait_all([done, never], time.monotonic() + 0.2) is False
    assert 0.15 < time.monotonic() - t0 < 5
    later: torch.futures.Future = torch.futures.Future()
    threading.Timer(0.1, lambda: later.set_result(2)).start()
    assert wait_all([done, later], time.monotonic() + 10) is True
    assert wait_all([], time.monotonic()) is True


def test_commit_timeout_refuses_a_step_whose_collective_hangs(job: LighthouseServer) -> None:
    """A collective that never completes (a stopped peer) costs at most the commit timeout: the
    step is refused, the process group aborted (releasing the hung op), and the next step commits."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ftlaunch.init(model, opt, timeout=5, commit_timeout=0.3, backend="gloo") as ft:
        assert ft.timeouts.commit == 0.3
        aborted = []
        ft.pg.abort = lambda: aborted.append(True)  # type: ignore[method-assign]
        ddp, fopt = ft.wrap(model, opt)
        fopt.zero_grad()
        ddp(torch.randn(4, 8)).sum().backward()
        ft.manager._attempt.issued(torch.futures.Future())  # an allreduce that never finishes
        assert fopt.step() is False
        assert aborted == [True]
        assert "commit timed out after 0.3 s" in str(ft.manager.errored())
        assert _train(ft, model, opt, 1) == [True]
