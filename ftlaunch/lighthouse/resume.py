"""How a restarted lighthouse learns the job back from the groups' resume reports (docs/lighthouse.md,
*When the lighthouse dies*), as pure rules; the membership applies them under its lock.

A lighthouse that restarted knows nothing of the job; its groups do. A group that found the
lighthouse unreachable sends, on its quorum requests (`protocol.RESUME_KEY` in the member's data)
and heartbeats, a resume report: the id and members of its last quorum. Until the restarted
lighthouse forms a quorum of its own, the newest reported quorum is adopted (`adoption`) as the
previous quorum: the next one forms at once when all its members asked (the fast path), always
under a new id above the reported one, and the members not heard of yet stand in as live for a
heartbeat timeout, so the quorum waits for them that long instead of forming from whoever came
back first. The report is stripped from the member (`take_resume_report`), never echoed in a
quorum. A lighthouse that stayed up while its groups could not reach it lets a participant of its
current quorum claim the steps it took meanwhile (`stepped_through_outage`).

The report's format is parsed beside the protocol (`protocol.parse_resume_report`).
"""

from __future__ import annotations

import dataclasses

from ftlaunch.lighthouse.protocol import RESUME_KEY, parse_resume_report
from ftlaunch.lighthouse.quorum import Quorum, QuorumMember


def take_resume_report(member: QuorumMember) -> tuple[QuorumMember, object]:
    """``member`` without its resume report, and the report (None: it carried none)."""
    if RESUME_KEY not in member.data:
        return member, None
    report = member.data[RESUME_KEY]
    return dataclasses.replace(member, data={k: v for k, v in member.data.items() if k != RESUME_KEY}), report


def adoption(report: object, adopted: Quorum | None, created: float) -> Quorum | None:
    """The quorum to adopt from ``report`` (``{"quorum_id": int, "members": [str]}``) while this
    lighthouse formed none: the reported one, when it is newer than the one ``adopted`` already;
    else None. Raises ValueError when the report is malformed."""
    parsed = parse_resume_report(report)
    if parsed is None:
        raise ValueError("malformed resume report")
    quorum_id, members = parsed
    if adopted is not None and quorum_id <= adopted.quorum_id:
        return None
    return Quorum(quorum_id, tuple(QuorumMember(rid) for rid in members), created=created)


def stepped_through_outage(member: QuorumMember, current: Quorum | None) -> bool:
    """Whether ``member`` may be past the highest step of this lighthouse's quorums because its group
    stepped on through an outage (worker/outage.py): it reports (`RESUME_KEY`) the ``current``
    quorum as its last one and is a participant of it. Such steps committed only with every
    participant of that quorum taking part, so they are the job's steps, not one group's claim
    (this lighthouse stayed up, but its groups could not reach it)."""
    if current is None or RESUME_KEY not in member.data:
        return False
    parsed = parse_resume_report(member.data[RESUME_KEY])
    return parsed is not None and parsed[0] == current.quorum_id and member.replica_id in current.replica_ids
