"""A quorum told as the difference from one the member already holds (pure, both ends use it).

Why: every member needs the whole quorum (its step plan reads every member's step, the sources'
data and store addresses), and with N groups that is N answers of O(N) bytes per round: ~130 MB of
JSON with 1024 groups, most of a round's time spent writing and reading it. From one round to the
next, though, a steady job's quorum differs only in the members' steps. So a member that says which
quorum answer it holds (its *revision*, docs/lighthouse.md) gets a delta: the new id and time, the
steps run-length encoded, and for the few members whose other fields changed only those fields --
a few hundred bytes however many groups there are. The client rebuilds the full `Quorum` from it,
so everyone above the client sees what it saw before.

A delta exists only between quorums with the same members in the same order; a membership change
is sent in full.

Format (``"delta"`` of a quorum answer)::

    {"base": "<revision the member holds>", "quorum_id": int, "created": float,
     "steps": [[step, count], ...],                      # every member's step, in order, run-length
     "changed": [[index, {field: value, ..., "data": {key: value}, "data_drop": [key]}], ...]}

``changed`` patches a member's fields other than ``replica_id`` and ``step``; its ``data`` is
merged key by key into the held member's data, and ``data_drop`` names the keys removed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ftlaunch.lighthouse.quorum import Quorum, QuorumMember

#: Member fields a patch may set (``data`` is merged, see the module docstring).
_PATCHABLE = ("address", "store_address", "world_size", "shrink_only", "commit_failures")
_DELTA_KEYS = frozenset({"base", "quorum_id", "created", "steps", "changed"})


def encode_delta(base: Quorum, new: Quorum, base_revision: str) -> dict[str, Any] | None:
    """``new`` as a delta from ``base`` (held by the member as ``base_revision``), or None when the
    members differ (then the whole quorum is sent)."""
    if len(base.participants) != len(new.participants):
        return None
    changed: list[list[Any]] = []
    for index, (held, now) in enumerate(zip(base.participants, new.participants, strict=True)):
        if held.replica_id != now.replica_id:
            return None
        if now is held:
            continue
        patch = _patch(held, now)
        if patch:
            changed.append([index, patch])
    return {
        "base": base_revision,
        "quorum_id": new.quorum_id,
        "created": new.created,
        "steps": _runs([m.step for m in new.participants]),
        "changed": changed,
    }


def apply_delta(base: Quorum, delta: Any) -> Quorum:
    """The quorum ``delta`` describes, rebuilt on ``base``; ValueError if it is malformed or does
    not fit ``base`` (a member the same as in ``base`` is the same object)."""
    if not isinstance(delta, dict) or set(delta) != _DELTA_KEYS:
        raise ValueError(f"a quorum delta has exactly the fields {sorted(_DELTA_KEYS)}")
    steps = _expand(delta["steps"], len(base.participants))
    patches: dict[int, dict[str, Any]] = {}
    changed = delta["changed"]
    if not isinstance(changed, list):
        raise ValueError("field 'changed' must be a list")
    for entry in changed:
        if not (
            isinstance(entry, list) and len(entry) == 2 and _is_int(entry[0]) and isinstance(entry[1], dict)
        ):
            raise ValueError("each 'changed' entry must be [index, {fields}]")
        index, patch = entry
        if not 0 <= index < len(base.participants):
            raise ValueError(f"'changed' index {index} outside the quorum's {len(base.participants)} members")
        patches[index] = patch
    members = []
    for index, (held, step) in enumerate(zip(base.participants, steps, strict=True)):
        patch = patches.get(index)
        if patch is not None:
            members.append(_apply_patch(held, step, patch))
        elif step != held.step:
            members.append(dataclasses.replace(held, step=step))
        else:
            members.append(held)
    return Quorum(quorum_id=delta["quorum_id"], participants=tuple(members), created=delta["created"])


def _patch(held: QuorumMember, now: QuorumMember) -> dict[str, Any]:
    if (  # the usual member: only its step moved (one comparison each, no dict built)
        now.address == held.address
        and now.store_address == held.store_address
        and now.world_size == held.world_size
        and now.shrink_only == held.shrink_only
        and now.commit_failures == held.commit_failures
        and now.data == held.data
    ):
        return {}
    patch: dict[str, Any] = {
        name: getattr(now, name) for name in _PATCHABLE if getattr(now, name) != getattr(held, name)
    }
    if now.data != held.data:
        put = {k: v for k, v in now.data.items() if k not in held.data or held.data[k] != v}
        if put:
            patch["data"] = put
        drop = [k for k in held.data if k not in now.data]
        if drop:
            patch["data_drop"] = drop
    return patch


def _apply_patch(held: QuorumMember, step: int, patch: dict[str, Any]) -> QuorumMember:
    unknown = set(patch) - {*_PATCHABLE, "data", "data_drop"}
    if unknown:
        raise ValueError(f"unknown member patch field(s): {', '.join(map(repr, sorted(unknown)))}")
    fields = {name: patch[name] for name in _PATCHABLE if name in patch}
    put, drop = patch.get("data", {}), patch.get("data_drop", [])
    if not isinstance(put, dict) or not isinstance(drop, list):
        raise ValueError("a member patch's 'data' must be an object and 'data_drop' a list")
    if put or drop:
        data = {k: v for k, v in held.data.items() if k not in drop}
        data.update(put)
        fields["data"] = data
    # QuorumMember checks every field's type, so a patch cannot smuggle in a bad value.
    return dataclasses.replace(held, step=step, **fields)


def _runs(values: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


def _expand(runs: Any, n: int) -> list[int]:
    if not isinstance(runs, list):
        raise ValueError("field 'steps' must be a list of [step, count]")
    out: list[int] = []
    for run in runs:
        if not (
            isinstance(run, list) and len(run) == 2 and _is_int(run[0]) and _is_int(run[1]) and run[1] > 0
        ):
            raise ValueError("field 'steps' must be a list of [step, count] with count > 0")
        if run[1] > n - len(out):
            raise ValueError(f"'steps' covers more than the held quorum's {n} members")
        out.extend([run[0]] * run[1])
    if len(out) != n:
        raise ValueError(f"'steps' covers {len(out)} members, the held quorum has {n}")
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
