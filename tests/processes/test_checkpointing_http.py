"""HTTPTransport over real sockets, with senders in other processes and misbehaving fake servers."""

from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch
from test_checkpointing_serialization import assert_state_equal, make_state

from ftlaunch.checkpointing import HTTPTransport
from ftlaunch.checkpointing.serialization.encode import dumps
from ftlaunch.checkpointing.serialization.header import FRAME_PREFIX_LEN, parse_frame_prefix, parse_header
from ftlaunch.checkpointing.serialization.spec import MAGIC
from ftlaunch.errors import CheckpointTransportError

TIMEOUT = timedelta(seconds=30)
CTX = mp.get_context("spawn")


# --------------------------------------------------------------------------------------------------
# a sender in another process


def _sender_main(q: Any, stop: Any, step: int, seed: int, big: int) -> None:
    transport: HTTPTransport = HTTPTransport(TIMEOUT, num_chunks=3)
    transport.send_checkpoint([1, 2], step, make_state(seed, big), TIMEOUT)
    q.put(transport.metadata())
    stop.wait(120)
    transport.shutdown()


@contextmanager
def sender_process(step: int = 5, seed: int = 0, big: int = 0) -> Iterator[tuple[str, mp.Process]]:
    ctx = CTX
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_sender_main, args=(q, stop, step, seed, big), daemon=True)
    proc.start()
    try:
        yield q.get(timeout=60), proc
    finally:
        stop.set()
        with_timeout_join(proc)


def with_timeout_join(proc: mp.Process) -> None:
    try:
        os.kill(proc.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    proc.join(15)
    if proc.is_alive():
        proc.kill()
        proc.join(10)


def _receiver_main(q: Any, url: str, step: int, seed: int, big: int, inplace: bool) -> None:
    try:
        mine = make_state(seed + 1000, big) if inplace else None
        transport: HTTPTransport = HTTPTransport(
            TIMEOUT, num_chunks=2, state_dict=(lambda: mine) if inplace else None
        )
        try:
            got = transport.recv_checkpoint(0, url, step, TIMEOUT)
        finally:
            transport.shutdown()
        assert_state_equal(got, make_state(seed, big))
        if inplace:
            assert got["model"]["t_float32"] is mine["model"]["t_float32"]
        q.put("ok")
    except BaseException as e:  # reported to the test
        q.put(f"{type(e).__name__}: {e}")


@pytest.fixture
def receiver() -> Iterator[HTTPTransport]:
    transport: HTTPTransport = HTTPTransport(TIMEOUT)
    yield transport
    transport.shutdown()


# --------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.timeout(120)
def test_round_trip_from_another_process(receiver: HTTPTransport) -> None:
    with sender_process(step=5, seed=3, big=600_000) as (url, _proc):
        got = receiver.recv_checkpoint(0, url, 5, TIMEOUT)
        assert_state_equal(got, make_state(3, 600_000))
        assert got["tied_a"] is got["tied_b"]
        # again: serving is repeatable until disallowed
        assert_state_equal(receiver.recv_checkpoint(0, url, 5, TIMEOUT), make_state(3, 600_000))
        t0 = time.monotonic()
        with pytest.raises(CheckpointTransportError, match="serving step 5, not step 4"):
            receiver.recv_checkpoint(0, url, 4, TIMEOUT)  # the source is past it: no point waiting
        assert time.monotonic() - t0 < 10
        with pytest.raises(CheckpointTransportError, match="serving step 5, not step 6.*until the timeout"):
            receiver.recv_checkpoint(0, url, 6, timedelta(seconds=0.5))  # not there yet: waits, then fails


@pytest.mark.timeout(120)
def test_in_place_receive_keeps_tensor_identity() -> None:
    mine = make_state(50)
    ptrs = {k: v.data_ptr() for k, v in mine["model"].items()}
    transport: HTTPTransport = HTTPTransport(TIMEOUT, state_dict=lambda: mine)
    try:
        with sender_process(step=9, seed=4) as (url, _proc):
            got = transport.recv_checkpoint(0, url, 9, TIMEOUT)
    finally:
        transport.shutdown()
    assert_state_equal(got, make_state(4))
    for k, t in got["model"].items():
        assert t is mine["model"][k] and t.data_ptr() == ptrs[k]


@pytest.mark.timeout(150)
def test_multiple_receivers_in_parallel() -> None:
    with sender_process(step=2, seed=7, big=300_000) as (url, _proc):
        ctx = CTX
        q = ctx.Queue()
        procs = [
            ctx.Process(target=_receiver_main, args=(q, url, 2, 7, 300_000, i == 1), daemon=True)
            for i in range(3)
        ]
        for p in procs:
            p.start()
        try:
            results = [q.get(timeout=100) for _ in procs]
        finally:
            for p in procs:
                with_timeout_join(p)
    assert results == ["ok"] * 3


def test_send_disallow_send_again(receiver: HTTPTransport) -> None:
    sender: HTTPTransport = HTTPTransport(TIMEOUT)
    short = timedelta(seconds=0.5)
    try:
        with pytest.raises(
            CheckpointTransportError, match="no checkpoint is being served.*until the timeout"
        ):
            receiver.recv_checkpoint(0, sender.metadata(), 1, short)
        sender.send_checkpoint([1], 1, {"w": torch.arange(10)}, TIMEOUT)
        assert torch.equal(receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)["w"], torch.arange(10))
        sender.disallow_checkpoint()
        with pytest.raises(
            CheckpointTransportError, match="no checkpoint is being served.*until the timeout"
        ):
            receiver.recv_checkpoint(0, sender.metadata(), 1, short)
        sender.send_checkpoint([1], 2, {"w": torch.arange(20)}, TIMEOUT)
        assert torch.equal(receiver.recv_checkpoint(0, sender.metadata(), 2, TIMEOUT)["w"], torch.arange(20))
    finally:
        sender.shutdown()


