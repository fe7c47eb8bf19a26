"""A quorum request's body reads the same through msgspec's typed pass (``ftlaunch[fast]``) as the
general way (the pure-Python fallback), and every body the typed pass does not read exactly is left
to the general way, which names what is wrong."""

from __future__ import annotations

import json

import pytest

from ftlaunch.lighthouse import bodies, quorum_body
from ftlaunch.lighthouse.http import HeadParser, HttpError, Request
from ftlaunch.lighthouse.membership import Membership
from ftlaunch.lighthouse.protocol import MAX_JSON_DEPTH
from ftlaunch.lighthouse.quorum import QuorumOptions
from ftlaunch.lighthouse.routes import Routes

needs_msgspec = pytest.mark.skipif(
    quorum_body.msgspec is None, reason="msgspec is not installed (pip install ftlaunch[fast])"
)


def _request(body: bytes) -> Request:
    head = HeadParser().parse(
        f"POST /v1/quorum HTTP/1.1\r\nAuthorization: Bearer t\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    )
    return Request(head, body, "127.0.0.1:1", lambda _rid: None)


def _typed(value: object) -> object:
    """``value`` with the exact type of every part (60 and 60.0 compare equal; they must not pass)."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_typed(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return (type(value).__name__, _typed(dict(value.__dict__)))
    return (type(value).__name__, value)


USUAL = [
    {"member": {"replica_id": "g0", "step": 3}, "timeout": 60, "known": "ab12-7"},
    {"member": {"replica_id": "g0"}},
    {"member": {"replica_id": "g\u00e9-1", "step": 0, "world_size": 2}, "timeout": 0.5},
    {
        "member": {
            "replica_id": "rg1",
            "address": "http://h:1",
            "store_address": "h:2",
            "step": 123456789012345678901234567890,
            "world_size": 8,
            "shrink_only": True,
            "commit_failures": 2,
            "data": {"a": [1, 2.5, None, {"b": "c"}], "t": True},
        },
        "timeout": 1e3,
        "progress": {"session": "s", "commits": 4},
    },
    {"member": {"replica_id": "g", "step": 1, "step": 2}},  # noqa: F601 -- the last one counts, as in json
]


@needs_msgspec
@pytest.mark.parametrize("obj", USUAL)
def test_the_typed_pass_reads_what_the_general_way_reads(obj: dict) -> None:
    body = json.dumps(obj).encode()
    fast = quorum_body.read(body)
    assert fast is not None, "a usual body is read by the typed pass"
    general = Routes.quorum_body(_request(body))
    assert _typed(tuple(fast)) == _typed(tuple(general))


def test_a_duplicate_key_reads_as_json_reads_it() -> None:
    body = b'{"member": {"replica_id": "g", "step": 1, "step": 2}, "timeout": 5, "timeout": 7.5}'
    for read in (quorum_body.read(body), Routes.quorum_body(_request(body))):
        if read is not None:
            assert (read[0].step, read[1]) == (2, 7.5)


def _bad(depth: int = MAX_JSON_DEPTH) -> bytes:
    return b'{"member": {"replica_id": "g", "data": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}}"


UNUSUAL = [
    b'{"member": {"replica_id": "g", "step": true}}',
    b'{"member": {"replica_id": "g", "step": 1.0}}',
    b'{"member": {"replica_id": "g", "step": -1}}',
    b'{"member": {"replica_id": "g", "world_size": 0}}',
    b'{"member": {"replica_id": ""}}',
    b'{"member": {"replica_id": "g", "color": "red"}}',
    b'{"member": {"step": 1}}',
    b'{"member": {"replica_id": "g"}, "timeout": null}',
    b'{"member": {"replica_id": "g"}, "timeout": true}',
    b'{"member": {"replica_id": "g"}, "progress": null}',
    b'{"member": {"replica_id": "g"}, "known": 7}',
    b'{"member": {"replica_id": "g"}, "extra": 1}',
    b'{"member": []}',
    b'{"timeout": 1}',
    b"[1]",
    b'{"member": {"replica_id": "g", "data": {"x": NaN}}}',
    b'{"member": {"replica_id": "\\ud800"}}',
    b'{"member": {"replica_id": "g"}',
    b"",
    _bad(MAX_JSON_DEPTH - 1),  # brackets enough for the depth check to look: the general way's
    _bad(MAX_JSON_DEPTH + 1),
    json.dumps({"member": {"replica_id": "g"}}).encode("utf-16"),
]


@pytest.mark.parametrize("body", UNUSUAL)
def test_every_other_body_is_left_to_the_general_way(body: bytes) -> None:
    assert quorum_body.read(body) is None


def _outcome(routes: Routes, body: bytes) -> tuple:
    try:
        poll = routes.handle(_request(body))
    except HttpError as e:
        return ("error", e.status, e.message)
    ticket = poll._ticket  # type: ignore[union-attr]
    return ("parked", _typed(ticket.member), _typed(poll.timeout), _typed(poll._known))  # type: ignore[union-attr]


@pytest.mark.parametrize("body", [json.dumps(o).encode() for o in USUAL] + UNUSUAL)
def test_a_request_is_answered_alike_with_and_without_msgspec(
    body: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the route: the same member parked with the same timeout and revision, or the same
    400 with the same words, whichever codec reads the body."""

    def outcome() -> tuple:
        membership = Membership(QuorumOptions(min_replicas=2))
        try:
            return _outcome(Routes(membership, token="t", snapshot=lambda: None), body)  # type: ignore[arg-type,return-value]
        finally:
            membership.close()

    with_wheel = outcome()
    monkeypatch.setattr(quorum_body, "_decode", None)
    monkeypatch.setattr(bodies, "fast_decode", None)
    assert quorum_body.read(body) is None  # the pure-Python path alone
    assert outcome() == with_wheel
