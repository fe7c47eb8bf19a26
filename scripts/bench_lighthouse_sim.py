"""The lighthouse benchmark's lean parts (``scripts/bench_lighthouse.py`` imports them): the
do-nothing server that measures the harness's floor, and lean simulated groups.

Why apart: the benchmark's own simulated groups (``_sim_worker``) stay as they were, so that figures
stay comparable with earlier runs; these are what a fairer split of the host's two cores needs --
the clients are not the product, and every millisecond of CPU they spend is taken from the
lighthouse on a 2-core machine. Both keep what is measured: the round trip from the moment the
LAST group sends its quorum request until EVERY group holds its answer.

    python scripts/bench_lighthouse_sim.py floor N      # serve as the floor server for N groups
    python scripts/bench_lighthouse_sim.py transport N  # the lighthouse's transport, a handler doing nothing
    python scripts/bench_lighthouse_sim.py torchft N    # torchft's Rust lighthouse (torchft-nightly)

torchft's lighthouse (its Rust gRPC `LighthouseServer`) and its client (`LighthouseClient.quorum`, the
call a torchft replica's manager makes for a quorum) run in the same harness when torchft is
importable (`torchft_native`); the benchmark prints a line saying so when it is not.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _answer(kind: str, size: int) -> bytes:
    """A quorum answer's body of ``kind`` ("delta", or "quorum" for a whole one) padded to ``size``
    bytes, the size of the lighthouse's 1024-group delta."""
    payload = {kind: {"quorum_id": 1, "pad": ""}, "revision": "floor-1", "version": 1}
    payload[kind]["pad"] = "x" * max(0, size - len(json.dumps(payload)))
    return json.dumps(payload).encode()


#: The floors' fixed answer bodies: a delta, a whole quorum, a heartbeat's (the 1024-group pace), a leave's.
_ANSWERS = (
    _answer("delta", 240),
    _answer("quorum", 240),
    json.dumps({"ok": True, "interval": 1.1, "version": 1}).encode(),
    json.dumps({"left": True, "version": 1}).encode(),
)


def serve_floor(groups: int) -> None:
    """The harness's floor: an asyncio server that reads each request (head up to the blank line,
    body by Content-Length) and nothing more -- no HTTP parse, no JSON, no token check, no
    bookkeeping. Once ``groups`` quorum requests are parked it writes one fixed answer to each (a
    delta of the size the lighthouse sends, or a whole-quorum kind to a request naming no revision);
    a heartbeat gets the 1024-group pace at once. What the 1024-group row costs the same harness
    with a server that does no work of its own: the system calls, asyncio's steps, the clients."""
    import asyncio
    import re

    length_re = re.compile(rb"content-length:\s*(\d+)", re.I)

    def wire(body: bytes) -> bytes:
        return (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body
        )

    delta, whole, beat, left = (wire(body) for body in _ANSWERS)
    parked: list[tuple[asyncio.Transport, bytes]] = []

    scratch = memoryview(bytearray(65536))

    class Floor(asyncio.BufferedProtocol):
        """Reads into one preallocated buffer, as the lighthouse does (`asyncio.Protocol` has asyncio
        allocate 256 KiB per read: most of a do-nothing server's CPU)."""

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t = transport
            self.buf = b""

        def get_buffer(self, sizehint: int) -> memoryview:
            return scratch

        def buffer_updated(self, nbytes: int) -> None:
            self.buf += scratch[:nbytes]
            while (end := self.buf.find(b"\r\n\r\n")) >= 0:
                m = length_re.search(self.buf, 0, end)
                need = end + 4 + (int(m.group(1)) if m else 0)
                if len(self.buf) < need:
                    return
                head, body, self.buf = self.buf[:end], self.buf[end + 4 : need], self.buf[need:]
                if head.startswith(b"POST /v1/quorum"):
                    parked.append((self.t, delta if b'"known"' in body else whole))  # type: ignore[arg-type]
                    if len(parked) == groups:
                        for t, wire in parked:
                            t.write(wire)
                        parked.clear()
                elif head.startswith(b"POST /v1/heartbeat"):
                    self.t.write(beat)  # type: ignore[attr-defined]
                else:
                    self.t.write(left)  # type: ignore[attr-defined]

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Floor, "127.0.0.1", 0, backlog=1024)
        port = server.sockets[0].getsockname()[1]
        print(f"floor server listening on http://127.0.0.1:{port}", flush=True)
        await asyncio.Event().wait()

    import signal

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    asyncio.run(serve())


