"""PGTransport over real Gloo process groups in spawned processes (real sends, stops and kills)."""

from __future__ import annotations

import os
import pickle
import queue
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_checkpointing_http import CTX, with_timeout_join
from test_checkpointing_serialization import assert_state_equal, make_state

from ftlaunch.checkpointing import PGTransport
from ftlaunch.checkpointing.pg_transport import TAG_BASE, TAG_SUMS, messages
from ftlaunch.checkpointing.serialization.buffers import tensor_bytes
from ftlaunch.checkpointing.serialization.checksum import checksums
from ftlaunch.checkpointing.serialization.encode import encode
from ftlaunch.checkpointing.serialization.header import frame_sums
from ftlaunch.errors import CheckpointTransportError

TIMEOUT = timedelta(seconds=30)
CPU = torch.device("cpu")
BIG = 200_000


def _outcome(fn: Callable[[], Any]) -> str:
    """Run one scenario step inside a worker: "ok", or the transport error's message."""
    try:
        fn()
        return "ok"
    except CheckpointTransportError as e:
        return f"CheckpointTransportError: {e}"


def _raw_send(
    pg: dist.ProcessGroup,
    dst: int,
    frame: bytes,
    tensors: list[torch.Tensor] | None = None,
    sums: bytes | None = None,
) -> None:
    """Speak the PGTransport protocol by hand (to send what an honest sender never would)."""
    t = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    pg.send([torch.tensor([len(frame)], dtype=torch.int64)], dst, TAG_BASE).wait()
    pg.send([t], dst, TAG_BASE + 1).wait()
    tensors = tensors or []
    for msg in messages([tensor_bytes(x).numel() for x in tensors], packed=False):  # CPU: one per tensor
        pg.send([torch.cat([tensor_bytes(tensors[i]) for i in msg])], dst, TAG_BASE + 2 + msg[0]).wait()
    if sums is not None:
        pg.send([torch.frombuffer(bytearray(sums), dtype=torch.uint8)], dst, TAG_SUMS).wait()


