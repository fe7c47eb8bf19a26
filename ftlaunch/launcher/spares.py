"""What the launcher needs to know about hot spares (``ftlaunch --spares K``).

With spares, the supervisor's groups are *agents* 0..N+K-1 and the lighthouse decides which of them
holds which replica-group slot (``lighthouse/spares.py``): after a promotion, agent 2's workers may
train as ``rg1.1`` while agent 1's restarted workers wait as a spare. The lighthouse names each
holder by its claim (``g<agent>.<restart>``, see `ftlaunch.worker.spare.claimant_name`), so the
agent's current lighthouse name is read back from the status here.
"""

from __future__ import annotations

from ftlaunch.launcher.lighthouse_host import JobLighthouse
from ftlaunch.lighthouse.status import SparesStatus


def holder_name(lighthouse: JobLighthouse, gid: int) -> str | None:
    """The lighthouse name agent ``gid``'s workers train under now; None while they wait as a
    spare (or when the status cannot be read: the lighthouse notices a death on its own anyway)."""
    try:
        spares = lighthouse.snapshot().spares
    except Exception:  # noqa: BLE001 - informational: the closed connection tells the lighthouse too
        return None
    if spares is None:
        return None
    prefix = f"g{gid}."
    held = [s for s in spares.slots if s.holder is not None and s.holder.startswith(prefix) and s.replica_id]
    if not held:
        return None
    return min(held, key=lambda s: s.held_for if s.held_for is not None else 0.0).replica_id  # the newest


class Takeovers:
    """Which launcher group trains in which slot, read from the lighthouse's slot table: progress
    reported under a slot's lighthouse name (``rg1.1``) belongs to the group holding it now, and the
    failure of a group counts as recovered when the spare that took its slot commits a step."""

    def __init__(self, replicas: int) -> None:
        self.holder = {slot: slot for slot in range(replicas)}
        self._replaced: dict[int, int] = {}  # new holder -> the group it replaced, until it commits

    def names(self, spares: SparesStatus | None) -> dict[str, int]:
        """Lighthouse name -> launcher group of every slot's current holder (and note takeovers)."""
        out: dict[str, int] = {}
        for s in spares.slots if spares is not None else ():
            gid = _group_of(s.holder)
            if gid is None or s.replica_id is None:
                continue
            out[s.replica_id] = gid
            previous = self.holder.get(s.slot)
            if previous != gid:
                self.holder[s.slot] = gid
                if previous is not None:
                    self._replaced[gid] = previous
        return out

    def committed(self, gid: int) -> int | None:
        """Group ``gid`` committed a step: the group whose slot it took, the first time."""
        return self._replaced.pop(gid, None)


def _group_of(claimant: str | None) -> int | None:
    """``g2.0`` -> 2 (`ftlaunch.worker.spare.claimant_name`)."""
    if not claimant or not claimant.startswith("g"):
        return None
    head = claimant[1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None
