"""The lighthouse's own Python work per fast-quorum round, without sockets (companion of
``scripts/bench_lighthouse.py``).

Why: on a shared 2-core host the socket benchmark's round trip moves 2x with the load, and its
"server CPU" mixes the lighthouse's Python with the kernel's work for ~2,000 sends and receives.
This drives the real request path -- `connection.Connection` (head reuse, body framing), the
routes (token check, JSON, field checks), the membership (bookkeeping, the decision) and the
answers (deltas, the fan-out) -- in one process, with the transports replaced by objects that
only count the bytes written. What it measures is exactly what a faster request path can cut;
what it leaves out (the system calls, asyncio's selector and transport steps) is what the
socket benchmark's do-nothing server (``bench_lighthouse.py --floor``) measures.

Each round: every group sends its quorum request (the same head as last round, the step moved,
``known`` = the revision it holds, as LighthouseClient does), the last one completes the quorum and
every group gets its answer; then ``--beats`` of the groups send a heartbeat (the benchmark's
1024 groups beat at the advised 1.1 s pace, ~5 % of them per 50 ms round). Prints the CPU time
per round, per request and per heartbeat (``time.process_time``: the lighthouse's thread only
runs here), the median round of the best of ``--repeat`` runs.

    python scripts/bench_lighthouse_path.py [--groups 1024] [--rounds 100] [--beats 0.05] [--token T]
        [--whole] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from typing import Any

from ftlaunch.lighthouse.connection import Connection
from ftlaunch.lighthouse.membership import Membership
from ftlaunch.lighthouse.protocol import MAX_BODY_BYTES
from ftlaunch.lighthouse.quorum import QuorumOptions
from ftlaunch.lighthouse.routes import Routes
from ftlaunch.lighthouse.server import collect_less
from ftlaunch.lighthouse.transport import HttpServer


class _Transport(asyncio.Transport):
    """A connection's transport that keeps the last answer written (nothing goes anywhere)."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self._peer = ("127.0.0.1", port)
        self.last = b""
        self.writes = 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._peer if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.last = bytes(data)
        self.writes += 1

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


def _post(path: str, obj: dict, token: str | None, replica: str | None = None) -> bytes:
    body = json.dumps(obj).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: lh\r\nContent-Type: application/json\r\nContent-Length: "
        f"{len(body)}\r\n"
    )
    if token:
        head += f"Authorization: Bearer {token}\r\n"
    if replica:
        head += f"X-Ftlaunch-Replica: {replica}\r\n"
    return head.encode() + b"\r\n" + body


def _feed(conn: Connection, data: bytes) -> None:
    buf = conn.get_buffer(len(data))
    buf[: len(data)] = data
    conn.buffer_updated(len(data))


def run(groups: int, rounds: int, beats: float, token: str | None, whole: bool) -> dict[str, float]:
    loop = asyncio.new_event_loop()
    membership = Membership(
        QuorumOptions(min_replicas=1, join_timeout=30, heartbeat_timeout=10, expected_replicas=groups)
    )
    routes = Routes(membership, token=token, snapshot=lambda: None)  # type: ignore[arg-type,return-value]
    server = HttpServer(
        _unused_socket(), routes, idle_timeout=120.0, read_timeout=10.0, max_body=MAX_BODY_BYTES
    )
    server.loop = loop
    server._loop_ident = threading.get_ident()
    rids = [f"g{i:04d}" for i in range(groups)]
    qconns, hconns, qtrans = [], [], []
    for i, _ in enumerate(rids):
        for conns in (qconns, hconns):
            t = _Transport(10000 + 2 * i + len(conns) % 2)
            c = Connection(server, loop)
            c.connection_made(t)
            conns.append(c)
            if conns is qconns:
                qtrans.append(t)
    beat_reqs = [_post("/v1/heartbeat", {"replica_id": rid}, token, replica=rid) for rid in rids]
    for c, req in zip(hconns, beat_reqs, strict=True):
        _feed(c, req)
    known: str | None = None
    per_beat = max(0, round(beats * groups))
    next_beat = 0
    quorum_cpu: list[float] = []
    beat_cpu: list[float] = []
    for step in range(rounds + 5):
        reqs = []
        for rid in rids:
            ask: dict[str, Any] = {"member": {"replica_id": rid, "step": step}, "timeout": 60}
            if known is not None and not whole:
                ask["known"] = known
            reqs.append(_post("/v1/quorum", ask, token))
        t0 = time.process_time()
        for c, req in zip(qconns, reqs, strict=True):
            _feed(c, req)
        t1 = time.process_time()
        for _ in range(per_beat):
            _feed(hconns[next_beat], beat_reqs[next_beat])
            next_beat = (next_beat + 1) % groups
        t2 = time.process_time()
        loop.call_soon(loop.stop)
        loop.run_forever()  # the handles the round left (flushes already done)
        answer = qtrans[0].last
        if not answer.startswith(b"HTTP/1.1 200") or any(t.last != answer for t in qtrans):
            raise SystemExit(f"round {step}: not every group got the same 200 answer: {answer[:200]!r}")
        known = json.loads(answer.split(b"\r\n\r\n", 1)[1])["revision"]
        if step >= 5:  # warm-up rounds left out
            quorum_cpu.append(t1 - t0)
            beat_cpu.append(t2 - t1)
    loop.close()
    # Medians: on a shared host a round now and then takes twice as long (another process ran).
    quorum, beat = statistics.median(quorum_cpu), statistics.median(beat_cpu)
    return {
        "round_ms": (quorum + beat) * 1e3,
        "quorum_round_ms": quorum * 1e3,
        "per_request_us": quorum / groups * 1e6,
        "per_beat_us": beat / max(1, per_beat) * 1e6,
        "min_round_ms": min(q + b for q, b in zip(quorum_cpu, beat_cpu, strict=True)) * 1e3,
    }


def _unused_socket():  # HttpServer wants its listening socket; nothing listens here
    import socket

    return socket.socket()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--beats", type=float, default=0.05, help="fraction of the groups that beat per round")
    p.add_argument("--token", default="bench-token", help="job token every request carries ('' for none)")
    p.add_argument(
        "--whole", action="store_true", help="no 'known' revision: every answer is the whole quorum"
    )
    p.add_argument("--repeat", type=int, default=3, help="runs; the best is printed")
    p.add_argument("--profile", help="write a cProfile of one run to this file")
    args = p.parse_args()
    token = args.token or None
    collect_less()  # as ftlaunch-lighthouse runs: the collector tuned for a lighthouse process
    if args.profile:
        import cProfile

        cProfile.runctx(
            "run(args.groups, args.rounds, args.beats, token, args.whole)", globals(), locals(), args.profile
        )
    best = min(
        (run(args.groups, args.rounds, args.beats, token, args.whole) for _ in range(args.repeat)),
        key=lambda r: r["round_ms"],
    )
    print(
        f"{args.groups} groups, {'whole' if args.whole else 'deltas'}, token {'yes' if token else 'no'}: "
        f"{best['round_ms']:.2f} ms CPU a round ({best['quorum_round_ms']:.2f} ms for the quorum "
        "requests and "
        f"answers: {best['per_request_us']:.1f} us a request; heartbeats {best['per_beat_us']:.1f} us each; "
        f"fastest round {best['min_round_ms']:.2f} ms), best of {args.repeat}"
    )


if __name__ == "__main__":
    main()