def test_receiver_waits_for_a_source_that_publishes_late(receiver: HTTPTransport) -> None:
    """Source and healer act on the same quorum at once: asking before the source serves is a wait."""
    sender: HTTPTransport = HTTPTransport(TIMEOUT)
    try:
        timer = threading.Timer(0.3, sender.send_checkpoint, args=([1], 5, {"w": torch.arange(7)}, TIMEOUT))
        timer.start()
        t0 = time.monotonic()
        got = receiver.recv_checkpoint(0, sender.metadata(), 5, TIMEOUT)
        assert torch.equal(got["w"], torch.arange(7))
        assert time.monotonic() - t0 >= 0.25
        timer.join()
    finally:
        sender.shutdown()


def test_empty_and_tensorless_states(receiver: HTTPTransport) -> None:
    sender: HTTPTransport = HTTPTransport(TIMEOUT)
    try:
        for state in ({}, {"step": 3, "x": [None, 1.5]}, {"e": torch.empty(0, 3)}):
            sender.send_checkpoint([1], 4, state, TIMEOUT)
            assert_state_equal(receiver.recv_checkpoint(0, sender.metadata(), 4, TIMEOUT), state)
    finally:
        sender.shutdown()


def test_mutating_a_served_tensor_is_detected(receiver: HTTPTransport) -> None:
    """Breaking the contract (mutating before disallow) yields an error, never a torn state."""
    sender: HTTPTransport = HTTPTransport(TIMEOUT)
    try:
        w = torch.randn(300_000)
        sender.send_checkpoint([1], 1, {"w": w}, TIMEOUT)
        w[12345] += 1.0
        with pytest.raises(CheckpointTransportError, match="checksum mismatch"):
            receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
    finally:
        sender.shutdown()


# --------------------------------------------------------------------------------------------------
# the HTTP protocol itself


