"""How a restarted lighthouse learns the job back (`membership.Membership` mixes it in): the groups'
resume reports (docs/lighthouse.md, *When the lighthouse dies*), on quorum requests
(`_take_resume_report`) and on heartbeats (`Membership.heartbeat`).

Why apart: it runs only until a restarted lighthouse forms its first quorum, and the rules of a
running job read without it. The report's format is parsed beside the protocol
(`protocol.parse_resume_report`). Runs under the membership's lock like the rest of it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ftlaunch.lighthouse.membership_status import ADOPTED, GroupInfo
from ftlaunch.lighthouse.protocol import RESUME_KEY, parse_resume_report
from ftlaunch.lighthouse.quorum import Connection, GroupState, Quorum, QuorumIdAllocator, QuorumMember

log = logging.getLogger("ftlaunch.lighthouse.membership")


class ResumeMixin:
    """`Membership`'s adoption of resume reports; the attributes and helpers below are the membership's."""

    _wall: Callable[[], float]
    _ids: QuorumIdAllocator
    _groups: dict[str, GroupState]
    _info: dict[str, GroupInfo]
    _quorum: Quorum | None
    _adopted: Quorum | None
    _prev_missing: set[str] | None
    _prev_ids: frozenset[str]
    _prev_broken: bool

    if TYPE_CHECKING:

        def _record(self, event: str, replica_id: str | None, detail: str = "") -> None: ...

    def _take_resume_report(self, member: QuorumMember, now: float) -> QuorumMember:
        """Strip ``member``'s resume report (protocol.RESUME_KEY) and, while this lighthouse has formed
        no quorum yet, adopt the newest one as the previous quorum (see `adopt_resume_report`)."""
        if RESUME_KEY not in member.data:
            return member
        report = member.data[RESUME_KEY]
        member = dataclasses.replace(member, data={k: v for k, v in member.data.items() if k != RESUME_KEY})
        if self._quorum is None:
            self.adopt_resume_report(member.replica_id, report, now)
        return member

    def _stepped_through_outage(self, member: QuorumMember) -> bool:
        """Whether ``member`` may be past the highest step of this lighthouse's quorums because its
        group stepped on through an outage (worker/outage.py): it reports (`RESUME_KEY`) the current
        quorum as its last one and is a participant of it. Such steps committed only with every
        participant of that quorum taking part, so they are the job's steps, not one group's claim
        (this lighthouse stayed up, but its groups could not reach it)."""
        quorum = self._quorum
        if quorum is None or RESUME_KEY not in member.data:
            return False
        parsed = parse_resume_report(member.data[RESUME_KEY])
        return (
            parsed is not None and parsed[0] == quorum.quorum_id and member.replica_id in quorum.replica_ids
        )

    def adopt_resume_report(self, reporter: str, report: object, now: float) -> bool:
        """A lighthouse that restarted knows nothing of the job; its groups do. Adopt the newest
        reported quorum (``{"quorum_id": int, "members": [str]}``) as the previous quorum: the next
        quorum forms at once when all its members asked (the fast path), always under a new id above
        the reported one, and the members not heard of yet count as live for ``heartbeat_timeout``
        from now, so the quorum waits for them that long instead of forming from whoever came back
        first. Call under the lock. Returns whether the report was adopted."""
        parsed = parse_resume_report(report)
        if parsed is None:
            log.warning("lighthouse: ignoring a malformed resume report from %s", reporter)
            return False
        quorum_id, members = parsed
        if self._adopted is not None and quorum_id <= self._adopted.quorum_id:
            return False
        self._adopted = Quorum(quorum_id, tuple(QuorumMember(rid) for rid in members), created=self._wall())
        self._prev_missing = None
        # Its members are the previous quorum's until this lighthouse forms one: a member that goes
        # down is then told to its peers (`lost_in_quorum`), which may step on it through the outage.
        self._prev_ids, self._prev_broken = frozenset(members), True
        self._ids.ensure_above(quorum_id)
        for rid in members:
            if rid not in self._groups:
                self._groups[rid] = GroupState(rid, now, Connection.CONNECTED)
                self._info[rid] = GroupInfo(
                    first_seen=self._wall(),
                    reason=f"expected: member of quorum {quorum_id}",
                    incarnation=ADOPTED,
                )
        detail = f"adopted quorum {quorum_id} of {len(members)} group(s) from a previous lighthouse"
        self._record("resumed", reporter, detail)
        log.info("lighthouse: %s reported by %s", detail, reporter)
        return True