def _main_scenario(rank: int, pg: dist.ProcessGroup, ready: Any) -> dict[str, str]:
    """Rank 0 sends to ranks 1 and 2: an honest state, then corrupt and hostile payloads to rank 1."""
    out: dict[str, str] = {}

    def barrier() -> None:
        pg.barrier().wait()

    if rank == 0:
        state = make_state(5, BIG)
        transport: PGTransport = PGTransport(pg, TIMEOUT, CPU)
        out["send"] = _outcome(lambda: transport.send_checkpoint([1, 2], 5, state, TIMEOUT))
        barrier()
        payload = {"state": state, "dtensors": []}
        enc = encode(payload, 5, CPU, sums=False)
        frame = bytearray(enc.frame)
        frame[len(frame) // 2] ^= 0x10
        _raw_send(pg, 1, bytes(frame))
        barrier()
        _raw_send(pg, 1, pickle.dumps({"w": torch.zeros(3)}))
        barrier()
        honest_sums = frame_sums(checksums(enc.tensors))
        tensors = [tensor_bytes(t).clone() for t in enc.tensors]  # bytes exactly (bool clones normalize)
        big = enc.header.tensors[-1].index
        tensor_bytes(tensors[big])[1000] ^= 0x01
        _raw_send(pg, 1, enc.frame, tensors, honest_sums)
        barrier()
        bad_sums = bytearray(honest_sums)
        bad_sums[-1] ^= 0x01
        _raw_send(pg, 1, enc.frame, enc.tensors, bytes(bad_sums))
        barrier()
        _raw_send(pg, 1, encode(payload, 5, CPU).frame)  # sums in the header: not this protocol
        barrier()
        # torchft's forms: no timeout (the transport's own), and timedelta(0) (no deadline of the call's own)
        out["send default timeout"] = _outcome(lambda: transport.send_checkpoint([1], 6, make_state(6, 10)))
        barrier()
        out["send no deadline"] = _outcome(
            lambda: transport.send_checkpoint([2], 6, make_state(6, 10), timedelta(0))
        )
        barrier()
        quick = timedelta(seconds=3)  # the receiver refuses this one: our sends may be left unmatched
        out["wrong step"] = _outcome(lambda: transport.send_checkpoint([1], 7, {"w": torch.ones(3)}, quick))
    elif rank == 1:
        transport = PGTransport(pg, TIMEOUT, CPU)

        def recv_and_check() -> None:
            assert_state_equal(transport.recv_checkpoint(0, "<pg>", 5, TIMEOUT), make_state(5, BIG))

        out["recv"] = _outcome(recv_and_check)
        barrier()
        out["corrupt header"] = _outcome(lambda: transport.recv_checkpoint(0, "<pg>", 5, TIMEOUT))
        barrier()
        out["pickle"] = _outcome(lambda: transport.recv_checkpoint(0, "<pg>", 5, TIMEOUT))
        barrier()
        out["corrupt body"] = _outcome(lambda: transport.recv_checkpoint(0, "<pg>", 5, TIMEOUT))
        barrier()
        out["corrupt sums"] = _outcome(lambda: transport.recv_checkpoint(0, "<pg>", 5, TIMEOUT))
        barrier()
        out["sums in the header"] = _outcome(lambda: transport.recv_checkpoint(0, "<pg>", 5, TIMEOUT))
        barrier()
        out["recv no deadline"] = _outcome(
            lambda: assert_state_equal(
                transport.recv_checkpoint(0, "<pg>", 6, timedelta(0)), make_state(6, 10)
            )
        )
        barrier()
        barrier()
        out["wrong step"] = _outcome(lambda: transport.recv_checkpoint(0, "<pg>", 8, TIMEOUT))
    else:
        mine = make_state(77, BIG)
        ptrs = {k: v.data_ptr() for k, v in mine["model"].items()}
        transport = PGTransport(pg, TIMEOUT, CPU, state_dict=lambda: mine)

        def recv_in_place() -> None:
            got = transport.recv_checkpoint(0, "<pg>", 5, TIMEOUT)
            assert_state_equal(got, make_state(5, BIG))
            for k, t in got["model"].items():
                assert t is mine["model"][k] and t.data_ptr() == ptrs[k], f"{k} not received in place"

        out["recv in place"] = _outcome(recv_in_place)
        for _ in range(7):
            barrier()
        out["recv default timeout"] = _outcome(
            lambda: assert_state_equal(
                PGTransport(pg, TIMEOUT, CPU).recv_checkpoint(0, "<pg>", 6), make_state(6, 10)
            )
        )
        barrier()
    return out


def _silent_sender_scenario(rank: int, pg: dist.ProcessGroup, ready: Any) -> dict[str, str]:
    """Rank 0 never sends (the test stops or kills it); rank 1 must fail, not hang.

    Rank 0 announces itself on its own queue: a process stopped or killed while its queue feeder
    holds the queue's shared write lock would block every other writer of that queue.
    """
    if rank == 0:
        ready.put(os.getpid())
        time.sleep(60)
        return {}
    t0 = time.monotonic()
    timeout = timedelta(seconds=float(os.environ.get("CKPT_TEST_RECV_TIMEOUT", "3")))
    result = _outcome(lambda: PGTransport(pg, TIMEOUT, CPU).recv_checkpoint(0, "<pg>", 1, timeout))
    return {"recv": result, "elapsed": f"{time.monotonic() - t0:.2f}"}


def _packed_scenario(rank: int, pg: dist.ProcessGroup, ready: Any) -> dict[str, str]:
    """Small tensors packed (the default on a GPU, forced here on CPU): rank 0 sends a state of many
    small tensors, a large one and empty ones; rank 1 receives it fresh, rank 2 in place."""
    state = make_state(9, BIG)
    state["many"] = [torch.full((100 + i,), float(i)) for i in range(300)]
    if rank == 0:
        transport: PGTransport = PGTransport(pg, TIMEOUT, CPU, packed=True)
        return {"send": _outcome(lambda: transport.send_checkpoint([1, 2], 9, state, TIMEOUT))}
    mine = make_state(0, BIG)
    mine["many"] = [torch.zeros(100 + i) for i in range(300)]
    before = [t.data_ptr() for t in mine["many"]]
    receiver = PGTransport(pg, TIMEOUT, CPU, state_dict=(lambda: mine) if rank == 2 else None, packed=True)

    def recv_and_check() -> None:
        got = receiver.recv_checkpoint(0, "<pg>", 9, TIMEOUT)
        assert_state_equal(got, state)
        if rank == 2:
            assert [t.data_ptr() for t in got["many"]] == before  # landed in the receiver's own tensors

    return {"recv": _outcome(recv_and_check)}


SCENARIOS = {"main": _main_scenario, "silent": _silent_sender_scenario, "packed": _packed_scenario}


def _worker(rank: int, world: int, port: int, scenario: str, q: Any, ready: Any, env: dict[str, str]) -> None:
    os.environ.update(env)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
        pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=60))
        q.put(("done", rank, SCENARIOS[scenario](rank, pg, ready)))
    except BaseException as e:  # reported to the test
        q.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    q.close()
    q.join_thread()
    os._exit(0)  # skip the Gloo destructor: a refused transfer may leave sends unmatched


