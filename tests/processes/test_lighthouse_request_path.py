"""The quorum request path's shortcuts decide exactly as the long ways they skip."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys

import pytest

from ftlaunch.lighthouse import bodies
from ftlaunch.lighthouse.bodies import expect_fields as _expect
from ftlaunch.lighthouse.bodies import loads as _loads
from ftlaunch.lighthouse.connection import Connection
from ftlaunch.lighthouse.http import HeadParser, HttpError, Request, Response, body_length, with_new_length
from ftlaunch.lighthouse.membership import Membership
from ftlaunch.lighthouse.quorum import QuorumOptions
from ftlaunch.lighthouse.routes import Routes
from ftlaunch.lighthouse.server import GC_THRESHOLDS
from ftlaunch.lighthouse.transport import HttpServer


@pytest.fixture(params=["fast", "fallback"])
def codec(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each body test runs with msgspec's decoder (``ftlaunch[fast]``) and with json's path alone,
    the fallback when the wheel is missing."""
    if request.param == "fallback":
        monkeypatch.setattr(bodies, "fast_decode", None)
    elif bodies.fast_decode is None:
        pytest.skip("msgspec is not installed (pip install ftlaunch[fast])")
    return str(request.param)


QUORUM_FIELDS = ({"member": (dict,)}, {"timeout": (float, int), "progress": (dict,), "known": (str,)})


def test_bodies_in_other_encodings_still_parse(codec: str) -> None:
    obj = {"member": {"replica_id": "g\u00e9", "step": 1}}
    for encoding in ("utf-8", "utf-16", "utf-32"):
        assert _loads(json.dumps(obj, ensure_ascii=False).encode(encoding)) == obj
    with pytest.raises(ValueError):
        _loads(b"{not json")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"member": {}, "timeout": True}, "field 'timeout' must be float, got bool"),
        ({"member": {}, "extra": 1, "zzz": 2}, "unknown field(s): 'extra', 'zzz'"),
        ({"timeout": 1}, "missing field 'member'"),
        ({"member": []}, "field 'member' must be dict, got list"),
    ],
)
def test_field_checks_name_what_is_wrong(body: dict, message: str) -> None:
    with pytest.raises(HttpError) as e:
        _expect(body, *QUORUM_FIELDS)
    assert e.value.status == 400 and e.value.message == message


def test_well_formed_bodies_pass() -> None:
    _expect({"member": {}, "timeout": 60, "known": "r-1"}, *QUORUM_FIELDS)
    _expect({"member": {}, "timeout": 0.5}, *QUORUM_FIELDS)


