"""Lighthouse benchmark: fast-quorum round trip (2 real client processes; 64 and 1024 simulated
groups) and heartbeat throughput, printed beside the targets and torchft's baseline.

The lighthouse runs as its own process (``python -m ftlaunch.lighthouse``), as in a real job, with
the settings ``ftlaunch --replicas N`` gives it (``--min-replicas 1 --expected-replicas N``).
Every group keeps a heartbeat thread running (100 ms, the Manager's default, or the slower pace a
lighthouse tracking more than ~100 groups advises in its heartbeat answers, which LighthouseClient
and the simulated groups follow: ~1.1 s with 1024 groups) while it asks for quorums, so the server
sees realistic background traffic.

Round trip of one round = from the moment the LAST group sends its quorum request until EVERY
group holds the quorum (time.perf_counter is CLOCK_MONOTONIC, comparable across processes on
Linux). That is the latency the lighthouse adds to a training step once all groups are ready.
"last caller" is the same group's own send -> receive time.

The 64 groups run as lightweight raw-socket clients (see `_sim_worker`) in 8 processes on the same
host as the lighthouse (so on a 2-core machine the round trip includes the clients' own CPU), once
all asking at the same instant ("burst": the server must parse all 64 requests before it can
answer) and once with the requests spread over 20 ms, as when groups finish their steps at slightly
different times. Like http.client, each simulated group sends the same request line and headers
every round, which lets the server reuse its parse of them (see transport.py); the "burst, heads
vary" row adds a header that changes every round, so every request is parsed in full (the worst
case, as for a client that sends a fresh header each time). The 1024-group rows and the small-job
rows (4 groups) are bursts, once with answers as deltas (as LighthouseClient gets them) and once
"whole" (every group gets the whole quorum, as an older client does): before and after, in one run.

"server CPU" is the CPU time (user + system) the lighthouse process spent per round, heartbeats
included: on a shared host it moves much less with the load than the round trip does. "clients
CPU" is what the simulated groups' processes spent per round: on a 2-core host the round trip is
about (server CPU + clients CPU) / 2. ``--floor`` runs the large deltas row twice more: against a
server that does nothing (`bench_lighthouse_sim.serve_floor`: the harness's own floor, "FLOOR"), and
against the lighthouse's own transport under a handler that does nothing
(`bench_lighthouse_sim.serve_transport_floor`, "TRANSPORT": what the lighthouse would cost if its
routes, membership and answers were free), in the same run. ``--clients lean`` uses leaner
simulated groups (`bench_lighthouse_sim.lean_worker`: the same requests and connections, less
client CPU); the default keeps the groups earlier figures were
measured with. Every request carries the job token (ftlaunch always makes one) and the process's
incarnation, as LighthouseClient sends them.

``--compare`` runs only the side-by-side rows, at 4, 64 and 1024 groups (``--sizes``), one
after another so the host's load weighs on them alike: the lighthouse (lean groups, delta answers),
the harness's floor, and torchft's own lighthouse (its Rust gRPC server, asked by its
``LighthouseClient.quorum``, one client and one thread per group: what a torchft replica's manager
calls), measured the same way: from the last request of a round until every group holds its answer.
torchft's rows need ``pip install --no-deps torchft-nightly`` (the wheel alone; its package's
``__init__`` is not needed); without it a line says they are skipped.

    python scripts/bench_lighthouse.py [--rounds 500] [--rounds64 200] [--spread64 20] [--rounds1024 30]
        [--groups-large 1024] [--small 4] [--scale-only] [--client64] [--answers both|deltas|whole]
        [--clients sim|lean|both] [--floor] [--token T] [--compare [--repeat K]]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import resource
import secrets
import statistics
import subprocess
import sys
import threading
import time

import bench_lighthouse_sim as sim  # scripts/: the floor server and the lean simulated groups

TARGET_MS = {2: 1.0, 64: 5.0, 1024: 20.0}
TORCHFT = {2: "~2 ms"}
#: Every group's own heartbeat interval (the Manager's default); a large job's lighthouse advises a
#: slower one.
HEARTBEAT_INTERVAL = 0.1


def _start_lighthouse(
    groups: int, token: str | None, floor: str | None = None
) -> tuple[subprocess.Popen, str]:
    """As ``ftlaunch --replicas N`` hosts it: ``min_replicas`` 1 (the default), the N groups announced
    (the first quorum waits for them), the job's token (ftlaunch always makes one). ``floor``: the
    do-nothing server of `bench_lighthouse_sim.serve_floor` ("floor") or the lighthouse's transport
    under a do-nothing handler (`bench_lighthouse_sim.serve_transport_floor`, "transport") instead."""
    if floor is not None:  # "floor", "transport" or "torchft"
        cmd = [sys.executable, sim.__file__, floor, str(groups)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "ftlaunch.lighthouse",
            "--min-replicas",
            "1",
            "--expected-replicas",
            str(groups),
            "--join-timeout",
            "30",
            "--heartbeat-timeout",
            "10",
            "--log-level",
            "WARNING",
        ]
    env = dict(os.environ)
    env.pop("FTLAUNCH_TOKEN", None)
    if token:
        env["FTLAUNCH_TOKEN"] = token
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"lighthouse did not start: {line!r}")
    return proc, line.split("listening on", 1)[1].strip()


def _group_worker(
    addr: str, rids: list[str], rounds: int, warmup: int, barrier, out, token: str | None = None
) -> None:
    """One process running len(rids) groups, one thread each; reports (rid, [(send, recv), ...])."""
    from ftlaunch.lighthouse import LighthouseClient, QuorumMember

    client = LighthouseClient(addr, connect_timeout=30.0, token=token)
    for rid in rids:
        client.start_heartbeat(rid, HEARTBEAT_INTERVAL)
    barrier.wait()

    def run(rid: str) -> None:
        times = []
        for step in range(warmup + rounds):
            t0 = time.perf_counter()
            client.quorum(QuorumMember(rid, step=step), timeout=60.0)
            t1 = time.perf_counter()
            if step >= warmup:
                times.append((t0, t1))
        out.put((rid, times))

    threads = [threading.Thread(target=run, args=(rid,)) for rid in rids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rid in rids:
        client.leave(rid)  # also stops its heartbeat
    client.close()


def _sim_worker(
    addr: str,
    rids: list[str],
    rounds: int,
    warmup: int,
    barrier,
    out,
    spread: float = 0.0,
    vary_head: bool = False,
    full: bool = False,
    token: str | None = None,
) -> None:
    """Lightweight simulated groups: raw keep-alive sockets driven by one selector loop.

    Real LighthouseClient threads would spend the 2 cores on client-side work (64 JSON parses per
    round under per-process GILs) and measure the simulation rather than the lighthouse. Each
    group still has its own quorum connection and its own bound heartbeat connection (100 ms).
    ``spread`` > 0 staggers each round's requests uniformly over that many seconds (groups finish
    their steps at different times); 0 sends them all at once (burst). ``vary_head`` adds an
    ``X-Bench-Step`` header, so no two requests of a connection share their head. Like
    LighthouseClient, each group names the answer revision it holds (``known``), so the lighthouse
    answers with a delta (docs/lighthouse.md); ``full`` leaves it out, as an older client does, and
    every group gets the whole quorum. The groups of one process share the decode of one answer a
    round (the answers of a round are the same bytes). Like LighthouseClient, every request carries
    the job token and the process's incarnation.
    """
    import json
    import random
    import re
    import secrets
    import selectors
    import socket

    from ftlaunch.addresses import parse_host_port

    host, port = parse_host_port(addr)
    length_re = re.compile(rb"content-length:\s*(\d+)", re.I)

    def connect() -> socket.socket:
        s = socket.create_connection((host, port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    fixed = f"X-Ftlaunch-Incarnation: {secrets.token_hex(8)}\r\n"  # one process (LighthouseClient's)
    if token:
        fixed += f"Authorization: Bearer {token}\r\n"

    def post(path: str, obj: dict, replica: str | None = None, step: int | None = None) -> bytes:
        body = json.dumps(obj).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: lh\r\nContent-Type: application/json\r\nContent-Length: "
            f"{len(body)}\r\n"
        )
        head += fixed
        if replica:
            head += f"X-Ftlaunch-Replica: {replica}\r\n"
        if step is not None:
            head += f"X-Bench-Step: {step}\r\n"
        return head.encode() + b"\r\n" + body

    scratch = memoryview(bytearray(262144))  # recv_into: no 256 KiB allocation per read

    def read_response(s: socket.socket, buf: bytearray) -> bytes | None:
        """Append what is available; return the body once the response is complete."""
        buf += scratch[: s.recv_into(scratch)]
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        m = length_re.search(bytes(buf[:end]))
        need = end + 4 + int(m.group(1))
        if len(buf) < need:
            return None
        if not buf.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(bytes(buf[:200]))
        body = bytes(buf[end + 4 : need])
        del buf[:need]
        return body

    qsocks = {rid: connect() for rid in rids}
    hsocks = {rid: connect() for rid in rids}
    sel = selectors.DefaultSelector()
    for rid, s in qsocks.items():
        sel.register(s, selectors.EVENT_READ, rid)
    bufs = {rid: bytearray() for rid in rids}

    def heartbeats() -> float:
        """One beat of every group; returns the pace the lighthouse advised (LighthouseClient's rule:
        the slower of its own interval and the advice)."""
        for rid, s in hsocks.items():
            s.sendall(post("/v1/heartbeat", {"replica_id": rid}, replica=rid))
        advised = 0.0
        for s in hsocks.values():
            buf = bytearray()
            while (body := read_response(s, buf)) is None:
                pass
            if not advised:
                advised = float(json.loads(body).get("interval", 0.0))
        return max(HEARTBEAT_INTERVAL, advised)

    pace = heartbeats()
    barrier.wait()
    cpu0 = time.process_time()
    last_beat = time.perf_counter()
    times: dict[str, list[tuple[float, float]]] = {rid: [] for rid in rids}
    ids = set()
    kinds = set()
    known: str | None = None
    for step in range(warmup + rounds):
        sent: dict[str, float] = {}
        start = time.perf_counter()
        due = sorted((start + random.uniform(0.0, spread), rid) for rid in rids)
        got: dict[str, float] = {}
        while len(got) < len(rids):
            while due and due[0][0] <= time.perf_counter():
                _, rid = due.pop(0)
                ask: dict = {"member": {"replica_id": rid, "step": step}, "timeout": 60}
                if known is not None and not full:
                    ask["known"] = known
                req = post("/v1/quorum", ask, step=step if vary_head else None)
                sent[rid] = time.perf_counter()
                qsocks[rid].sendall(req)
            timeout = max(0.0, due[0][0] - time.perf_counter()) if due else None
            for key, _ in sel.select(timeout):
                rid = key.data
                body = read_response(key.fileobj, bufs[rid])
                if body is not None:
                    got[rid] = time.perf_counter()
                    if len(got) == 1:
                        answer = json.loads(body)
                        kind = "delta" if "delta" in answer else "quorum"
                        kinds.add(kind)
                        ids.add(answer[kind]["quorum_id"])
                        known = answer.get("revision")
        if step >= warmup:
            for rid in rids:
                times[rid].append((sent[rid], got[rid]))
        if time.perf_counter() - last_beat >= pace:
            pace = heartbeats()
            last_beat = time.perf_counter()
    cpu = time.process_time() - cpu0
    for rid, s in qsocks.items():
        s.sendall(post("/v1/leave", {"replica_id": rid}))
        while read_response(s, bufs[rid]) is None:
            pass
    for s in (*qsocks.values(), *hsocks.values()):
        s.close()
    for rid in rids:
        out.put((rid, times[rid]))
    out.put(("ids", sorted(ids)))
    out.put(("kinds", sorted(kinds)))
    out.put(("cpu", cpu))


#: How often the parent looks at its workers while it waits for them (seconds).
_POLL_S = 0.2


def _dead_worker(workers: list, *, any_exit: bool) -> str | None:
    """A message naming a worker that ended (``any_exit``: at all; else with a non-zero code), or None."""
    for w in workers:
        code = w.exitcode
        if code is not None and (any_exit or code != 0):
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            return (
                f"benchmark worker {w.name} (pid {w.pid}) ended with {how} before it was done (its "
                "traceback, if "
                "any, is above: e.g. ftlaunch not importable in a spawned process)"
            )
    return None


def _fail(workers: list, message: str) -> SystemExit:
    """End the workers still running (the parent's exit would wait for them: they are not daemons,
    and without the dead one's groups their quorum rounds never complete), for ``raise``."""
    for w in workers:
        if w.exitcode is None:
            w.terminate()
    for w in workers:
        w.join(5)
    return SystemExit(message)


def _wait_ready(barrier, workers: list, timeout: float = 600.0) -> None:
    """``barrier.wait`` with the workers, but exit at once when one of them ended first (it never
    reaches the barrier: the wait would last the whole timeout). A barrier's wait cannot be sliced
    (a timeout breaks it), so the parent joins only once every worker waits there."""
    deadline = time.monotonic() + timeout
    while barrier.n_waiting < barrier.parties - 1:
        dead = _dead_worker(workers, any_exit=True)
        if dead is not None:
            barrier.abort()
            raise _fail(workers, dead)
        if time.monotonic() > deadline:
            raise _fail(workers, f"benchmark workers not ready within {timeout:g}s")
        time.sleep(_POLL_S / 4)
    barrier.wait(timeout=timeout)


def _get(out, workers: list, timeout: float = 600.0):
    """``out.get`` in short slices, exiting at once when a worker ended with an error -- or when
    all ended and nothing more comes -- instead of waiting out the whole timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return out.get(timeout=_POLL_S)
        except queue.Empty:
            dead = _dead_worker(workers, any_exit=False)
            if dead is None and all(w.exitcode is not None for w in workers):
                try:
                    return out.get(timeout=_POLL_S)  # the last items of a worker that just ended
                except queue.Empty:
                    dead = "benchmark workers all ended without sending every result"
            if dead is not None:
                raise _fail(workers, dead) from None
            if time.monotonic() > deadline:
                raise _fail(workers, f"no result from the benchmark workers within {timeout:g}s") from None


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def bench_quorum(
    groups: int,
    procs: int,
    rounds: int,
    *,
    simulated: bool,
    spread: float = 0.0,
    vary_head: bool = False,
    warmup: int = 20,
    full: bool = False,
    token: str | None = None,
    floor: str | None = None,
    lean: bool = False,
) -> dict:
    import psutil

    ctx = mp.get_context("spawn")
    server, addr = _start_lighthouse(groups, token, floor)
    try:
        width = len(str(groups - 1))
        rids = [f"g{i:0{width}d}" for i in range(groups)]
        chunks = [rids[i::procs] for i in range(procs)]
        barrier = ctx.Barrier(procs + 1)  # the workers, and this process to start the CPU clock
        out = ctx.Queue()
        if floor == "torchft":
            workers = [
                ctx.Process(target=sim.torchft_worker, args=(addr, c, rounds, warmup, barrier, out, groups))
                for c in chunks
            ]
        elif simulated and lean:
            workers = [
                ctx.Process(target=sim.lean_worker, args=(addr, c, rounds, warmup, barrier, out, full, token))
                for c in chunks
            ]
        elif simulated:
            workers = [
                ctx.Process(
                    target=_sim_worker,
                    args=(addr, c, rounds, warmup, barrier, out, spread, vary_head, full, token),
                )
                for c in chunks
            ]
        else:
            workers = [
                ctx.Process(target=_group_worker, args=(addr, c, rounds, warmup, barrier, out, token))
                for c in chunks
            ]
        for w in workers:
            w.start()
        lighthouse = psutil.Process(server.pid)
        _wait_ready(barrier, workers)
        cpu_start = sum(lighthouse.cpu_times()[:2])
        results = {}
        ids: set[int] = set()
        kinds: set[str] = set()
        clients_cpu = 0.0
        for _ in range(groups + (3 * procs if simulated else 0)):
            key, value = _get(out, workers)
            if key == "cpu":
                clients_cpu += value
            elif key == "ids":
                ids.update(value)
            elif key == "kinds":
                kinds.update(value)
            else:
                results[key] = value
        cpu = sum(lighthouse.cpu_times()[:2]) - cpu_start
        for w in workers:
            w.join(60)
            if w.exitcode != 0:
                raise SystemExit(f"benchmark worker failed with exit code {w.exitcode}")
        if simulated and len(ids) != 1:
            raise SystemExit(f"expected one quorum id for unchanged membership, got {sorted(ids)}")
        if simulated and floor != "torchft" and ("delta" in kinds) == full:
            raise SystemExit(
                f"expected {'whole quorums' if full else 'deltas'} as answers, got {sorted(kinds)}"
            )
    finally:
        server.terminate()
        server.wait(10)
    round_trips, last_call = [], []
    for r in range(rounds):
        sends = [results[rid][r][0] for rid in rids]
        recvs = [results[rid][r][1] for rid in rids]
        round_trips.append(max(recvs) - max(sends))
        last = max(rids, key=lambda rid: results[rid][r][0])
        last_call.append(results[last][r][1] - results[last][r][0])
    ms = 1000.0
    return {
        "kind": (
            ("lean" if lean else "sim")
            + (f", {spread * 1000:g} ms spread" if spread else ", burst")
            + (", heads vary" if vary_head else "")
            + (", whole" if full else "")
            + ({"floor": ", FLOOR", "transport": ", TRANSPORT"}.get(floor or "", ""))
            if simulated and floor != "torchft"
            else "torchft LighthouseClient"
            if floor == "torchft"
            else "LighthouseClient"
        ),
        "groups": groups,
        "procs": procs,
        "rounds": rounds,
        "p50": statistics.median(round_trips) * ms,
        "p99": _pct(round_trips, 99) * ms,
        "last_p50": statistics.median(last_call) * ms,
        "cpu_per_round": cpu / (warmup + rounds) * ms,
        "clients_cpu_per_round": clients_cpu / (warmup + rounds) * ms if simulated else None,
    }


def _hb_worker(addr: str, threads: int, seconds: float, out, token: str | None = None) -> None:
    from ftlaunch.lighthouse import LighthouseClient

    client = LighthouseClient(addr, token=token)
    counts = []

    def run(i: int) -> None:
        rid = f"hb{os.getpid()}-{i}"
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            client.heartbeat(rid)
            n += 1
        counts.append(n)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    client.close()
    out.put(sum(counts))


def bench_heartbeats(procs: int, threads: int, seconds: float, token: str | None = None) -> float:
    ctx = mp.get_context("spawn")
    server, addr = _start_lighthouse(0, token)
    try:
        out = ctx.Queue()
        workers = [
            ctx.Process(target=_hb_worker, args=(addr, threads, seconds, out, token)) for _ in range(procs)
        ]
        for w in workers:
            w.start()
        total = sum(_get(out, workers, 120) for _ in range(procs))
        for w in workers:
            w.join(30)
    finally:
        server.terminate()
        server.wait(10)
    return total / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=500, help="measured rounds with 2 groups")
    p.add_argument("--rounds64", type=int, default=200, help="measured rounds with 64 groups")
    p.add_argument("--procs64", type=int, default=8, help="processes hosting the 64 simulated groups")
    p.add_argument(
        "--spread64",
        type=float,
        default=20.0,
        help="ms over which the staggered 64-group run spreads each round's requests",
    )
    p.add_argument("--rounds1024", type=int, default=30, help="measured rounds with --groups-large groups")
    p.add_argument(
        "--groups-large", type=int, default=1024, help="groups of the large burst row (0: skip it)"
    )
    p.add_argument("--hb-seconds", type=float, default=3.0)
    p.add_argument("--small", type=int, default=4, help="groups of the small-job rows (0: skip them)")
    p.add_argument(
        "--scale-only",
        action="store_true",
        help="only the rows that compare delta and whole answers (small job, --groups-large) and heartbeats",
    )
    p.add_argument(
        "--answers",
        choices=("both", "deltas", "whole"),
        default="both",
        help="which answer forms the small-job and large rows run (both: deltas, then whole)",
    )
    p.add_argument(
        "--client64",
        action="store_true",
        help="also run 64 groups as real LighthouseClient threads (measures client CPU on few cores)",
    )
    p.add_argument(
        "--token",
        default=None,
        help="job token every request carries (default: a fresh one, as ftlaunch makes; '' for none)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also run the --groups-large deltas row against a do-nothing server (the harness's floor) "
        "and against the lighthouse's transport under a do-nothing handler",
    )
    p.add_argument(
        "--clients",
        choices=("sim", "lean", "both"),
        default="sim",
        help="simulated groups of the small-job and large rows: the benchmark's own (sim), lean ones "
        "that spend less of the host's CPU (bench_lighthouse_sim.lean_worker), or both",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="only the side-by-side rows: for each of --sizes groups in turn, the lighthouse "
        "(lean clients, deltas), the harness's floor, and torchft's lighthouse and client when torchft is "
        "installed; --repeat times, interleaved",
    )
    p.add_argument("--repeat", type=int, default=1, help="rounds of the --compare rows")
    p.add_argument(
        "--sizes",
        default="4,64,1024",
        help="group counts of the --compare rows (comma-separated; 200 measured rounds below 1024 "
        "groups, --rounds1024 from 1024 on)",
    )
    args = p.parse_args()
    token = secrets.token_hex(16) if args.token is None else args.token or None
    # Each simulated group holds two connections, and the lighthouse one per connection.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * args.groups_large + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard)
        )

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"lighthouse benchmark on {os.cpu_count()} CPU(s), Python {sys.version.split()[0]}, "
        f"load average {load} (other work on the host inflates every figure)",
        flush=True,
    )
    if args.compare:
        rows = _compare(args, token)
    else:
        rows = _rows(args, token)
    _print_rows(rows)
    rate = bench_heartbeats(procs=2, threads=2, seconds=args.hb_seconds, token=token)
    print(f"\nheartbeat throughput: {rate:,.0f} req/s (2 processes x 2 threads, keep-alive connections)")
    print(f"every request carried the job token: {'yes' if token else 'no'}")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average at the end: {load}")


def _compare(args: argparse.Namespace, token: str | None) -> list[dict]:
    """The lighthouse beside the harness's floor and torchft's lighthouse, at each group count, the
    three interleaved so that the host's load weighs on them alike."""
    native = sim.torchft_native() is not None
    if not native:
        print(
            "torchft is not installed: its rows are skipped (pip install --no-deps torchft-nightly)",
            flush=True,
        )
    rows = []
    for _ in range(args.repeat):
        for groups in (int(n) for n in args.sizes.split(",") if n.strip()):
            rounds, warmup = (args.rounds1024, 5) if groups >= 1024 else (args.rounds64, 20)
            procs = min(groups, args.procs64)
            for floor in (None, "floor", "torchft") if native else (None, "floor"):
                rows.append(bench_quorum(
                    groups, procs, rounds, simulated=True, warmup=warmup, token=token, floor=floor, lean=True,
                ))  # fmt: skip
                load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
                r = rows[-1]
                done = f"p50 {r['p50']:.2f} ms, p99 {r['p99']:.2f} ms (load {load})"
                print(f"  {groups:>5} {r['kind']:>26}: {done}", flush=True)
    return rows


def _rows(args: argparse.Namespace, token: str | None) -> list[dict]:
    rows = (
        []
        if args.scale_only
        else [
            bench_quorum(2, 2, args.rounds, simulated=False, token=token),
            bench_quorum(64, args.procs64, args.rounds64, simulated=True, token=token),
            bench_quorum(
                64, args.procs64, args.rounds64, simulated=True, spread=args.spread64 / 1000, token=token
            ),
            bench_quorum(64, args.procs64, args.rounds64, simulated=True, vary_head=True, token=token),
        ]
    )
    # Answers as deltas (what LighthouseClient gets) beside whole quorums (what an older client, or
    # one naming no revision, gets): a small job must not get slower, a large one is the point.
    forms = {"both": (False, True), "deltas": (False,), "whole": (True,)}[args.answers]
    kinds = {"sim": (False,), "lean": (True,), "both": (False, True)}[args.clients]
    if args.small:
        for lean in kinds:
            for full in forms:
                rows.append(bench_quorum(
                    args.small, min(args.small, args.procs64), args.rounds64, simulated=True, full=full,
                    token=token,
                    lean=lean,
                ))  # fmt: skip
    if args.groups_large:
        for lean in kinds:
            floors = [(False, "floor"), (False, "transport")] if args.floor else []
            for full, floor in [(full, None) for full in forms] + floors:
                rows.append(bench_quorum(
                    args.groups_large, args.procs64, args.rounds1024, simulated=True, warmup=5, full=full,
                    token=token, floor=floor, lean=lean,
                ))  # fmt: skip
    if args.client64:
        rows.append(bench_quorum(64, args.procs64, args.rounds64, simulated=False, token=token))
    return rows


def _print_rows(rows: list[dict]) -> None:
    print("\nfast-quorum round trip (last request sent -> every group has the quorum)")
    print(
        f"{'groups':>6} {'clients':>26} {'procs':>5} {'rounds':>6} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'last caller p50':>15} {'server CPU':>13} {'clients CPU':>13} {'target p50':>10} "
        f"{'met':>4} {'torchft p50':>11}"
    )
    for r in rows:
        target = TARGET_MS.get(r["groups"])
        met = "-" if target is None else "yes" if r["p50"] <= target else "NO"
        goal = f"<= {target:g} ms" if target else "-"
        clients = r["clients_cpu_per_round"]
        clients_text = f"{clients:>7.2f} ms/rd" if clients is not None else "-"
        print(
            f"{r['groups']:>6} {r['kind']:>26} {r['procs']:>5} {r['rounds']:>6} {r['p50']:>8.3f} "
            f"{r['p99']:>8.3f} "
            f"{r['last_p50']:>12.3f} ms {r['cpu_per_round']:>7.2f} ms/rd {clients_text:>13} "
            f"{goal:>10} {met:>4} {TORCHFT.get(r['groups'], '-'):>11}"
        )


if __name__ == "__main__":
    main()