def _request(url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_protocol_status_codes() -> None:
    sender: HTTPTransport = HTTPTransport(TIMEOUT)
    url = sender.metadata()
    try:
        assert _request(url, "/checkpoint/3/header")[0] == 503
        sender.send_checkpoint([1], 3, {"w": torch.arange(100, dtype=torch.int64)}, TIMEOUT)
        status, headers, frame = _request(url, "/checkpoint/3/header")
        assert status == 200 and headers["ETag"]
        header = parse_header(frame, expected_step=3)
        status, _, body = _request(url, "/checkpoint/3/body")
        assert status == 200 and len(body) == header.body_nbytes == 800
        status, h, part = _request(url, "/checkpoint/3/body", {"Range": "bytes=8-15"})
        assert status == 206 and h["Content-Range"] == "bytes 8-15/800" and part == body[8:16]
        for path, hdrs, code in [
            ("/checkpoint/4/header", {}, 409),
            ("/nope", {}, 404),
            ("/checkpoint/x/header", {}, 404),
            ("/checkpoint/3/body", {"Range": "bytes=0-800"}, 416),
            ("/checkpoint/3/body", {"Range": "bytes=0-1,4-5"}, 416),
            ("/checkpoint/3/body", {"Range": "items=0-1"}, 416),
            ("/checkpoint/3/body", {"If-Match": '"stale"'}, 412),
        ]:
            status, h, raw = _request(url, path, hdrs)
            assert status == code, (path, hdrs, status)
            assert h["Content-Type"] == "application/json" and json.loads(raw)["error"]
            if code == 409:
                assert json.loads(raw)["serving_step"] == 3
    finally:
        sender.shutdown()


@pytest.mark.timeout(60)
def test_disallow_cuts_off_a_transfer_in_progress() -> None:
    sender: HTTPTransport = HTTPTransport(TIMEOUT)
    try:
        sender.send_checkpoint([1], 1, {"w": torch.zeros(64 << 20, dtype=torch.uint8)}, TIMEOUT)
        host, port = sender.metadata().removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=20)
        conn.request("GET", "/checkpoint/1/body")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.length == 64 << 20
        assert len(resp.read(1 << 20)) == 1 << 20  # a slow reader, mid-transfer
        t0 = time.monotonic()
        sender.disallow_checkpoint()
        assert time.monotonic() - t0 < 15, "disallow must not wait for a stalled reader"
        with pytest.raises((http.client.IncompleteRead, ConnectionError)):
            resp.read()  # the rest never arrives
        conn.close()
    finally:
        sender.shutdown()


def test_shutdown_releases_port_and_threads() -> None:
    before = set(threading.enumerate())
    sender: HTTPTransport = HTTPTransport(TIMEOUT)
    receiver: HTTPTransport = HTTPTransport(TIMEOUT)
    url = sender.metadata()
    sender.send_checkpoint([1], 1, {"w": torch.randn(2_000_000)}, TIMEOUT)
    receiver.recv_checkpoint(0, url, 1, TIMEOUT)
    sender.shutdown()
    receiver.shutdown()
    sender.shutdown()  # idempotent
    assert set(threading.enumerate()) - before == set()
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))
    with pytest.raises(CheckpointTransportError, match="shut down"):
        sender.send_checkpoint([1], 2, {}, TIMEOUT)


# --------------------------------------------------------------------------------------------------
# failures: bad addresses, timeouts, misbehaving servers