def serve_transport_floor(groups: int) -> None:
    """The lighthouse's own transport (`transport.HttpServer`, `connection.Connection`: HTTP framing,
    head reuse, long polls, timers, the fan-out) under a handler that does nothing: every quorum
    request is parked, and once ``groups`` are parked each gets one fixed answer of the size of the
    lighthouse's (as `serve_floor`); heartbeats and leaves get a fixed answer at once. No token
    check, no JSON, no membership. Between `serve_floor` and the lighthouse, it says how much of a
    round is the transport and how much the routes, the membership and the answers."""
    import signal
    import socket
    import threading

    from ftlaunch.lighthouse.http import Request, Response
    from ftlaunch.lighthouse.server import collect_less
    from ftlaunch.lighthouse.transport import HttpServer

    delta, whole, beat, left = (Response(200, body) for body in _ANSWERS)

    class Poll:
        """A parked quorum request (`http.LongPoll`), answered once the round's last one arrives."""

        __slots__ = ("timeout", "reply", "ready", "callback")

        def __init__(self, reply: Response) -> None:
            self.timeout, self.reply = 60.0, reply
            self.ready: Response | None = None  # the answer, once the round is complete
            self.callback = None

        def on_ready(self, callback) -> None:  # noqa: ANN001
            if self.ready is not None:
                callback()
            else:
                self.callback = callback

        def expire(self) -> None:
            pass

        def cancel(self) -> None:
            pass

        def answer(self) -> Response | None:
            return self.ready

    parked: list = []

    class Handler:
        def handle(self, request: Request):  # noqa: ANN201
            path = request.head.path
            if path == "/v1/quorum":
                poll = Poll(delta if b'"known"' in request.body else whole)
                parked.append(poll)
                if len(parked) == groups:
                    for p in parked:
                        p.ready = p.reply
                        if p.callback is not None:
                            p.callback()
                    parked.clear()
                return poll
            return beat if path == "/v1/heartbeat" else left

        def error(self, error, head, peer) -> Response:  # noqa: ANN001
            return Response(error.status, b"{}")

        def identity_lost(self, identity: str) -> None:
            pass

    sock = socket.create_server(("127.0.0.1", 0), backlog=1024)
    server = HttpServer(sock, Handler(), idle_timeout=120.0, read_timeout=10.0, max_body=1 << 20)  # type: ignore[arg-type]
    collect_less()  # as the lighthouse process does
    server.start()
    print(f"transport floor listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    threading.Event().wait()


def torchft_native():  # noqa: ANN201
    """torchft's compiled module (``torchft._torchft``: `LighthouseServer`, `LighthouseClient`), or None
    when torchft is not installed. Loaded by its file when the package's ``__init__`` cannot be
    imported (it pulls in torch and OpenTelemetry, which the lighthouse does not need)."""
    import importlib.util

    # torchft logs every quorum (its members included) and every connection at INFO on stderr; its
    # level is read from RUST_LOG when the module loads.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        from torchft import _torchft  # type: ignore[import-not-found]

        return _torchft
    except Exception:  # noqa: BLE001 -- not installed, or its package __init__ needs what is missing
        pass
    try:
        spec = importlib.util.find_spec("torchft")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    import glob

    for folder in spec.submodule_search_locations:
        for path in glob.glob(os.path.join(folder, "_torchft*.so")):
            native = importlib.util.spec_from_file_location("torchft._torchft", path)
            if native is None or native.loader is None:
                continue
            module = importlib.util.module_from_spec(native)
            native.loader.exec_module(module)
            return module
    return None


def serve_torchft(groups: int) -> None:
    """torchft's lighthouse: its Rust `LighthouseServer` in this process, with ``min_replicas`` the
    ``groups`` (as ``ftlaunch --replicas N`` announces N: the first quorum waits for all of them;
    from then on every round is torchft's fast quorum, formed when the last member of the previous
    one asks) and the same join timeout as the lighthouse's row."""
    import signal
    import threading

    native = torchft_native()
    if native is None:
        raise SystemExit("torchft is not installed (pip install --no-deps torchft-nightly)")
    server = native.LighthouseServer(bind="127.0.0.1:0", min_replicas=groups, join_timeout_ms=30000)
    addr = (
        server.address().replace("http://", "").replace("[::]", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")
    )
    print(f"torchft lighthouse listening on {addr}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    threading.Event().wait()


def torchft_worker(addr: str, rids: list[str], rounds: int, warmup: int, barrier, out, groups: int) -> None:
    """Groups as a torchft replica asks for quorums: one `LighthouseClient` (its own gRPC connection
    and runtime) per group, one thread per group calling ``LighthouseClient.quorum``, each asking
    again as soon as it holds an answer (the harness's rounds: the round trip is from the last
    request of a round until every group holds its answer). Heartbeats are sent at the pace the
    ftlaunch lighthouse advises for this many groups (torchft's manager beats every 100 ms; the
    slower pace spares torchft's server the same load ours is spared). Reports what `lean_worker`
    reports."""
    import threading
    from datetime import timedelta

    from ftlaunch.lighthouse.protocol import advised_heartbeat_interval

    # One tokio worker thread per client (torchft reads TOKIO_WORKER_THREADS; its default is the
    # host's cores): a process hosts up to 128 groups' clients, and a runtime each of 2+ threads would
    # leave the host's two cores to thousands of threads.
    os.environ.setdefault("TOKIO_WORKER_THREADS", "1")
    native = torchft_native()
    assert native is not None
    clients = [native.LighthouseClient(f"http://{addr}", timedelta(seconds=30)) for _ in rids]
    pace = max(0.1, advised_heartbeat_interval(groups, 10.0) or 0.0)
    stop = threading.Event()

    def heartbeats() -> None:
        while not stop.is_set():
            for rid, client in zip(rids, clients, strict=True):
                try:
                    client.heartbeat(rid)
                except TimeoutError:  # as torchft's manager does: the next beat is tried
                    pass
            stop.wait(pace)

    times: list[list[tuple[float, float]]] = [[] for _ in rids]
    ids: set[int] = set()

    def run(i: int) -> None:
        rid, client, mine = rids[i], clients[i], times[i]
        for step in range(warmup + rounds):
            t0 = time.perf_counter()
            quorum = client.quorum(replica_id=rid, timeout=timedelta(seconds=60), step=step)
            t1 = time.perf_counter()
            if step >= warmup:
                mine.append((t0, t1))
            if i == 0:
                ids.add(int(quorum.quorum_id))

    beat = threading.Thread(target=heartbeats, daemon=True)
    beat.start()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(rids))]
    barrier.wait()
    cpu0 = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu = time.process_time() - cpu0
    stop.set()
    beat.join()
    for rid, t in zip(rids, times, strict=True):
        out.put((rid, t))
    out.put(("ids", sorted(ids)))
    out.put(("kinds", ["quorum"]))
    out.put(("cpu", cpu))


def lean_worker(
    addr: str,
    rids: list[str],
    rounds: int,
    warmup: int,
    barrier,
    out,
    full: bool = False,
    token: str | None = None,
) -> None:
    """Lean simulated groups: the same requests on the same connections as ``_sim_worker`` (a
    quorum connection and a bound heartbeat connection per group, the job token, the process's
    incarnation, the revision held as ``known``), with less of the clients' own CPU per round: the
    requests are formatted as bytes from a template, the sockets are polled with ``select.epoll``
    directly, an answer is taken as complete by its Content-Length without a regular expression,
    and the first answer of a round is decoded while the others are only compared with it (they
    must be the same bytes: the lighthouse answers every holder of a revision alike). Reports the
    same (rid, [(send, recv), ...]) as ``_sim_worker``, and the process's CPU time."""
    import secrets
    import select
    import socket

    from ftlaunch.addresses import parse_host_port

    host, port = parse_host_port(addr)
    fixed = f"X-Ftlaunch-Incarnation: {secrets.token_hex(8)}\r\n"
    if token:
        fixed += f"Authorization: Bearer {token}\r\n"
    quorum_head = (
        "POST /v1/quorum HTTP/1.1\r\nHost: lh\r\nContent-Type: application/json\r\n" + fixed
    ).encode()

    def connect() -> socket.socket:
        s = socket.create_connection((host, port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def answer_of(buf: bytes) -> tuple[bytes, int] | None:
        """(body, bytes used) of the response at the start of ``buf``, once it is whole."""
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        i = buf.find(b"Content-Length: ", 0, end)
        need = end + 4 + int(buf[i + 16 : buf.find(b"\r\n", i)])
        if len(buf) < need:
            return None
        if not buf.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(buf[:200])
        return buf[end + 4 : need], need

    qsocks = [connect() for _ in rids]
    hsocks = [connect() for _ in rids]
    beats = []
    for rid in rids:
        body = json.dumps({"replica_id": rid}).encode()
        beats.append(
            (f"POST /v1/heartbeat HTTP/1.1\r\nHost: lh\r\nContent-Type: application/json\r\n"
             f"Content-Length: {len(body)}\r\nX-Ftlaunch-Replica: {rid}\r\n{fixed}\r\n").encode() + body
        )  # fmt: skip

    def heartbeats() -> float:
        for s, req in zip(hsocks, beats, strict=True):
            s.sendall(req)
        advised = 0.0
        for s in hsocks:
            buf = b""
            while (got := answer_of(buf)) is None:
                buf += s.recv(65536)
            if not advised:
                advised = float(json.loads(got[0]).get("interval", 0.0))
        return max(0.1, advised)

    poll = select.epoll()
    index = {}
    for i, s in enumerate(qsocks):
        poll.register(s.fileno(), select.EPOLLIN)
        index[s.fileno()] = i
    pace = heartbeats()
    barrier.wait()
    cpu0 = time.process_time()
    last_beat = time.perf_counter()
    n = len(rids)
    times: list[list[tuple[float, float]]] = [[] for _ in rids]
    ids: set[int] = set()
    kinds: set[str] = set()
    known = b""
    bufs = [b""] * n
    for step in range(warmup + rounds):
        tail = b', "known": "' + known + b'"}' if known and not full else b"}"
        sent = [0.0] * n
        for i, rid in enumerate(rids):
            body = b'{"member": {"replica_id": "%s", "step": %d}, "timeout": 60%s' % (
                rid.encode(),
                step,
                tail,
            )
            req = quorum_head + b"Content-Length: %d\r\n\r\n" % len(body) + body
            sent[i] = time.perf_counter()
            qsocks[i].sendall(req)
        got = [0.0] * n
        left = n
        first: bytes | None = None
        while left:
            for fd, _ in poll.poll():
                i = index[fd]
                buf = bufs[i] + qsocks[i].recv(65536)
                whole = answer_of(buf)
                if whole is None:
                    bufs[i] = buf
                    continue
                got[i] = time.perf_counter()
                bufs[i] = buf[whole[1] :]
                left -= 1
                if first is None:
                    first = whole[0]
                    answer = json.loads(first)
                    kind = "delta" if "delta" in answer else "quorum"
                    kinds.add(kind)
                    ids.add(answer[kind]["quorum_id"])
                    known = answer.get("revision", "").encode()
                elif whole[0] != first:
                    raise RuntimeError(f"round {step}: groups got different answers")
        if step >= warmup:
            for i in range(n):
                times[i].append((sent[i], got[i]))
        if time.perf_counter() - last_beat >= pace:
            pace = heartbeats()
            last_beat = time.perf_counter()
    cpu = time.process_time() - cpu0
    poll.close()
    for rid, s in zip(rids, qsocks, strict=True):
        body = json.dumps({"replica_id": rid}).encode()
        s.sendall(
            quorum_head.replace(b"/v1/quorum", b"/v1/leave")
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        buf = b""
        while answer_of(buf) is None:
            buf += s.recv(65536)
    for s in (*qsocks, *hsocks):
        s.close()
    for rid, t in zip(rids, times, strict=True):
        out.put((rid, t))
    out.put(("ids", sorted(ids)))
    out.put(("kinds", sorted(kinds)))
    out.put(("cpu", cpu))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "floor":
        serve_floor(int(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "transport":
        serve_transport_floor(int(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "torchft":
        serve_torchft(int(sys.argv[2]))
    else:
        raise SystemExit(__doc__)