def test_collect_less_freezes_and_raises_the_threshold_in_its_process_only() -> None:
    code = (
        "import gc; from ftlaunch.lighthouse.server import collect_less; collect_less(); "
        "print(gc.get_threshold(), gc.get_freeze_count() > 0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.split() == [f"({GC_THRESHOLDS[0]},", f"{GC_THRESHOLDS[1]},", f"{GC_THRESHOLDS[2]})", "True"]
    import gc

    assert gc.get_threshold() != GC_THRESHOLDS  # importing the server changed nothing here


# ---- the lean request path: each shortcut reads what the long way reads


@pytest.mark.parametrize(
    "body",
    [
        b'{"member": {"replica_id": "a", "step": 1}, "timeout": 60}',
        b' {"a": 1} ',
        b'{"a": 1}\n',
        b"[1, 2]",
        b'"s"',
        b'{"a": NaN}',
        b'{"a": "\\ud800"}',
        b'{"a": 1}x',
        b'{"a": 1}{"b": 2}',
        b"",
        b"  ",
        b"\xff{}",
        b'{"a": 1',
        b"nul",
        b'{"big": 123456789012345678901234567890, "f": 1e400, "d": {"a": 1, "a": 2}}',
        b'\xef\xbb\xbf{"a": 1}',
    ],
)
def test_loads_reads_what_json_loads_reads(body: bytes, codec: str) -> None:
    """`bodies.loads` reads a bare value with json's scanner; whitespace, trailing bytes and errors
    must come out as json.loads has them (a value, or a ValueError: 400)."""
    try:
        expected = json.dumps(json.loads(body))
    except ValueError:
        with pytest.raises(ValueError):
            _loads(body)
        return
    assert json.dumps(_loads(body)) == expected


class _Recorder:
    """A `http.Handler` that answers every request with its own body and the value of header X-A."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None, bytes]] = []

    def handle(self, request: Request) -> Response:
        self.seen.append((request.path, request.header("X-A"), request.body))
        return Response(200, request.body)

    def error(self, error: HttpError, head: object, peer: str) -> Response:
        return Response(error.status, error.message.encode(), close=error.close)

    def identity_lost(self, identity: str) -> None:
        pass


class _Wire(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = b""

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out += bytes(data)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def _connection() -> tuple[Connection, _Recorder, _Wire, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    handler = _Recorder()
    server = HttpServer(socket.socket(), handler, idle_timeout=60.0, read_timeout=10.0, max_body=1 << 20)
    server.loop = loop
    conn = Connection(server, loop)
    wire = _Wire()
    conn.connection_made(wire)
    return conn, handler, wire, loop


def _send(conn: Connection, data: bytes) -> None:
    buf = conn.get_buffer(len(data))
    buf[: len(data)] = data
    conn.buffer_updated(len(data))


def _req(body: bytes, a: str = "1", path: str = "/p") -> bytes:
    return f"POST {path} HTTP/1.1\r\nX-A: {a}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def test_a_repeated_head_read_whole_is_served_as_the_long_way_serves_it() -> None:
    """A read that is exactly one request with the head parsed last time skips the buffering and the
    head search; anything else (another head of the same length, a partial request, two requests in
    one read, a different body length) takes the long way. Every request is answered, in order,
    with its own body and headers."""
    conn, handler, wire, loop = _connection()
    try:
        reads = [
            _req(b"aaaa"),  # parsed in full: the head to reuse
            _req(b"bbbb"),  # the same head, read whole: the shortcut
            _req(b"cccc", a="2"),  # a head of the same length that differs: parsed again
            _req(b"dddd", a="2")[:10],
            _req(b"dddd", a="2")[10:],  # one request in two reads
            _req(b"eeee", a="2") + _req(b"ffff", a="2"),  # two requests in one read
            _req(b"gggggg", a="2"),  # another body length: another head
            _req(b"hhhhhh", a="2"),
        ]
        for data in reads:
            _send(conn, data)
        assert handler.seen == [
            ("/p", "1", b"aaaa"), ("/p", "1", b"bbbb"), ("/p", "2", b"cccc"), ("/p", "2", b"dddd"),
            ("/p", "2", b"eeee"), ("/p", "2", b"ffff"), ("/p", "2", b"gggggg"), ("/p", "2", b"hhhhhh"),
        ]  # fmt: skip
        bodies = [part.split(b"\r\n\r\n", 1)[1] for part in wire.out.split(b"HTTP/1.1 ")[1:]]
        assert bodies == [b"aaaa", b"bbbb", b"cccc", b"dddd", b"eeee", b"ffff", b"gggggg", b"hhhhhh"]
    finally:
        loop.close()


def test_the_token_is_checked_on_every_request_of_a_reused_head() -> None:
    """The token's usual spelling is compared whole (constant time) before the long way: other
    spellings the long way accepts still pass, a wrong token on a reused head is still refused."""
    membership = Membership(QuorumOptions())
    routes = Routes(membership, token="s3cret", snapshot=lambda: None)  # type: ignore[arg-type,return-value]
    parser = HeadParser()

    def code(authorization: str | None) -> int:
        auth = f"Authorization: {authorization}\r\n" if authorization is not None else ""
        body = b'{"replica_id": "a"}'
        head = parser.parse(
            f"POST /v1/heartbeat HTTP/1.1\r\n{auth}Content-Length: {len(body)}\r\n\r\n".encode()
        )
        try:
            return routes.handle(Request(head, body, "127.0.0.1:1", lambda _rid: None)).status  # type: ignore[union-attr]
        except HttpError as e:
            return e.status

    assert code("Bearer s3cret") == 200
    assert code("bearer   s3cret ") == 200
    assert code("Bearer s3cret2") == 403 and code("Bearer s3cre") == 403 and code("Basic s3cret") == 403
    assert code(None) == 401 and code("") == 401


def _head(length: str, extra: str = "", name: str = "Content-Length") -> bytes:
    return (
        f"POST /v1/quorum HTTP/1.1\r\nHost: lh\r\n{name}: {length}\r\n{extra}Authorization: Bearer t\r\n\r\n"
    ).encode()


@pytest.mark.parametrize(
    ("raw", "reused"),
    [
        (_head("1234"), True),  # only the length's digits moved: the parse is reused
        (_head("7"), True),
        (_head("0012"), True),
        (_head("12", extra="X-A: 1\r\n"), False),  # another header too
        (_head("12 "), False),  # not bare digits
        (_head("-1"), False),
        (
            _head("12", extra="content-length: 99\r\n"),
            False,
        ),  # a second spelling: http.server reads the first
        (_head("12", name="content-length"), False),
        (_head("123").replace(b"POST", b"PUT "), False),
    ],
)
def test_a_head_that_differs_only_in_its_length_reuses_the_parse(raw: bytes, reused: bool) -> None:
    """`http.with_new_length` gives exactly what http.server's full parse gives, or nothing."""
    parser = HeadParser()
    last_raw = _head("99")
    last = parser.parse(last_raw)
    got = with_new_length(last_raw, last, raw)
    assert (got is not None) == reused
    if got is not None:
        assert got == parser.parse(raw)
        assert body_length(got, 1 << 20) == int(raw.split(b"Content-Length: ")[1].split(b"\r\n")[0])


def test_a_connection_reads_bodies_whose_length_moves() -> None:
    conn, handler, wire, loop = _connection()
    try:
        for body in (b"a" * 9, b"b" * 10, b"c" * 10, b"d" * 100, b"e" * 9):
            _send(conn, _req(body))
        assert [seen[2] for seen in handler.seen] == [b"a" * 9, b"b" * 10, b"c" * 10, b"d" * 100, b"e" * 9]
    finally:
        loop.close()


@pytest.mark.parametrize(
    "d",
    [
        {"replica_id": "a"},
        {"replica_id": "a", "step": 3, "data": {"ckpt": ["x"]}},
        {
            "replica_id": "a",
            "address": "h:1",
            "store_address": "h:2/p",
            "step": 1,
            "world_size": 4,
            "shrink_only": True,
            "commit_failures": 2,
            "data": {},
        },
        {"replica_id": "a", "step": True},
        {"replica_id": "a", "step": -1},
        {"replica_id": ""},
        {"replica_id": 5},
        {"replica_id": "a", "world_size": 0},
        {"replica_id": "a", "data": []},
        {"replica_id": "a", "shrink_only": 1},
    ],
)
def test_a_member_read_from_json_is_the_constructors(d: dict) -> None:
    """`QuorumMember.from_json` fills the fields without the frozen __init__: the same member, or the
    same refusal, as ``QuorumMember(**d)``; and its table of defaults is the dataclass's."""
    import dataclasses

    from ftlaunch.lighthouse.quorum import _MEMBER_DEFAULTS, QuorumMember

    fields = {f.name: f for f in dataclasses.fields(QuorumMember)}
    assert set(fields) == {*_MEMBER_DEFAULTS, "replica_id", "data"}
    assert all(
        fields[k].default == v and type(fields[k].default) is type(v) for k, v in _MEMBER_DEFAULTS.items()
    )
    try:
        expected = QuorumMember(**d)
    except ValueError as e:
        with pytest.raises(ValueError, match=re.escape(str(e))):
            QuorumMember.from_json(d)
        return
    got = QuorumMember.from_json(d)
    assert got == expected
    if "data" not in d:  # a fresh default each time, as the dataclass's default_factory
        assert got.data is not QuorumMember.from_json(d).data