def test_bad_address_and_refused_connection(receiver: HTTPTransport) -> None:
    with pytest.raises(CheckpointTransportError, match="bad checkpoint address"):
        receiver.recv_checkpoint(0, "not a url", 1, TIMEOUT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        with pytest.raises(CheckpointTransportError, match="ConnectionRefused"):
            receiver.recv_checkpoint(0, f"http://127.0.0.1:{port}", 1, TIMEOUT)


@pytest.mark.timeout(90)
def test_stopped_sender_times_out(receiver: HTTPTransport) -> None:
    with sender_process(step=1, seed=0) as (url, proc):
        os.kill(proc.pid, signal.SIGSTOP)  # alive but silent: the kernel still accepts connections
        t0 = time.monotonic()
        with pytest.raises(CheckpointTransportError, match="timed out"):
            receiver.recv_checkpoint(0, url, 1, timedelta(seconds=2))
        elapsed = time.monotonic() - t0
        os.kill(proc.pid, signal.SIGCONT)
    assert 1.5 < elapsed < 20, elapsed


class _FakeServer:
    """Speaks our protocol from a recorded payload, but misbehaves as told."""

    def __init__(
        self, frame: bytes, body: bytes, behave: Callable[[BaseHTTPRequestHandler, str, bytes], bool]
    ):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                what = self.path.rsplit("/", 1)[-1]
                data = outer.frame if what == "header" else outer.body
                if what == "body" and "Range" in self.headers:
                    a, b = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
                    data = data[a : b + 1]
                if behave(self, what, data):
                    return
                self.send_response(200 if what == "header" or "Range" not in self.headers else 206)
                if what == "body" and "Range" in self.headers:
                    a, b = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
                    self.send_header("Content-Range", f"bytes {a}-{b}/{len(outer.body)}")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("ETag", '"fake"')
                self.end_headers()
                self.wfile.write(data)

        self.frame, self.body = frame, body
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.total = len(body)  # type: ignore[attr-defined]
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@contextmanager
def fake_server(
    behave: Callable[[BaseHTTPRequestHandler, str, bytes], bool],
    frame: bytes | None = None,
    body: bytes | None = None,
) -> Iterator[_FakeServer]:
    payload = dumps(make_state(8, 400_000), step=1)
    length = parse_frame_prefix(payload)
    srv = _FakeServer(
        payload[: FRAME_PREFIX_LEN + length] if frame is None else frame,
        payload[FRAME_PREFIX_LEN + length :] if body is None else body,
        behave,
    )
    try:
        yield srv
    finally:
        srv.close()


def _honest(_h: BaseHTTPRequestHandler, _what: str, _data: bytes) -> bool:
    return False


def test_fake_server_is_faithful(receiver: HTTPTransport) -> None:
    """The fake server, behaving, delivers a correct state (so its misbehaviours below are the cause)."""
    with fake_server(_honest) as srv:
        assert_state_equal(receiver.recv_checkpoint(0, srv.url, 1, TIMEOUT), make_state(8, 400_000))


def test_corrupted_header_is_rejected(receiver: HTTPTransport) -> None:
    payload = dumps(make_state(8, 400_000), step=1)
    length = parse_frame_prefix(payload)
    frame = bytearray(payload[: FRAME_PREFIX_LEN + length])
    frame[FRAME_PREFIX_LEN + length // 2] ^= 0x04
    with fake_server(_honest, frame=bytes(frame)) as srv:
        with pytest.raises(CheckpointTransportError, match="header checksum mismatch"):
            receiver.recv_checkpoint(0, srv.url, 1, TIMEOUT)


def test_corrupted_body_is_rejected(receiver: HTTPTransport) -> None:
    payload = dumps(make_state(8, 400_000), step=1)
    length = parse_frame_prefix(payload)
    body = bytearray(payload[FRAME_PREFIX_LEN + length :])
    body[len(body) - 1000] ^= 0x01  # inside the big tensor, the last one in the body
    with fake_server(_honest, body=bytes(body)) as srv:
        with pytest.raises(CheckpointTransportError, match="checksum mismatch"):
            receiver.recv_checkpoint(0, srv.url, 1, TIMEOUT)


def test_pickle_is_rejected(receiver: HTTPTransport) -> None:
    evil = pickle.dumps({"w": torch.zeros(3)})
    with fake_server(_honest, frame=evil) as srv:
        with pytest.raises(CheckpointTransportError, match="magic"):
            receiver.recv_checkpoint(0, srv.url, 1, TIMEOUT)


def test_huge_header_claim_is_rejected(receiver: HTTPTransport) -> None:
    raw = b"{}"
    frame = MAGIC + struct.pack("<QI", 2**40, zlib.crc32(raw)) + raw
    with fake_server(_honest, frame=frame) as srv:
        with pytest.raises(CheckpointTransportError, match="exceeds"):
            receiver.recv_checkpoint(0, srv.url, 1, TIMEOUT)


def _start_partial(h: BaseHTTPRequestHandler, data: bytes) -> None:
    """Headers of a correct 206 answer to the request's range."""
    h.send_response(206)
    a, b = (int(x) for x in h.headers["Range"].removeprefix("bytes=").split("-"))
    h.send_header("Content-Range", f"bytes {a}-{b}/{h.server.total}")  # type: ignore[attr-defined]
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()


def _truncate_body(h: BaseHTTPRequestHandler, what: str, data: bytes) -> bool:
    if what != "body":
        return False
    _start_partial(h, data)
    h.wfile.write(data[: len(data) // 2])
    h.close_connection = True
    h.connection.shutdown(socket.SHUT_RDWR)  # close early
    return True


def test_truncated_body_is_rejected(receiver: HTTPTransport) -> None:
    with fake_server(_truncate_body) as srv:
        with pytest.raises(CheckpointTransportError, match="truncated"):
            receiver.recv_checkpoint(0, srv.url, 1, TIMEOUT)


def _truncate_header(h: BaseHTTPRequestHandler, what: str, data: bytes) -> bool:
    if what != "header":
        return False
    h.send_response(200)
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data[:30])
    h.close_connection = True
    h.connection.shutdown(socket.SHUT_RDWR)
    return True


def test_truncated_header_is_rejected(receiver: HTTPTransport) -> None:
    with fake_server(_truncate_header) as srv:
        with pytest.raises(CheckpointTransportError, match="truncated"):
            receiver.recv_checkpoint(0, srv.url, 1, TIMEOUT)


def _wrong_range(h: BaseHTTPRequestHandler, what: str, data: bytes) -> bool:
    if what != "body":
        return False
    h.send_response(200)  # ignores Range: sends the whole body with 200
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)
    return True


def test_server_ignoring_range_is_rejected(receiver: HTTPTransport) -> None:
    with fake_server(_wrong_range) as srv:
        with pytest.raises(CheckpointTransportError, match="answered 200"):
            receiver.recv_checkpoint(0, srv.url, 1, TIMEOUT)


def _raw_partial(h: BaseHTTPRequestHandler, data: bytes, first: bytes) -> None:
    """A correct 206 answer whose headers and ``first`` bytes go out in one write (so the client's
    buffered reader takes body bytes along with the headers), then ``data[len(first):]`` later."""
    a, b = (int(x) for x in h.headers["Range"].removeprefix("bytes=").split("-"))
    head = (
        f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/{h.server.total}\r\n"  # type: ignore[attr-defined]
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    h.wfile.write(head + first)
    time.sleep(0.05)
    h.wfile.write(data[len(first) :])


def test_body_bytes_arriving_with_the_headers_are_kept(receiver: HTTPTransport) -> None:
    """The body is read straight from the socket after the headers: bytes http.client's buffered
    reader already took must come first, whatever their number."""
    for n in (1, 777, 4000):

        def early(h: BaseHTTPRequestHandler, what: str, data: bytes, n: int = n) -> bool:
            if what != "body":
                return False
            _raw_partial(h, data, data[:n])
            return True

        with fake_server(early) as srv:
            assert_state_equal(receiver.recv_checkpoint(0, srv.url, 1, TIMEOUT), make_state(8, 400_000))


def test_bytes_beyond_the_range_are_rejected(receiver: HTTPTransport) -> None:
    payload = dumps({"w": torch.arange(100)}, step=1)  # one small range: it fits the first read
    length = parse_frame_prefix(payload)

    def overlong(h: BaseHTTPRequestHandler, what: str, data: bytes) -> bool:
        if what != "body":
            return False
        _raw_partial(h, data, data + b"trailing garbage")
        return True

    frame, body = payload[: FRAME_PREFIX_LEN + length], payload[FRAME_PREFIX_LEN + length :]
    with fake_server(overlong, frame=frame, body=body) as srv:
        with pytest.raises(CheckpointTransportError, match="sent more than"):
            receiver.recv_checkpoint(0, srv.url, 1, TIMEOUT)


def test_fresh_receive_of_many_pieces(receiver: HTTPTransport) -> None:
    """Large fresh tensors arrive in several pieces per connection, each pre-faulted before its
    read; sizes straddle page, checksum-block and piece boundaries."""
    g = torch.Generator().manual_seed(11)
    state = {
        "a": torch.randn(3 * (1 << 20) + 5, generator=g),  # > PIECE_BYTES: split across pieces
        "b": torch.randint(-(2**62), 2**62, (700_001,), generator=g),
        "c": torch.randn(513, 1031, generator=g).to(torch.bfloat16).t(),  # non-contiguous source
        "d": torch.rand(1 << 20, generator=g) > 0.5,
        "e": torch.tensor(2.5, dtype=torch.float64),
    }
    sender: HTTPTransport = HTTPTransport(TIMEOUT)
    try:
        sender.send_checkpoint([1], 4, state, TIMEOUT)
        got = receiver.recv_checkpoint(0, sender.metadata(), 4, TIMEOUT)
    finally:
        sender.shutdown()
    assert_state_equal(got, state)
    assert all(t.is_contiguous() for t in got.values())


def failing_receive(
    receiver: HTTPTransport,
    behave: Callable[[BaseHTTPRequestHandler, str, bytes], bool],
    release: threading.Event,
    match: str,
    timeout: float,
) -> float:
    """Seconds ``receiver`` took to fail (as ``match`` says) against a fake server misbehaving as
    ``behave`` does until ``release`` is set (set once the receiver gave up)."""
    with fake_server(behave) as srv:
        t0 = time.monotonic()
        try:
            with pytest.raises(CheckpointTransportError, match=match):
                receiver.recv_checkpoint(0, srv.url, 1, timedelta(seconds=timeout))
            return time.monotonic() - t0
        finally:
            release.set()


@pytest.mark.timeout(60)
def test_stalled_body_times_out(receiver: HTTPTransport) -> None:
    release = threading.Event()

    def stall(h: BaseHTTPRequestHandler, what: str, data: bytes) -> bool:
        if what != "body":
            return False
        _start_partial(h, data)
        h.wfile.write(data[:1000])
        release.wait(30)  # then go silent, connection open
        return True

    elapsed = failing_receive(receiver, stall, release, "timed out", 2)
    assert 1.5 < elapsed < 20, elapsed


@pytest.mark.timeout(60)
def test_a_poll_cut_by_the_deadline_still_says_the_step_was_not_served(receiver: HTTPTransport) -> None:
    """A source that said "not yet" and then went silent mid-poll (a loaded or stopped host) is
    reported as not serving the step, not as a bare socket timeout (CI saw the latter)."""
    release = threading.Event()
    polls = []

    def not_yet_then_silent(h: BaseHTTPRequestHandler, what: str, data: bytes) -> bool:
        polls.append(what)
        if len(polls) == 1:
            h.send_response(503)
            doc = b'{"error": "step 1 is not served yet"}'
            h.send_header("Content-Length", str(len(doc)))
            h.end_headers()
            h.wfile.write(doc)
        else:
            release.wait(30)
        return True

    elapsed = failing_receive(receiver, not_yet_then_silent, release, "answered 503.*until the timeout", 1)
    assert len(polls) == 2 and 0.8 < elapsed < 15, (polls, elapsed)


@pytest.mark.timeout(60)
def test_trickling_header_times_out(receiver: HTTPTransport) -> None:
    """A server that keeps the socket busy (a byte now and then) cannot stretch the timeout."""
    release = threading.Event()

    def trickle(h: BaseHTTPRequestHandler, what: str, data: bytes) -> bool:
        if what != "header":
            return False
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        for b in data:
            if release.wait(0.3):
                break
            try:
                h.wfile.write(bytes([b]))
            except OSError:
                break
        return True

    elapsed = failing_receive(receiver, trickle, release, "timed out", 2)
    assert 1.5 < elapsed < 20, elapsed


def test_default_connections_follow_the_usable_cpus() -> None:
    from ftlaunch.checkpointing.http_transport import default_num_chunks

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    assert default_num_chunks() == max(1, min(4, cpus))
    transport: HTTPTransport = HTTPTransport(TIMEOUT)
    try:
        assert transport._num_chunks == default_num_chunks()
    finally:
        transport.shutdown()
    with pytest.raises(ValueError, match="num_chunks"):
        HTTPTransport(TIMEOUT, num_chunks=-1)


@pytest.mark.timeout(120)
def test_torchft_forms_no_chunking_and_the_default_timeout() -> None:
    """torchft's ``HTTPTransport(timeout, num_chunks=0)`` (0 = no chunking) and calls that leave
    ``timeout`` out (the transport's own); ``timedelta(0)`` also means the transport's own."""
    sender: HTTPTransport = HTTPTransport(TIMEOUT, 0)
    receiver: HTTPTransport = HTTPTransport(timedelta(seconds=1), num_chunks=0)
    try:
        assert receiver._num_chunks == 1
        sender.send_checkpoint([1], 3, make_state(4, 300_000))
        assert_state_equal(receiver.recv_checkpoint(0, sender.metadata(), 3), make_state(4, 300_000))
        assert_state_equal(
            receiver.recv_checkpoint(0, sender.metadata(), 3, timedelta(0)), make_state(4, 300_000)
        )
        t0 = time.monotonic()
        with pytest.raises(CheckpointTransportError, match="until the timeout"):
            receiver.recv_checkpoint(0, sender.metadata(), 4)  # not served: bounded by the 1 s default
        assert 0.8 < time.monotonic() - t0 < 15
    finally:
        sender.shutdown()
        receiver.shutdown()


@pytest.mark.parametrize("bind", ["127.0.0.1:0", "::1", "[::1]:0"])
def test_bind_forms_and_ipv6(bind: str) -> None:
    sender: HTTPTransport = HTTPTransport(TIMEOUT, bind=bind)
    receiver: HTTPTransport = HTTPTransport(TIMEOUT, bind=bind)
    try:
        url = sender.metadata()
        assert url.startswith("http://[::1]:" if "::1" in bind else "http://127.0.0.1:")
        sender.send_checkpoint([1], 3, {"x": torch.arange(5)}, TIMEOUT)
        assert torch.equal(receiver.recv_checkpoint(0, url, 3, TIMEOUT)["x"], torch.arange(5))
    finally:
        sender.shutdown()
        receiver.shutdown()


# --------------------------------------------------------------------------------------------------
# a hostile header: valid, but hundreds of thousands of tiny tensors


def hostile_frame(n: int, step: int = 1) -> tuple[bytes, bytes]:
    """A *valid* payload of ``n`` zero-filled one-element tensors: cheap to send, costly to parse,
    allocate and lay out (400k entries took a receiver 10 s and ~500 MiB against a 4 s timeout)."""
    zero = "0" * 32
    tensors = ",".join(
        f'{{"dtype":"float32","shape":[1],"offset":{i * 64},"nbytes":4,"sum":"{zero}","requires_grad":false}}'
        for i in range(n)
    )
    tree = ",".join(f'{{"tensor":{i}}}' for i in range(n))
    doc = (
        f'{{"format":"ftlaunch.checkpoint","version":1,"step":{step},"byteorder":"{sys.byteorder}",'
        f'"checksum":"sum64-v1","alignment":64,"body_nbytes":{n * 64 - 60},"tensors":[{tensors}],'
        f'"tree":{{"list":[{tree}]}}}}'
    )
    raw = doc.encode()
    return MAGIC + struct.pack("<QI", len(raw), zlib.crc32(raw)) + raw, bytes(n * 64 - 60)


def test_a_hostile_header_is_refused_before_it_is_read_by_a_receiver_that_expects_its_own_state() -> None:
    """The healer's own state says what to expect (`expect_like`): a header far larger is refused
    from its length alone, with almost no memory, whatever the timeout."""
    frame, body = hostile_frame(400_000)
    own = {
        "model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)},
        "optim": {"state": {}, "param_groups": []},
    }
    with HTTPTransport(TIMEOUT) as rx, fake_server(_honest, frame=frame, body=body) as srv:
        rx.expect_like(own)
        tracemalloc.start()
        try:
            with pytest.raises(CheckpointTransportError, match="more than the .* this receiver accepts"):
                rx.recv_checkpoint(0, srv.url, 1, TIMEOUT)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, peak  # the 56 MB header was never read (its JSON alone took ~200 MiB)
        # Under the byte limit but with more tensors than expected: refused before any is allocated.
        rx.expect_like({"w": torch.zeros(1)})
        small, small_body = hostile_frame(5000)
        assert len(small) < rx._limits.max_header_bytes  # type: ignore[union-attr]
    with HTTPTransport(TIMEOUT) as rx, fake_server(_honest, frame=small, body=small_body) as srv:
        rx.expect_like({"w": torch.zeros(1)})
        with pytest.raises(CheckpointTransportError, match="lists 5000 tensors, more than the 4112"):
            rx.recv_checkpoint(0, srv.url, 1, TIMEOUT)


def test_a_hostile_header_costs_a_receiver_no_more_than_its_timeout() -> None:
    """Without a hint (the format's limits only), the parse, validation, allocation and layout
    of a hostile header stop at the transfer's deadline with the transport's error."""
    frame, body = hostile_frame(400_000)
    with HTTPTransport(TIMEOUT) as rx, fake_server(_honest, frame=frame, body=body) as srv:
        with pytest.raises(
            CheckpointTransportError,
            match=r"timed out after 1\.0s (parsing|validating|allocating|preparing|laying)",
        ):
            rx.recv_checkpoint(0, srv.url, 1, timedelta(seconds=1))


def test_an_honest_state_larger_than_the_receivers_own_is_received() -> None:
    """A healer before its first step has no optimizer state yet; its source has (Adam: 2 more
    tensors per parameter and a step each): the limits leave room for that."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(50)])
    opt = torch.optim.Adam(model.parameters())
    fresh = {"model": model.state_dict(), "optim": opt.state_dict()}
    model(torch.zeros(1, 4)).sum().backward()
    opt.step()
    full = {"model": model.state_dict(), "optim": opt.state_dict()}
    with HTTPTransport(TIMEOUT) as tx, HTTPTransport(TIMEOUT) as rx:
        tx.send_checkpoint([1], 3, full, TIMEOUT)
        rx.expect_like(fresh)
        got = rx.recv_checkpoint(0, tx.metadata(), 3, TIMEOUT)
        assert torch.equal(got["optim"]["state"][0]["exp_avg"], full["optim"]["state"][0]["exp_avg"])
