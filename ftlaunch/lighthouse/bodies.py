"""A lighthouse request body, as the routes read it: JSON decoded, nesting bounded, fields checked.

Kept apart from `routes.py` (what each endpoint does) because every endpoint shares these checks,
and they are where a hostile body is turned away with a 400 naming what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ftlaunch.lighthouse.http import HttpError

try:  # optional (``pip install ftlaunch[fast]``): a compiled JSON decoder, ~3x json's on a body
    import msgspec
except ImportError:  # the standard library's path below reads the same bodies
    msgspec = None  # type: ignore[assignment, unused-ignore]

#: A body's fields: name -> the types its value may have.
Fields = dict[str, tuple[type, ...]]


def expect_fields(obj: dict[str, Any], required: Fields, optional: Fields) -> None:
    """`HttpError` 400 unless ``obj`` has every ``required`` field and no field outside
    ``required``/``optional``, each of one of its types (a bool is no int here)."""
    # The usual body passes this one look at each field (json.loads makes exact types); any doubt
    # goes the long way below, which names what is wrong.
    if required.keys() <= obj.keys():
        for name, value in obj.items():
            types = required.get(name) or optional.get(name)
            if types is None or type(value) not in types:
                break
        else:
            return
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        raise HttpError(400, f"unknown field(s): {', '.join(map(repr, unknown))}")
    for name, types in (*required.items(), *optional.items()):
        if name not in obj:
            if name in required:
                raise HttpError(400, f"missing field {name!r}")
            continue
        value = obj[name]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise HttpError(400, f"field {name!r} must be {types[0].__name__}, got {type(value).__name__}")


#: The standard library's JSON scanner (its C one where built), as `json.loads` uses it.
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


#: msgspec's JSON decoder where the wheel is installed, else None (then `loads` is json's alone).
fast_decode: Callable[[bytes], Any] | None = msgspec.json.Decoder().decode if msgspec is not None else None


def loads(body: bytes) -> Any:
    """``json.loads(body)``: with msgspec installed, its decoder reads the body first (the request
    path's largest single cost at 1,024 groups); any body it turns away (NaN, a lone surrogate,
    another encoding, not JSON) is read by json's path below, so a body reads the same, or fails
    the same, with and without the wheel.

    json's path decodes UTF-8 first (what clients send; json.loads of bytes first
    guesses among UTF-8/16/32, a fifth of a small body's parse). A body that is one JSON value
    with nothing around it (every client's) is read by json's scanner directly: json.loads adds
    two regular-expression searches for surrounding whitespace and two Python calls, half the
    time of a quorum request's parse. Anything else -- whitespace around the value, another
    encoding, a body that is not JSON -- goes through json.loads as it always did (its errors)."""
    if fast_decode is not None:
        try:
            return fast_decode(body)
        except (ValueError, msgspec.DecodeError):
            pass
    try:
        text = body.decode()
        value, end = _scan(text, 0)
        if end == len(text):
            return value
    except (ValueError, StopIteration):  # UnicodeDecodeError and JSONDecodeError included
        pass
    try:
        return json.loads(body.decode())
    except ValueError:  # UnicodeDecodeError included
        return json.loads(body)


def too_deep(obj: object, limit: int) -> bool:
    """Whether ``obj`` nests arrays/objects more than ``limit`` levels (iterative: no recursion).

    Why: a body nested ~1000 deep parses, but the quorum holding it cannot be encoded again, which
    would leave the request unanswered and ``/status`` failing until the next quorum.
    """
    stack: list[tuple[object, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, (dict, list)))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, (dict, list)))
    return False


def printable(text: str, limit: int = 200) -> str:
    """A client-chosen string as it may appear in the log: one line, bounded."""
    text = text if text.isprintable() else text.encode("unicode_escape", "replace").decode("ascii", "replace")
    return text if len(text) <= limit else text[:limit] + "..."