class World:
    """``world`` spawned ranks sharing a Gloo process group whose store lives in the test process."""

    def __init__(self, world: int, scenario: str, env: dict[str, str] | None = None) -> None:
        ctx = CTX
        self.store = dist.TCPStore(
            "127.0.0.1", 0, world, True, timeout=timedelta(seconds=60), wait_for_workers=False
        )
        self.q, self.ready = ctx.Queue(), ctx.Queue()
        args = (world, self.store.port, scenario, self.q, self.ready, env or {})
        self.procs = [ctx.Process(target=_worker, args=(r, *args), daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def wait_ready(self, timeout: float) -> int:
        """The pid rank 0 announces; a rank that failed meanwhile fails the test at once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self.ready.get(timeout=0.2)
            except queue.Empty:
                pass
            try:
                kind, rank, payload = self.q.get_nowait()
            except queue.Empty:
                continue
            raise AssertionError(f"rank {rank} finished early ({kind}):\n{payload}")
        raise AssertionError("rank 0 did not get ready in time")

    def results(self, n: int, timeout: float = 120) -> dict[int, dict[str, str]]:
        out: dict[int, dict[str, str]] = {}
        deadline = time.monotonic() + timeout
        while len(out) < n:
            kind, rank, payload = self.q.get(timeout=max(0.1, deadline - time.monotonic()))
            if kind == "error":
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            out[rank] = payload
        return out

    def close(self) -> None:
        for p in self.procs:
            with_timeout_join(p)
        del self.store


@pytest.mark.timeout(180)
def test_small_tensors_travel_packed_and_land_in_place() -> None:
    world = World(3, "packed")
    try:
        res = world.results(3)
    finally:
        world.close()
    assert res[0]["send"] == "ok" and res[1]["recv"] == "ok" and res[2]["recv"] == "ok", res


@pytest.mark.timeout(180)
def test_send_receive_and_hostile_payloads() -> None:
    world = World(3, "main")
    try:
        res = world.results(3)
    finally:
        world.close()
    assert res[0]["send"] == "ok"
    assert res[1]["recv"] == "ok"
    assert res[2]["recv in place"] == "ok"
    assert res[0]["send default timeout"] == res[0]["send no deadline"] == "ok"
    assert res[1]["recv no deadline"] == res[2]["recv default timeout"] == "ok"
    assert "header checksum mismatch" in res[1]["corrupt header"]
    assert "bad magic" in res[1]["pickle"]
    assert f"float32[{BIG}]): payload corrupted" in res[1]["corrupt body"], res[1]["corrupt body"]
    assert "sums frame checksum mismatch" in res[1]["corrupt sums"], res[1]["corrupt sums"]
    assert "where the sums frame was to carry it" in res[1]["sums in the header"], res[1][
        "sums in the header"
    ]
    assert "checkpoint is for step 7, expected step 8" in res[1]["wrong step"]
    assert res[0]["wrong step"] == "ok" or res[0]["wrong step"].startswith("CheckpointTransportError")


def _silent_world(action: str, recv_timeout: float) -> dict[str, str]:
    world = World(2, "silent", env={"CKPT_TEST_RECV_TIMEOUT": str(recv_timeout)})
    try:
        pid = world.wait_ready(timeout=90)
        os.kill(pid, signal.SIGSTOP if action == "stop" else signal.SIGKILL)
        return world.results(1)[1]
    finally:
        world.procs[0].kill()  # rank 0 has served its purpose (stopped or dead)
        world.close()


@pytest.mark.timeout(150)
def test_stopped_sender_times_out() -> None:
    res = _silent_world("stop", recv_timeout=3)
    assert res["recv"].startswith("CheckpointTransportError") and "timed out" in res["recv"], res
    assert 2.5 < float(res["elapsed"]) < 30, res


@pytest.mark.timeout(150)
def test_killed_sender_fails_the_receive() -> None:
    # timedelta(0): no deadline of the call's own (torchft) - the lost connection still fails it.
    res = _silent_world("kill", recv_timeout=0)
    assert res["recv"].startswith("CheckpointTransportError"), res
    assert float(res["elapsed"]) < 45, res  # the lost connection is noticed, no need to wait 60 s
