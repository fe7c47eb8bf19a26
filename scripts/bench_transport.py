"""Benchmark live-recovery transfers: HTTPTransport (and PGTransport over Gloo) on loopback.

Sender and receiver are separate processes, as between two replica groups. Prints GB/s (10^9
bytes/s) per run and the median, beside the baseline the transfer is held to: a plain ``memcpy``
(one thread, libc's) of the same tensors into memory of the same kind -- fresh pages for a fresh
receive, the receiver's own tensors for an in-place one -- measured in the receiving process,
interleaved with its receives (one memcpy before each receive), so both see the same load. The
target is a transfer within 2x of that memcpy; torchft's HTTP transport (1.1 GB/s measured on this
machine) is printed beside it. Two floors are printed beside each HTTP figure: one loopback TCP
connection (two kernel copies of every byte) and ``process_vm_readv`` out of the sender's memory (the
kernel's one copy between two processes): no transport between processes that share no memory can
beat the second.

    python scripts/bench_transport.py [--size-mb 256] [--runs 5] [--chunks N ...] [--tensors 64] [--no-pg]

``--chunks`` defaults to HTTPTransport's default (one connection per usable CPU, at most 4).

Modes: ``fresh`` allocates the received tensors, as the Manager does; ``in-place`` receives into the
receiver's existing tensors (``state_dict=`` callable), which needs no new memory.

The fresh receiver runs with ``MALLOC_MMAP_THRESHOLD_`` set low, so every receive gets memory the
process never touched, as a restarted process does (otherwise glibc may hand back the previous
run's freed tensors, already backed with pages, and the figure depends on heap luck). Its first run
is also the first receive of a new process. Sender and receiver share this machine's CPUs, and
other processes may too: the load average is printed, and runs vary with it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import psutil

TORCHFT_HTTP_GBPS = 1.1
#: A transfer should take at most this many times a memcpy of the same bytes.
TARGET_RATIO = 2.0
TIMEOUT = timedelta(seconds=120)
#: glibc serves allocations of at least this many bytes with a fresh mmap (and unmaps them on free).
FRESH_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def make_state(size_bytes: int, ntensors: int, seed: int = 0) -> dict:
    """A model+optimizer-like state dict of about ``size_bytes`` (float32 tensors + small extras)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    per = size_bytes // ntensors // 4
    rows = max(1, per // 1024)
    model = {f"layer{i}.weight": torch.randn(rows, per // rows, generator=g) for i in range(ntensors)}
    return {
        "model": model,
        "optim": {"lr": 0.1, "momentum": 0.9, "step": torch.tensor(17)},
        "manager": {"step": 17, "batches_committed": 170},
    }


def _state_nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values()) + 8


def memcpy_seconds(src: dict, dst: dict | None) -> float:
    """Seconds to copy ``src``'s model tensors with libc's memcpy (``ctypes.memmove``, one thread,
    the GIL released) into ``dst``'s (in place) or, with None, into freshly allocated tensors."""
    import torch

    t0 = time.perf_counter()
    for name, t in src["model"].items():
        d = torch.empty_like(t) if dst is None else dst["model"][name]
        ctypes.memmove(d.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
    return time.perf_counter() - t0


def socket_seconds(src: dict, dst: dict | None) -> float:
    """Seconds to move ``src``'s model tensors over one loopback TCP connection inside this process
    (a sender thread's ``sendall``, this thread's ``recv_into``; no checksums, no protocol): the
    floor under any TCP transport on this machine, two kernel copies of every byte."""
    import socket
    import threading

    import torch

    from ftlaunch.checkpointing.serialization.buffers import byte_view

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        out = socket.create_connection(listener.getsockname())
        inp, _ = listener.accept()
    tensors = list(src["model"].values())
    with out, inp:
        t0 = time.perf_counter()
        sender = threading.Thread(target=lambda: [out.sendall(byte_view(t)) for t in tensors])
        sender.start()
        for name, t in src["model"].items():
            d = torch.empty_like(t) if dst is None else dst["model"][name]
            view, got = byte_view(d), 0
            while got < len(view):
                got += inp.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        sender.join()
        return time.perf_counter() - t0


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def vm_read_seconds(pid: int, regions: list[tuple[int, int]], src: dict, dst: dict | None) -> float | None:
    """Seconds to copy the sender's model tensors (``regions``: address, bytes) straight out of its
    memory into ``dst``'s with ``process_vm_readv``: the kernel's one copy between two processes,
    the floor under any same-host transport that does not share memory. None where the kernel
    refuses it (ptrace rules, seccomp)."""
    import torch

    libc = ctypes.CDLL(None, use_errno=True)
    chunk = 8 << 20
    t0 = time.perf_counter()
    for (addr, n), (name, t) in zip(regions, src["model"].items(), strict=True):
        d = torch.empty_like(t) if dst is None else dst["model"][name]
        for off in range(0, n, chunk):
            size = min(chunk, n - off)
            local, remote = _IoVec(d.data_ptr() + off, size), _IoVec(addr + off, size)
            if libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != size:
                return None
    return time.perf_counter() - t0


def _rates(times: list[float], nbytes: int) -> str:
    rates = [nbytes / t / 1e9 for t in times]
    return f"{statistics.median(rates):.2f} GB/s (runs: {', '.join(f'{r:.2f}' for r in rates)})"


def _rates_line(
    label: str,
    nbytes: int,
    times: list[float],
    copies: list[float],
    sockets: list[float] | None = None,
    vm_reads: list[float] | None = None,
) -> list[str]:
    ratio = statistics.median(t / c for t, c in zip(times, copies, strict=True))
    lines = [
        f"  {label}: {_rates(times, nbytes)}",
        f"      memcpy of the same bytes: {_rates(copies, nbytes)} -> the transfer takes {ratio:.2f}x "
        f"memcpy's time (median of the runs' ratios; target <= {TARGET_RATIO:g}x)",
    ]
    if sockets is not None:
        floor = statistics.median(t / c for t, c in zip(sockets, copies, strict=True))
        lines.append(
            f"      one loopback TCP connection, no protocol: {_rates(sockets, nbytes)} -> "
            f"{floor:.2f}x memcpy's time"
        )
    if vm_reads:
        floor = statistics.median(t / c for t, c in zip(vm_reads, copies, strict=True))
        lines.append(
            f"      the kernel's copy between the two processes (process_vm_readv), no protocol: "
            f"{_rates(vm_reads, nbytes)} -> {floor:.2f}x memcpy's time"
        )
    return lines


def _http_sender(q: mp.Queue, stop: mp.Event, size: int, ntensors: int, chunks: int | None) -> None:
    from ftlaunch.checkpointing import HTTPTransport

    state = make_state(size, ntensors)
    tr = HTTPTransport(TIMEOUT, num_chunks=chunks)
    t0 = time.perf_counter()
    tr.send_checkpoint([1], 17, state, TIMEOUT)
    regions = [(t.data_ptr(), t.numel() * t.element_size()) for t in state["model"].values()]
    q.put((tr.metadata(), time.perf_counter() - t0, os.getpid(), regions))
    stop.wait(600)
    tr.shutdown()


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cpu_seconds() -> float:
    """CPU time (user + system, all threads) this process has used."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _http_receiver(
    q: mp.Queue,
    ack: mp.Event,
    url: str,
    sender: tuple[int, list[tuple[int, int]]],
    size: int,
    ntensors: int,
    chunks: int | None,
    runs: int,
    inplace: bool,
) -> None:
    import torch

    from ftlaunch.checkpointing import HTTPTransport

    mine = make_state(size, ntensors, seed=1)
    source = make_state(size, ntensors, seed=2)  # what the baseline memcpy copies
    tr = HTTPTransport(TIMEOUT, num_chunks=chunks, state_dict=(lambda: mine) if inplace else None)
    times, copies, sockets, vm_reads = [], [], [], []
    q.put("start")
    ack.wait(60)
    cpu = copy_cpu = socket_cpu = 0.0
    for _ in range(runs):
        cpu0 = _cpu_seconds()
        copies.append(memcpy_seconds(source, mine if inplace else None))
        copy_cpu += _cpu_seconds() - cpu0
        cpu0 = _cpu_seconds()
        sockets.append(socket_seconds(source, mine if inplace else None))
        socket_cpu += _cpu_seconds() - cpu0
        vm_read = vm_read_seconds(*sender, source, mine if inplace else None)
        if vm_read is not None:
            vm_reads.append(vm_read)
        cpu0 = _cpu_seconds()
        t0 = time.perf_counter()
        got = tr.recv_checkpoint(0, url, 17, TIMEOUT)
        times.append(time.perf_counter() - t0)
        cpu += _cpu_seconds() - cpu0
        del got
    q.put((times, copies, sockets, vm_reads if len(vm_reads) == runs else None, cpu, copy_cpu, socket_cpu))
    ack.wait(60)  # the verification below is not measured
    expected = make_state(size, ntensors)
    got = tr.recv_checkpoint(0, url, 17, TIMEOUT)
    ok = all(torch.equal(got["model"][k], v) for k, v in expected["model"].items())
    tr.shutdown()
    q.put(ok)


def bench_http(size: int, ntensors: int, chunks: int | None, runs: int) -> list[str]:
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    sender = ctx.Process(target=_http_sender, args=(q, stop, size, ntensors, chunks), daemon=True)
    sender.start()
    lines = []
    if chunks is None:
        from ftlaunch.checkpointing.http_transport import default_num_chunks

        label = f"auto ({default_num_chunks()})"
    else:
        label = str(chunks)
    try:
        url, prep, sender_pid, regions = q.get(timeout=120)
        nbytes = _state_nbytes(make_state(size, ntensors))
        lines.append(f"  send_checkpoint (encode + checksums, no copy): {prep * 1e3:.1f} ms")
        for inplace in (False, True):
            rq, go = ctx.Queue(), ctx.Event()
            args = (rq, go, url, (sender_pid, regions), size, ntensors, chunks, runs, inplace)
            recv = ctx.Process(target=_http_receiver, args=args, daemon=True)
            with _environ({} if inplace else FRESH_MEMORY_ENV):  # read by the child's malloc at start
                recv.start()
            rq.get(timeout=120)
            sender_cpu0 = sum(psutil.Process(sender.pid).cpu_times()[:2])
            go.set()
            times, copies, sockets, vm_reads, recv_cpu, copy_cpu, socket_cpu = rq.get(timeout=600)
            sender_cpu = sum(psutil.Process(sender.pid).cpu_times()[:2]) - sender_cpu0
            go.set()
            ok = rq.get(timeout=600)
            recv.join(60)
            gb = nbytes * runs / 1e9
            mode = "in-place" if inplace else "fresh"
            lines += _rates_line(f"HTTP {mode:8s} chunks={label}", nbytes, times, copies, sockets, vm_reads)
            lines.append(f"      data ok={ok} | torchft's HTTP transport: {TORCHFT_HTTP_GBPS} GB/s")
            if not inplace:
                lines.append(
                    "      (new memory every run, as in a restarted process, for both; the first run "
                    "is a new process's)"
                )
            lines.append(
                f"      CPU per GB (user+system, all threads): receiver {recv_cpu / gb * 1e3:.0f} ms, "
                f"sender {sender_cpu / gb * 1e3:.0f} ms (both ends {(recv_cpu + sender_cpu) / gb * 1e3:.0f} "
                f"ms); memcpy {copy_cpu / gb * 1e3:.0f} ms; the loopback connection, both ends "
                f"{socket_cpu / gb * 1e3:.0f} ms (CPU moves far less with the load than time does)"
            )
    finally:
        stop.set()
        sender.join(30)
        if sender.is_alive():
            sender.kill()
    return lines


def _pg_worker(rank: int, port: int, q: mp.Queue, size: int, ntensors: int, runs: int) -> None:
    import torch
    import torch.distributed as dist

    from ftlaunch.checkpointing import PGTransport

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=TIMEOUT)
    pg = dist.group.WORLD
    cpu = torch.device("cpu")
    if rank == 0:
        state = make_state(size, ntensors)
        tr = PGTransport(pg, TIMEOUT, cpu)
        for _ in range(runs):
            dist.barrier()
            tr.send_checkpoint([1], 17, state, TIMEOUT)
    else:
        mine = make_state(size, ntensors, seed=1)
        source = make_state(size, ntensors, seed=2)
        tr = PGTransport(pg, TIMEOUT, cpu, state_dict=lambda: mine)
        times, copies = [], []
        cpu = 0.0
        for _ in range(runs):
            copies.append(memcpy_seconds(source, mine))
            dist.barrier()
            cpu0 = _cpu_seconds()
            t0 = time.perf_counter()
            got = tr.recv_checkpoint(0, "<pg>", 17, TIMEOUT)
            times.append(time.perf_counter() - t0)
            cpu += _cpu_seconds() - cpu0
        expected = make_state(size, ntensors)
        ok = all(torch.equal(got["model"][k], v) for k, v in expected["model"].items())
        q.put((times, copies, ok, cpu))
    dist.barrier()
    dist.destroy_process_group()


def bench_pg(size: int, ntensors: int, runs: int) -> list[str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_pg_worker, args=(r, port, q, size, ntensors, runs), daemon=True) for r in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        times, copies, ok, cpu = q.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    nbytes = _state_nbytes(make_state(size, ntensors))
    gb = nbytes * runs / 1e9
    return [
        *_rates_line("PG (gloo) in-place", nbytes, times, copies),
        f"      data ok={ok} | receiver CPU per GB (user+system, all threads): {cpu / gb * 1e3:.0f} ms",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=256, help="state dict size in MiB (default 256)")
    ap.add_argument("--tensors", type=int, default=64, help="number of large tensors (default 64)")
    ap.add_argument(
        "--chunks", type=int, nargs="+", default=[None], help="HTTP num_chunks values to try (default: auto)"
    )
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-pg", action="store_true", help="skip the PGTransport (gloo) comparison")
    args = ap.parse_args()
    size = args.size_mb << 20
    load = os.getloadavg()[0]
    print(
        f"live-recovery transfer of a {args.size_mb} MiB state dict on loopback, {os.cpu_count()} CPUs, "
        f"load average {load:.2f} (other processes share the CPUs: compare each figure with its memcpy)"
    )
    for chunks in args.chunks:
        for line in bench_http(size, args.tensors, chunks, args.runs):
            print(line, flush=True)
    if not args.no_pg:
        for line in bench_pg(size, args.tensors, args.runs):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
