"""Quorum answers, encoded once per quorum and per revision the members hold (event-loop thread).

Every quorum answer carries a *revision*: a name for that answer, unique across lighthouse
restarts (a random prefix per lighthouse, then a counter). A member that sends the revision it
holds (``"known"`` in its quorum request) gets the new quorum as a delta from it
(`quorum_delta`), when this lighthouse still remembers that revision and the members are the same;
otherwise, and for a member that names none (an older client, curl), the whole quorum as before.

Why here and not in the membership: which bytes go to whom is a matter of the wire, and the
answers are built on the event loop, where they are written. In a steady job every member holds
the previous round's revision, so a round costs one delta encoding, whatever the number of groups,
and every member gets the same bytes.
"""

from __future__ import annotations

import json
import secrets
from collections import deque
from dataclasses import dataclass, field

from ftlaunch.lighthouse.http import Response
from ftlaunch.lighthouse.protocol import API_VERSION
from ftlaunch.lighthouse.quorum import Quorum
from ftlaunch.lighthouse.quorum_delta import encode_delta

#: Quorums (with their encodings) remembered: a member a few rounds behind still gets a delta.
REMEMBERED_QUORUMS = 8
#: Different held revisions one quorum's deltas are cached for (the others are encoded each time).
CACHED_DELTAS = 16


@dataclass
class _Entry:
    quorum: Quorum
    revision: str
    #: The whole quorum's answer, encoded when a member first needs it (in a steady job none does).
    _full: Response | None = None
    deltas: dict[str, Response] = field(default_factory=dict)

    @property
    def full(self) -> Response:
        if self._full is None:
            self._full = _encode(
                {"quorum": self.quorum.to_json(), "revision": self.revision, "version": API_VERSION}
            )
        return self._full


def _encode(payload: dict) -> Response:
    # Compact separators: with N groups a full answer is O(N) bytes; the spaces alone were ~10% of them.
    return Response(200, json.dumps(payload, separators=(",", ":")).encode())


class QuorumAnswers:
    """The 200 answers to quorum requests (see the module docstring). Not thread-safe: the
    transport builds every answer on its event-loop thread."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(6)
        self._count = 0
        self._entries: deque[_Entry] = deque(maxlen=REMEMBERED_QUORUMS)
        self._last: tuple[Quorum, str | None, Response] | None = None  # the answer given last

    def response(self, quorum: Quorum, known: str | None = None) -> Response:
        """The answer for ``quorum`` to a member holding revision ``known`` (None: it holds none)."""
        last = self._last
        if last is not None and last[0] is quorum and last[1] == known:  # the rest of a round's members
            return last[2]
        response = self._response(quorum, known)
        self._last = (quorum, known, response)
        return response

    def _response(self, quorum: Quorum, known: str | None) -> Response:
        entry = self._entry(quorum)
        if known is None or known == entry.revision:
            return entry.full
        cached = entry.deltas.get(known)
        if cached is not None:
            return cached
        base = next((e for e in self._entries if e.revision == known), None)
        delta = encode_delta(base.quorum, quorum, known) if base is not None else None
        if delta is None:
            response = entry.full
        else:
            response = _encode({"delta": delta, "revision": entry.revision, "version": API_VERSION})
        if len(entry.deltas) < CACHED_DELTAS:
            entry.deltas[known] = response
        return response

    def _entry(self, quorum: Quorum) -> _Entry:
        for entry in reversed(self._entries):  # the newest is the usual one
            if entry.quorum is quorum:
                return entry
        self._count += 1
        revision = f"{self._prefix}-{self._count}"
        entry = _Entry(quorum, revision)
        self._entries.append(entry)
        return entry
