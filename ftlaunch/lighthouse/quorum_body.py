"""A ``POST /quorum`` body read in one typed pass, where the msgspec wheel is installed.

Why: a quorum request is the lighthouse's most frequent request (one per group per step), and its
body has one usual shape. msgspec decodes that shape straight into typed fields -- JSON, the
field names, their exact types (no bool for an int, no float for an int, no null) -- in one call
in C, which the general path does in three Python steps (`bodies.loads`, `bodies.expect_fields`,
`quorum.QuorumMember.from_json`).

It is only a shortcut: `read` returns None for any body it does not read exactly as the general
path would (msgspec missing, a field unknown, missing or of another type, a value the member
refuses, nesting that needs the depth check), and the route then reads the body the general way,
which accepts the same bodies and names what is wrong in the others. So a body reads the same,
or fails the same, with and without the wheel (tests/unit/test_quorum_body.py).
"""

from __future__ import annotations

from typing import Any

from ftlaunch.lighthouse.protocol import MAX_JSON_DEPTH
from ftlaunch.lighthouse.quorum import _MEMBER_DEFAULTS, _MEMBER_FIELDS, QuorumMember

try:  # optional (``pip install ftlaunch[fast]``)
    import msgspec
except ImportError:  # the general path reads every body
    msgspec = None  # type: ignore[assignment]


#: What a quorum request says, as the route uses it: the member; the timeout in seconds as sent (int
#: or float); the ``progress`` object, not yet parsed; the answer revision the member holds (``known``)
#: -- each of the last three None when not given. A plain tuple: a NamedTuple's constructor is a
#: Python call, a tenth of this read.
QuorumBody = tuple[QuorumMember, float | None, dict[str, Any] | None, str | None]


def _decoder() -> Any:
    """msgspec's decoder of the usual body, or None without the wheel."""
    if msgspec is None:
        return None
    unset = msgspec.UNSET
    # The member's fields, types and defaults are QuorumMember's own (one type each).
    member = msgspec.defstruct(
        "QuorumMemberBody",
        [
            (name, types[0], _MEMBER_DEFAULTS[name] if name in _MEMBER_DEFAULTS else {})
            if name != "replica_id"
            else (name, types[0])
            for name, types in _MEMBER_FIELDS.items()
        ],
        forbid_unknown_fields=True,
    )
    body = msgspec.defstruct(
        "QuorumRequestBody",
        [
            ("member", member),
            ("timeout", int | float | msgspec.UnsetType, unset),
            ("progress", dict | msgspec.UnsetType, unset),
            ("known", str | msgspec.UnsetType, unset),
        ],
        forbid_unknown_fields=True,
    )
    return msgspec.json.Decoder(body).decode


_decode = _decoder()
_NAMES = tuple(_MEMBER_FIELDS)


def read(body: bytes) -> QuorumBody | None:
    """``body`` read by msgspec's typed decoder, or None where the general path must read it."""
    if _decode is None or body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH:
        return None  # nesting that may be too deep is checked on the general path
    try:
        obj = _decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError):  # type: ignore[union-attr]
        return None
    m = obj.member
    member = QuorumMember.__new__(QuorumMember)  # as QuorumMember.from_json builds one
    member.__dict__.update(zip(_NAMES, msgspec.structs.astuple(m), strict=True))  # type: ignore[union-attr]
    try:
        member.__post_init__()
    except ValueError:  # a value the member refuses (an empty id, a negative step): named there
        return None
    unset = msgspec.UNSET  # type: ignore[union-attr]
    timeout, progress, known = obj.timeout, obj.progress, obj.known
    return (
        member,
        None if timeout is unset else timeout,
        None if progress is unset else progress,
        None if known is unset else known,
    )
