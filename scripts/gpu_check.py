#!/usr/bin/env python3
"""What a CPU cannot prove: ftlaunch on one GPU, end to end, within a time budget (default 480 s).

Run from the repository root (nothing is downloaded; the package need not be installed, the
checkout is used)::

    python scripts/gpu_check.py                  # every check; CPU mode where there is no CUDA
    python scripts/gpu_check.py --cpu            # CPU mode (Gloo / Baby Gloo), as CI runs it
    python scripts/gpu_check.py --only ddp,hsdp  # a subset (--list names them)

Each check prints one line -- PASS, FAIL or SKIP, its figure and its seconds -- and a FAIL prints
the end of its log; a summary closes the run, and the exit status is 1 when a check failed. Every
process the script starts carries a marker in its environment and is ended after its check, also
when the check or the whole budget times out.

**One GPU, several NCCL ranks.** NCCL refuses two ranks of one communicator on the same device
("Duplicate GPU detected"), which is what two replica groups on one GPU are: the cross-group Baby
NCCL communicator puts rank r of every group on it, and a group of two workers puts both on it.
NCCL tells devices apart by (host, bus id), and takes the host from ``NCCL_HOSTID`` when set, so
every process here gets a host id of its own (`share_gpu`) and talks to the others over NCCL's
socket transport on loopback (``NCCL_SOCKET_IFNAME=lo``; no InfiniBand, no NVLink/P2P between
"hosts"). That is why 2 groups x 2 workers can run FT-HSDP with FSDP2 on one GPU; the processes
time-slice the GPU, so step times are latency-bound and are only compared with plain torch DDP
run the same way (torchrun, NCCL, the same host ids).

In CPU mode (``--cpu``, automatic without CUDA) every check that can runs the same code paths with
Gloo / Baby Gloo and smaller sizes; the CUDA-only ones are SKIP with their reason, and a part that
ran on CPU still FAILs when it is wrong. ``tests/scripts/test_gpu_check.py`` runs CPU mode in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import re
import runpy
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
if str(REPO) not in sys.path:  # the checkout's ftlaunch, installed or not
    sys.path.insert(1, str(REPO))

from ftlaunch import env, phases  # noqa: E402 - torch-free; after the path fix above

#: Every process of a run carries ``MARKER=<run id>`` in its environment; cleanup ends them all.
MARKER = "GPU_CHECK_RUN"
#: "1": give each process its own NCCL host id (`share_gpu`); set by the driver in GPU mode.
SHARE_GPU = "GPU_CHECK_SHARE_GPU"
#: Prefix of the one-line JSON results the workers print.
RESULT = "GPUCHECK"
TRAIN_DDP = REPO / "scripts" / "train_ddp.py"
TRAIN_HSDP = REPO / "scripts" / "train_hsdp.py"
TRAIN_DILOCO = REPO / "scripts" / "train_diloco.py"
#: Device memory a run may leave above what it found (MiB): a leaked CUDA context is 300+ MiB.
MEMORY_TOLERANCE_MIB = 128


# ============================================================================ shared by both sides
def share_gpu() -> None:
    """A host id of its own for this process's NCCL communicators (see the module docstring).
    NCCL reads it once per process, at its first communicator: call before any. Baby children
    inherit it; a worker and its own Baby child never share a communicator."""
    if os.environ.get(SHARE_GPU) == "1":
        os.environ["NCCL_HOSTID"] = f"ftlaunch-gpu-check-{os.getpid()}"


def emit(**fields: Any) -> None:
    print(f"{RESULT} {json.dumps(fields, sort_keys=True)}", flush=True)


RESULT_LINE = re.compile(rf"^(?:\[rg(\d+)/r(\d+)\] )?{RESULT} (\{{.*\}})\s*$", re.M)


def results_in(text: str) -> list[dict[str, Any]]:
    """The JSON results workers printed (launcher-prefixed or not), with ``_group``/``_rank`` from
    the ``[rgG/rR]`` prefix when there is one."""
    out = []
    for g, r, body in RESULT_LINE.findall(text):
        try:
            rec = json.loads(body)
        except ValueError:
            continue
        if g:
            rec["_group"], rec["_rank"] = int(g), int(r)
        out.append(rec)
    return out


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (from /proc, no psutil needed)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _proc_stat(int(name))
            if stat is not None and stat[0] not in ("Z", "X"):
                children.setdefault(int(stat[1]), []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def marked_pids(run_id: str) -> list[int]:
    """Live processes whose environment carries this run's marker (never this process)."""
    needle = f"{MARKER}={run_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
        except OSError:
            continue
        if alive(int(name)):
            found.append(int(name))
    return found


def describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    return f"{pid}:{cmd[:100]}"


def cuda_traces(pid: int) -> dict[str, Any]:
    """Whether ``pid`` loaded the CUDA driver library and how many NVIDIA device files it holds
    open (both appear at CUDA's initialisation, not at ``import torch``)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            libcuda = any("libcuda.so" in line for line in f)
    except OSError:
        libcuda = None
    fds = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/nvidia"):
                    fds += 1
    except OSError:
        fds = -1
    return {"libcuda": libcuda, "nvidia_fds": fds}


def _gpu_index() -> tuple[str, str]:
    """How NVML / nvidia-smi name the first GPU CUDA sees: ("index", "0") or ("uuid", "GPU-...")."""
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    return ("index", first) if first.isdigit() else ("uuid", first)


def gpu_memory() -> tuple[int, dict[int, int | None]] | None:
    """(MiB in use on the first visible GPU, {pid: its MiB or None} of the compute processes on it),
    from NVML (``pynvml``) or else ``nvidia-smi``; None where neither answers. Needs no CUDA context."""
    kind, which = _gpu_index()
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = (
                pynvml.nvmlDeviceGetHandleByIndex(int(which))
                if kind == "index"
                else pynvml.nvmlDeviceGetHandleByUUID(which)
            )
            used = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used) // 2**20
            procs = {
                int(p.pid): (int(p.usedGpuMemory) // 2**20 if p.usedGpuMemory else None)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            }
            return used, procs
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no pynvml or no NVML here: try the command line tool
        pass
    try:
        q = ["nvidia-smi", "-i", which, "--format=csv,noheader,nounits"]
        used_out = subprocess.run(
            [*q, "--query-gpu=memory.used"], capture_output=True, text=True, timeout=15, check=True
        ).stdout
        apps_out = subprocess.run(
            [*q, "--query-compute-apps=pid,used_memory"],
            capture_output=True,
            text=True,
            timeout=15,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    procs: dict[int, int | None] = {}
    for line in apps_out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            procs[int(parts[0])] = int(parts[1]) if parts[1].isdigit() else None
    try:
        return int(used_out.strip().splitlines()[0]), procs
    except (ValueError, IndexError):
        return None


def compute_mode() -> str | None:
    """The first visible GPU's compute mode ("Default", "Exclusive_Process", ...), None if unknown."""
    _, which = _gpu_index()
    try:
        out = subprocess.run(
            ["nvidia-smi", "-i", which, "--query-gpu=compute_mode", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out else None


def settled_memory(target: int, seconds: float) -> tuple[int, dict[int, int | None]] | None:
    """`gpu_memory`, polled up to ``seconds`` until its use is at most ``target`` MiB (a context
    being torn down frees its memory a moment after its process is gone)."""
    end = time.monotonic() + seconds
    while True:
        state = gpu_memory()
        if state is None or state[0] <= target or time.monotonic() >= end:
            return state
        time.sleep(0.25)


# ============================================================================ worker side
# Each runs in a process of its own (started by the driver, by torchrun or by the ftlaunch
# launcher) and prints one RESULT line. torch is imported here, never in the driver.
def worker_env() -> int:
    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda": torch.cuda.is_available(),
        "cpus": os.cpu_count(),
    }
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info.update(
            devices=torch.cuda.device_count(),
            name=props.name,
            total_mib=props.total_memory // 2**20,
            capability=list(torch.cuda.get_device_capability(0)),
        )
        try:
            import torch.distributed as dist

            version = torch.cuda.nccl.version() if dist.is_nccl_available() else None
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
        except Exception as e:  # noqa: BLE001 - reported, the NCCL checks then fail on their own
            info["nccl"] = f"unknown ({e})"
    # Everything below needs ftlaunch's worker side to import with this torch.
    try:
        import ftlaunch.process_group
        import ftlaunch.worker.entry
        import ftlaunch.worker.hsdp  # noqa: F401 - FSDP2 and DTensor
    except Exception as e:  # noqa: BLE001 - the verdict of the env check
        info["ftlaunch_error"] = f"{type(e).__name__}: {e}"[:400]
    emit(worker="env", **info)
    return 0


def worker_nccl_pair(rank: int, port: int, numel: int) -> int:
    """Two plain torch NCCL ranks on GPU 0 (no ftlaunch): does this machine allow the sharing at all?"""
    share_gpu()
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    x = torch.full((numel,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    ok = bool((x == 3.0).all().item())
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    emit(worker="nccl-pair", rank=rank, ok=ok, ms=statistics.median(times) * 1e3)
    return 0


def _store_barrier(store: Any, name: str, world: int, timeout: float = 120.0) -> None:
    store.add(name, 1)
    end = time.monotonic() + timeout
    while int(store.add(name, 0)) < world:
        if time.monotonic() > end:
            raise TimeoutError(f"barrier {name!r}: the peer did not arrive within {timeout:.0f} s")
        time.sleep(0.01)


def worker_baby(rank: int, port: int, reconfigs: int, numel: int, backend: str) -> int:
    """A Baby process group (rank ``rank`` of 2) created, reconfigured ``reconfigs`` times (an
    allreduce checked after each), a configure that waits for an absent peer aborted, reconfigured
    after the abort, shut down; then: no child process left and, on a GPU, no memory."""
    share_gpu()
    import torch
    import torch.distributed as dist

    from ftlaunch.errors import CommunicationError
    from ftlaunch.process_group import ProcessGroupBabyGloo, ProcessGroupBabyNCCL

    gpu = backend == "nccl"
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(0)
        torch.zeros(1, device=dev)  # this process's own context exists before the baseline
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
    _store_barrier(store, "start", 2)
    baseline = gpu_memory() if gpu and rank == 0 else None
    out: dict[str, Any] = {"worker": "baby", "rank": rank, "backend": backend}
    pg = (ProcessGroupBabyNCCL if gpu else ProcessGroupBabyGloo)(timeout=timedelta(seconds=30))

    def allreduce_ok(value: float) -> bool:
        t = torch.full((numel,), value + rank, device=dev)
        pg.allreduce([t], dist.ReduceOp.SUM).wait()
        if gpu:
            torch.cuda.synchronize()
        return bool((t == 2 * value + 1).all().item())

    configure_s, child_mib, wrong = [], [], 0
    for i in range(reconfigs):
        t0 = time.perf_counter()
        pg.configure(f"127.0.0.1:{port}/gpu-check/{i}", rank, 2)
        configure_s.append(time.perf_counter() - t0)
        wrong += not allreduce_ok(float(i + 1))
        if gpu:
            state = gpu_memory()
            child_mib.append(state[1].get(pg.child_pid or -1) if state else None)
    out.update(configure_s=configure_s, wrong=wrong, child_mib=child_mib)

    # Abort: rank 0 configures alone (its peer never comes), then aborts; the configure must fail
    # at once instead of waiting for its timeout, and the aborted child must be gone.
    if rank == 0:
        failed_at: list[float] = []
        unexpected: list[str] = []

        def lonely() -> None:
            try:
                pg.configure(f"127.0.0.1:{port}/gpu-check/lonely", 0, 2)
                unexpected.append("the configure succeeded without its peer")
            except CommunicationError:
                failed_at.append(time.perf_counter())
            except Exception as e:  # noqa: BLE001 - reported
                unexpected.append(f"{type(e).__name__}: {e}")

        thread = threading.Thread(target=lonely, daemon=True)
        thread.start()
        time.sleep(1.0)
        aborted_child = pg.child_pid
        t_abort = time.perf_counter()
        pg.abort()
        thread.join(timeout=60.0)
        out["abort_to_error_s"] = failed_at[0] - t_abort if failed_at else None
        out["abort_unexpected"] = unexpected or (
            ["the configure still waits 60 s after abort()"] if thread.is_alive() else []
        )
        time.sleep(0.5)
        out["aborted_child_alive"] = aborted_child is not None and alive(aborted_child)
        store.set("aborted", "1")
    else:
        store.wait(["aborted"], timedelta(seconds=120))
    t0 = time.perf_counter()
    pg.configure(f"127.0.0.1:{port}/gpu-check/after-abort", rank, 2)
    out["after_abort_configure_s"] = time.perf_counter() - t0
    out["after_abort_ok"] = allreduce_ok(100.0)

    children = descendants(os.getpid())
    out["children_before_shutdown"] = len(children)
    pg.shutdown()
    end = time.monotonic() + 10.0
    while any(alive(p) for p in children) and time.monotonic() < end:
        time.sleep(0.05)
    out["children_left"] = [describe(p) for p in children if alive(p)]
    _store_barrier(store, "down", 2)
    if baseline is not None:
        after = settled_memory(baseline[0] + MEMORY_TOLERANCE_MIB, 15.0)
        out["memory_baseline_mib"] = baseline[0]
        out["memory_after_mib"] = after[0] if after else None
        out["child_pids_on_gpu"] = sorted(set(after[1]) & set(children)) if after else None
    # Rank 0 hosts the store: it leaves only once rank 1 is done with it.
    if rank == 1:
        store.set("rank1-done", "1")
    else:
        store.wait(["rank1-done"], timedelta(seconds=120))
    emit(**out)
    return 0


def worker_fork_probe() -> int:
    """Run as a worker by ``python -m ftlaunch.bootstrap.prestart`` (through the warm standby when one is
    announced): what was forked before this script ran, and whether CUDA works after it."""
    share_gpu()
    standby = env.FTLAUNCH_WORKER_PID in os.environ  # set in a worker the standby forked
    import torch
    import torch.distributed as dist

    from ftlaunch.bootstrap import prestart

    info: dict[str, Any] = {
        "worker": "fork-probe",
        "standby": standby,
        "cuda_initialized_at_start": torch.cuda.is_initialized(),
        "bad_fork": bool(torch.cuda._is_in_bad_fork()),
    }
    # The Baby child prestart started before the script: NCCL's on a GPU, Gloo's on CPU.
    backend = "nccl" if os.environ.get(env.FTLAUNCH_BACKEND) == "baby-nccl" else "gloo"
    info["baby_child_backend"] = backend
    started = prestart._started.get(backend)
    info["baby_child_forked"] = started is not None and isinstance(started[0], prestart.ForkedChild)
    forked_pid = started[0].pid if started is not None else None
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        try:
            torch.cuda.set_device(0)
            a = torch.randn(512, 512, device=dev)
            info["cuda_ok"] = bool(torch.isfinite(a @ a).all().item())
        except Exception as e:  # noqa: BLE001 - the point of the probe
            info["cuda_ok"] = False
            info["cuda_error"] = f"{type(e).__name__}: {e}"[:300]
    from ftlaunch.process_group import ProcessGroupBabyGloo, ProcessGroupBabyNCCL

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=30))
    if backend == "gloo":
        info["baby_child_adopted"] = forked_pid is not None and pg.child_pid == forked_pid
    pg.configure(f"127.0.0.1:{store.port}/probe/gloo", 0, 1)
    src = torch.arange(8.0, device=dev if info.get("cuda_ok") else "cpu").cpu() * 2
    t = src.clone()
    pg.allreduce([t], dist.ReduceOp.SUM).wait()
    info["baby_gloo_ok"] = bool(torch.equal(t, src))
    info["baby_child_cuda"] = cuda_traces(pg.child_pid) if pg.child_pid else None
    pg.shutdown()
    if info.get("cuda_ok"):
        try:
            pg2 = ProcessGroupBabyNCCL(timeout=timedelta(seconds=60))
            pg2.configure(f"127.0.0.1:{store.port}/probe/nccl", 0, 1)
            if backend == "nccl":  # a Baby NCCL group takes its child at its first configure
                info["baby_child_adopted"] = forked_pid is not None and pg2.child_pid == forked_pid
            x = torch.full((1024,), 3.0, device=dev)
            pg2.allreduce([x], dist.ReduceOp.SUM).wait()
            torch.cuda.synchronize()
            info["baby_nccl_ok"] = bool((x == 3.0).all().item())
            pg2.shutdown()
        except Exception as e:  # noqa: BLE001 - reported
            info["baby_nccl_ok"] = False
            info["baby_nccl_error"] = f"{type(e).__name__}: {e}"[:300]
    emit(**info)
    return 0


def worker_stream(numel: int, iters: int, warm: int) -> int:
    """``Manager.allreduce`` results read on non-default CUDA streams, as the Work's contract
    says: after ``wait()`` on a stream, the result is ready for that stream. Four ways per step:
    ``side`` (produced, reduced, waited for and read on one side stream), ``two`` (reduced on one
    side stream, waited for and read on another), ``quantized`` (as ``two``, with 8-bit codes, which
    a background thread reduces) and ``default`` (all on the default stream, the control). On CPU
    the same calls run with CPU tensors and no streams."""
    share_gpu()
    import torch

    import ftlaunch

    gpu = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(0)
    ft = ftlaunch.init(device=dev, timeout=30.0)
    manager, group, groups = ft.manager, ft.replica_group_id, ft.num_replica_groups
    s1 = torch.cuda.Stream() if gpu else None
    s2 = torch.cuda.Stream() if gpu else None

    def on(stream: Any) -> Any:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    wrong = {"side": 0, "two": 0, "default": 0, "quantized": 0}
    max_err = dict.fromkeys(wrong, 0.0)
    checked = commits = 0
    try:
        for it in range(warm + iters):
            manager.start_quorum()
            value = float((group + 1) * (it + 1))
            got = {}
            with on(s1):
                a = torch.full((numel,), value, device=dev)
                manager.allreduce(a).wait()
                got["side"] = a.clone()  # read on s1 right after wait() on s1
                b = torch.full((numel,), value, device=dev)
                work_b = manager.allreduce(b)
                q = torch.full((numel,), value, device=dev)
                work_q = manager.allreduce(q, should_quantize=8)  # reduced by a background thread
            with on(s2):
                work_b.wait()
                got["two"] = b.clone()  # read on s2 right after wait() on s2
                work_q.wait()
                got["quantized"] = q.clone()
            c = torch.full((numel,), value, device=dev)
            manager.allreduce(c).wait()
            got["default"] = c.clone()
            committed = manager.should_commit()
            commits += committed
            if gpu:
                torch.cuda.synchronize()
            if it >= warm and committed and manager.num_participants() == groups:
                want = (it + 1) * (groups + 1) / 2  # mean of (g + 1)(it + 1) over the groups
                checked += 1
                for k, y in got.items():
                    err = float((y - want).abs().max().item())
                    max_err[k] = max(max_err[k], err)
                    # 8-bit codes of a constant tensor are close, not exact; the others are exact.
                    wrong[k] += err > (0.02 * want if k == "quantized" else 0.0)
    finally:
        ft.shutdown()
    emit(
        worker="stream", group=group, gpu=gpu, checked=checked, commits=commits, wrong=wrong, max_err=max_err
    )
    return 0


def worker_train(argv: list[str]) -> int:
    """Run a training script (``SCRIPT ARGS...``) as this worker, after giving the process its
    NCCL host id and printing what it inherited from the fork that made it (the launcher runs
    workers through ``ftlaunch.bootstrap.prestart``, which hands them to the group's warm standby)."""
    share_gpu()
    import torch

    emit(
        worker="train",
        pid=os.getpid(),
        restart=int(os.environ.get(env.TORCHELASTIC_RESTART_COUNT) or 0),
        standby=env.FTLAUNCH_WORKER_PID in os.environ,
        cuda_initialized_at_start=torch.cuda.is_initialized(),
        bad_fork=bool(torch.cuda._is_in_bad_fork()),
    )
    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")
    return 0


def worker_plain_ddp(argv: list[str]) -> int:
    """Plain torch DDP under torchrun: train_ddp.py's model, data and loop, torch's own DDP and
    process group (NCCL on CUDA, Gloo on CPU), one line per step with the same fields."""
    share_gpu()
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--dataset-size", type=int, default=4096)
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(TRAIN_DDP.parent))
    import train_ddp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpu = args.device == "cuda"
    if gpu:
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if gpu else "gloo", timeout=timedelta(seconds=60))
    model = train_ddp.make_model(args.width).to(dev)
    ddp = DistributedDataParallel(model, device_ids=[dev.index] if gpu else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    dataset = train_ddp.make_dataset(args.dataset_size)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    loss_fn = nn.MSELoss()
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for _idx, x, y in loader:
            if step >= args.steps:
                break
            x, y = x.to(dev), y.to(dev)
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            step += 1
            print(
                f"plain rank={rank} step={step} loss={loss.item():.5f} "
                f"ms={(time.perf_counter() - t0) * 1e3:.1f} t={time.time():.4f}",
                flush=True,
            )
        epoch += 1
    dist.destroy_process_group()
    return 0


def worker_main(argv: list[str]) -> int:
    kind, rest = argv[0], argv[1:]
    # A worker still running at its check's deadline is asked for its threads' stacks (SIGUSR1,
    # `dump_stacks`) before it is ended: where it waited is in the log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    emit(worker="pid", kind=kind, pid=os.getpid())
    if kind == "env":
        return worker_env()
    if kind == "nccl-pair":
        return worker_nccl_pair(int(rest[0]), int(rest[1]), int(rest[2]))
    if kind == "baby":
        return worker_baby(int(rest[0]), int(rest[1]), int(rest[2]), int(rest[3]), rest[4])
    if kind == "fork-probe":
        return worker_fork_probe()
    if kind == "stream":
        return worker_stream(int(rest[0]), int(rest[1]), int(rest[2]))
    if kind == "train":
        return worker_train(rest)
    if kind == "plain-ddp":
        return worker_plain_ddp(rest)
    raise SystemExit(f"gpu_check.py: unknown worker {kind!r}")


# ============================================================================ driver side
@dataclass(frozen=True)
class Sizes:
    """What each check runs, per mode: full on a GPU, small on CPU (CI's 2 loaded cores)."""

    nccl_numel: int
    baby_reconfigs: int
    baby_numel: int
    stream_numel: int
    stream_iters: int
    ddp_width: int
    ddp_batch: int
    ddp_steps: int
    ddp_kill_at: int
    hsdp_workers: int
    hsdp_args: tuple[str, ...]
    hsdp_steps: int
    hsdp_kill_at: int
    #: train_diloco.py's arguments for the `diloco` check (inner steps; a sync every so many), the
    #: sync (the Manager's step) group 1 is killed at.
    diloco_args: tuple[str, ...]
    diloco_steps: int
    diloco_kill_at: int
    #: train_ddp.py over the HTTP transport: steps, the step of the kill, the MLP's width.
    http_steps: int
    http_kill_at: int
    http_width: int
    #: LocalSGD (train_diloco.py) with durable checkpoints: its arguments, inner steps, the sync
    #: interval and the checkpoint interval (in syncs, the Manager's steps).
    durable_args: tuple[str, ...]
    durable_steps: int
    durable_sync: int
    durable_every: int
    #: Steps skipped at the start of a step-time median (warm-up: allocator, NCCL, first quorums).
    warm_steps: int


GPU_SIZES = Sizes(
    nccl_numel=4 << 20,
    baby_reconfigs=20,
    baby_numel=1 << 20,
    stream_numel=32 << 20,  # 128 MiB: an allreduce long enough for a missing stream order to show
    stream_iters=4,
    ddp_width=1024,
    ddp_batch=64,
    ddp_steps=200,
    ddp_kill_at=80,
    hsdp_workers=2,
    hsdp_args=("--d-model", "256", "--layers", "4", "--heads", "4", "--seq-len", "128", "--batch-size", "8"),
    hsdp_steps=40,
    hsdp_kill_at=15,
    diloco_args=("--width", "512", "--batch-size", "64", "--sync-every", "10", "--step-sleep", "0.01"),
    diloco_steps=160,
    diloco_kill_at=6,
    http_steps=60,
    http_kill_at=25,
    http_width=1024,
    durable_args=("--width", "512", "--batch-size", "64", "--step-sleep", "0.1"),
    durable_steps=48,
    durable_sync=4,
    durable_every=2,
    warm_steps=10,
)
CPU_SIZES = Sizes(
    nccl_numel=0,
    baby_reconfigs=20,
    baby_numel=4096,
    stream_numel=1 << 16,
    stream_iters=2,
    ddp_width=64,
    ddp_batch=32,
    ddp_steps=50,
    ddp_kill_at=20,
    hsdp_workers=2,
    hsdp_args=("--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch-size", "2"),
    hsdp_steps=10,
    hsdp_kill_at=4,
    diloco_args=("--width", "64", "--batch-size", "16", "--sync-every", "6", "--step-sleep", "0.01"),
    diloco_steps=60,
    diloco_kill_at=4,
    http_steps=30,
    http_kill_at=12,
    http_width=64,
    durable_args=("--width", "64", "--batch-size", "16", "--step-sleep", "0.1"),
    durable_steps=40,
    durable_sync=4,
    durable_every=2,
    warm_steps=5,
)


class CheckFailed(Exception):
    """A check's verdict: FAIL, with this reason."""


class CheckTimeout(CheckFailed):
    """A check ran past its deadline (its processes were ended); ``text``: what the process that
    was waited for had printed."""

    def __init__(self, message: str, text: str = "") -> None:
        super().__init__(message)
        self.text = text


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL, SKIP
    figure: str
    seconds: float = 0.0
    log: Path | None = None


class Proc:
    """A process a check started: its output is read line by line, kept in memory for the check
    to parse, and written to the check's log with the seconds since the check began."""

    def __init__(self, popen: subprocess.Popen[bytes], log: Any, lock: threading.Lock, t0: float) -> None:
        self.popen = popen
        self.pid = popen.pid
        self._lines: list[str] = []
        self._done = threading.Event()
        self._log, self._lock, self._t0 = log, lock, t0
        threading.Thread(target=self._pump, name=f"gpu-check-out-{popen.pid}", daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        try:
            for raw in iter(self.popen.stdout.readline, b""):
                line = raw.decode(errors="replace")
                self._lines.append(line)
                with self._lock:
                    self._log.write(f"{time.monotonic() - self._t0:8.2f} {line}")
                    self._log.flush()
        except (OSError, ValueError):
            pass
        finally:
            self._done.set()

    def text(self) -> str:
        """What it printed so far; once it has exited, up to 2 s for the rest (a process it left
        running may hold its output open: that one is ended by the check's cleanup)."""
        if self.popen.poll() is not None:
            self._done.wait(2.0)
        return "".join(self._lines)

    def poll(self) -> int | None:
        return self.popen.poll()


@dataclass
class Ctx:
    """What a check works with: mode, sizes, the deadline, its log, the processes it starts."""

    gpu: bool
    sizes: Sizes
    tmp: Path
    run_id: str
    base_env: dict[str, str]
    info: dict[str, Any] = field(default_factory=dict)
    deadline: float = 0.0
    log: Path | None = None
    started: list[Proc] = field(default_factory=list)
    _log_file: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _t0: float = 0.0

    def begin(self, log: Path, deadline: float) -> None:
        self.log, self.deadline, self.started, self._t0 = log, deadline, [], time.monotonic()

    def end(self) -> None:
        with self._lock:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def _file(self) -> Any:
        """The check's log, opened at its first line (a check that runs nothing leaves no file)."""
        if self._log_file is None:
            assert self.log is not None
            self._log_file = open(self.log, "a")  # noqa: SIM115 - closed by `end`
        return self._log_file

    def note(self, text: str) -> None:
        with self._lock:
            f = self._file()
            f.write(text if text.endswith("\n") else text + "\n")
            f.flush()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def start(self, cmd: list[str], extra_env: dict[str, str] | None = None) -> Proc:
        """Start ``cmd`` in a session of its own (its output: see `Proc`)."""
        env_ = dict(self.base_env)
        env_.update(extra_env or {})
        shown = " ".join(f"{k}={v}" for k, v in (extra_env or {}).items())
        self.note(f"\n{time.monotonic() - self._t0:8.2f} $ {shown + ' ' if shown else ''}{shlex.join(cmd)}")
        popen = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env_,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proc = Proc(popen, self._file(), self._lock, self._t0)
        self.started.append(proc)
        return proc

    def wait(self, proc: Proc, what: str) -> int:
        """``proc``'s exit code; at the check's deadline every process of the run is ended."""
        try:
            rc = proc.popen.wait(timeout=max(0.1, self.left()))
        except subprocess.TimeoutExpired:
            dump_stacks(self.started)
            end_processes(self.run_id, self.started, grace=8.0)
            raise CheckTimeout(f"{what} still running at the check's deadline", proc.text()) from None
        self.note(f"{time.monotonic() - self._t0:8.2f} [exit code {rc}]")
        return rc

    def run(self, cmd: list[str], what: str, extra_env: dict[str, str] | None = None) -> tuple[int, str]:
        """Run ``cmd`` to its end: (exit code, what it printed)."""
        proc = self.start(cmd, extra_env)
        rc = self.wait(proc, what)
        return rc, proc.text()

    def python(self, *args: str) -> list[str]:
        return [sys.executable, "-u", str(HERE), *args]

    def worker(self, *args: str) -> list[str]:
        """This script as an ftlaunch worker runs: through ``ftlaunch.bootstrap.prestart``, which forks the
        Baby Gloo child (and a spare) before the script where Baby Gloo is the default (CPU)."""
        return [sys.executable, "-u", "-m", "ftlaunch.bootstrap.prestart", str(HERE), *args]

    def launcher(self, *args: str) -> list[str]:
        """The real ``ftlaunch`` command (this checkout's, as ``python -m``)."""
        return [sys.executable, "-m", "ftlaunch.launcher.cli", "--no-status", "--grace-period", "5", *args]


def dump_stacks(started: list[Proc], seconds: float = 2.0) -> None:
    """Have every worker of these processes that is still alive print its Python threads' stacks
    (they registered faulthandler on SIGUSR1), and give the output a moment to reach the log."""
    pids = {r["pid"] for p in started for r in results_in(p.text()) if r.get("worker") == "pid"}
    sent = 0
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)
                sent += 1
    if sent:
        time.sleep(seconds)


def end_processes(run_id: str, started: list[Proc], grace: float) -> list[str]:
    """End what a check left running: SIGTERM to the sessions it started (the launcher stops its
    groups then), up to ``grace`` seconds for everything marked to exit, then SIGKILL. Returns
    what was still running when the grace ran out."""
    for proc in started:
        if proc.popen.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGTERM)
    end = time.monotonic() + grace
    left = marked_pids(run_id)
    while left and time.monotonic() < end:
        time.sleep(0.1)
        left = marked_pids(run_id)
    described = [describe(p) for p in left]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for proc in started:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            proc.popen.wait(timeout=5.0)
    return described


def _one(results: list[dict[str, Any]], worker: str, **match: Any) -> dict[str, Any]:
    found = [r for r in results if r.get("worker") == worker and all(r.get(k) == v for k, v in match.items())]
    if not found:
        raise CheckFailed(f"no result from the {worker} worker {match or ''}".rstrip())
    return found[-1]


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


# ---------------------------------------------------------------------------------------- checks
def check_env(ctx: Ctx) -> list[Result]:
    info = ctx.info.get("probe")  # the probe that chose the mode, else one run now (--cpu)
    if info is None:
        rc, text = ctx.run(ctx.python("--worker", "env"), "the environment probe")
        if rc != 0:
            raise CheckFailed(f"the environment probe exited {rc}: cannot import torch?")
        info = _one(results_in(text), "env")
    if info.get("ftlaunch_error"):
        raise CheckFailed(f"ftlaunch does not import with torch {info['torch']}: {info['ftlaunch_error']}")
    where = f"torch {info['torch']}, {info['cpus']} CPUs"
    if not ctx.gpu:
        why = ctx.info.get("why", "no CUDA device")
        return [Result("env", "PASS", f"CPU mode ({why}): {where}; Gloo and Baby Gloo")]
    mem = gpu_memory()
    ctx.info["memory_start"] = mem
    used = (
        f", {mem[0]} MiB in use, {len(mem[1])} compute processes"
        if mem
        else ", NVML/nvidia-smi not answering"
    )
    mode = compute_mode()
    if mode is not None and mode != "Default":
        # Exclusive modes admit one process per GPU: every check below needs several.
        raise CheckFailed(f"the GPU's compute mode is {mode}: several processes cannot share it")
    return [
        Result(
            "env",
            "PASS",
            f"{where}; CUDA {info['cuda_build']}, NCCL {info.get('nccl')}; {info['devices']} GPU(s), first: "
            f"{info['name']} (sm_{''.join(map(str, info['capability']))}, {info['total_mib']} MiB{used})",
        )
    ]


def check_nccl_one_gpu(ctx: Ctx) -> list[Result]:
    port = _free_port()
    procs = [
        ctx.start(ctx.python("--worker", "nccl-pair", str(r), str(port), str(ctx.sizes.nccl_numel)))
        for r in range(2)
    ]
    rcs = [ctx.wait(p, f"NCCL rank {r}") for r, p in enumerate(procs)]
    res = results_in("".join(p.text() for p in procs))
    if any(rcs) or len([r for r in res if r.get("worker") == "nccl-pair"]) < 2:
        raise CheckFailed(
            f"two NCCL ranks on one GPU, each with its own NCCL_HOSTID, did not work (exit codes {rcs}); "
            "every NCCL check below needs this"
        )
    r0 = _one(res, "nccl-pair", rank=0)
    if not r0["ok"]:
        raise CheckFailed("the allreduce of two NCCL ranks on one GPU gave a wrong sum")
    mib = ctx.sizes.nccl_numel * 4 / 2**20
    return [
        Result(
            "nccl-one-gpu",
            "PASS",
            f"2 plain NCCL ranks on one GPU (a host id each, sockets on loopback): allreduce of "
            f"{mib:.0f} MiB {r0['ms']:.1f} ms median",
        )
    ]


def check_baby(ctx: Ctx) -> list[Result]:
    backend = "nccl" if ctx.gpu else "gloo"
    port = _free_port()
    before = ctx.info.get("memory_start")
    procs = [
        ctx.start(
            ctx.worker(
                "--worker",
                "baby",
                str(r),
                str(port),
                str(ctx.sizes.baby_reconfigs),
                str(ctx.sizes.baby_numel),
                backend,
            )
        )
        for r in range(2)
    ]
    rcs = [ctx.wait(p, f"Baby helper rank {r}") for r, p in enumerate(procs)]
    res = results_in("".join(p.text() for p in procs))
    if any(rcs):
        raise CheckFailed(f"a Baby {backend.upper()} helper failed (exit codes {rcs})")
    r0, r1 = _one(res, "baby", rank=0), _one(res, "baby", rank=1)
    problems = []
    n = ctx.sizes.baby_reconfigs
    if r0["wrong"] or r1["wrong"]:
        problems.append(f"{r0['wrong'] + r1['wrong']} wrong allreduce results after reconfigures")
    if r0.get("abort_to_error_s") is None or r0.get("abort_unexpected"):
        problems.append(
            f"abort of a waiting configure: {'; '.join(r0.get('abort_unexpected') or ['no error'])}"
        )
    if r0.get("aborted_child_alive"):
        problems.append("the aborted child is still alive")
    if not (r0["after_abort_ok"] and r1["after_abort_ok"]):
        problems.append("the allreduce after the abort was wrong")
    left = r0["children_left"] + r1["children_left"]
    if left:
        problems.append(f"processes left after shutdown: {left}")
    conf = r0["configure_s"] + r1["configure_s"]
    figure = (
        f"Baby {backend.upper()}: {n} reconfigures x 2 ranks (configure median "
        f"{statistics.median(conf):.2f} s, "
        f"max {max(conf):.2f} s), {2 * n + 2} allreduces checked; abort of a configure waiting for an absent "
        f"peer -> error in {_fmt_s(r0.get('abort_to_error_s'))}, reconfigured after it in "
        f"{_fmt_s(r0['after_abort_configure_s'])}; shutdown: {len(left)} of "
        f"{r0['children_before_shutdown'] + r1['children_before_shutdown']} child processes left"
    )
    if ctx.gpu:
        mib = [m for m in r0["child_mib"] if m is not None]
        if len(mib) >= 2:
            growth = mib[-1] - mib[0]
            figure += f"; child GPU memory {mib[0]} -> {mib[-1]} MiB over {n - 1} reconfigures"
            if growth > MEMORY_TOLERANCE_MIB:
                problems.append(f"the child's GPU memory grew by {growth} MiB over {n - 1} reconfigures")
        else:
            figure += "; child GPU memory: NVML gives no per-process figure"
        base, after = r0.get("memory_baseline_mib"), r0.get("memory_after_mib")
        if base is not None and after is not None:
            figure += f"; device memory after shutdown {after - base:+d} MiB"
            if after - base > MEMORY_TOLERANCE_MIB:
                problems.append(f"{after - base} MiB of GPU memory still in use after shutdown")
        if r0.get("child_pids_on_gpu"):
            problems.append(f"child processes still on the GPU: {r0['child_pids_on_gpu']}")
        after_all = settled_memory(before[0] + MEMORY_TOLERANCE_MIB, 15.0) if before else None
        if before and after_all:
            figure += f", {after_all[0] - before[0]:+d} MiB once the helpers exited"
            if after_all[0] - before[0] > MEMORY_TOLERANCE_MIB:
                problems.append(
                    f"{after_all[0] - before[0]} MiB of GPU memory in use after the helpers exited"
                )
    if problems:
        raise CheckFailed("; ".join(problems) + f" [{figure}]")
    return [Result("baby", "PASS", figure)]


def check_standby(ctx: Ctx) -> list[Result]:
    """The warm standby (ftlaunch.bootstrap.zygote) and prestart's fork, with CUDA used after the forks."""
    sock = ctx.tmp / "standby.sock"
    zygote = ctx.start(
        [sys.executable, "-u", "-m", "ftlaunch.bootstrap.zygote", str(sock), "--parent-pid", str(os.getpid())]
    )
    end = time.monotonic() + min(60.0, ctx.left())
    while not sock.exists():
        if zygote.poll() is not None or time.monotonic() > end:
            raise CheckFailed(f"the standby interpreter did not start (exit code {zygote.poll()})")
        time.sleep(0.05)
    probe = [sys.executable, "-u", "-m", "ftlaunch.bootstrap.prestart", str(HERE), "--worker", "fork-probe"]
    # The backend whose child prestart forks before the script: Baby NCCL on a GPU (the default
    # there), Baby Gloo on CPU; restart count 1: a standby that does not answer is then reported,
    # not silently skipped.
    backend = "baby-nccl" if ctx.gpu else "baby-gloo"
    forced = {env.FTLAUNCH_BACKEND: backend, env.TORCHELASTIC_RESTART_COUNT: "1"}
    rc, text = ctx.run(
        probe, "the probe forked by the standby", {**forced, env.FTLAUNCH_ZYGOTE_SOCKET: str(sock)}
    )
    traces = cuda_traces(zygote.pid)
    zygote.popen.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        zygote.popen.wait(timeout=10.0)
    rc_cold, text_cold = ctx.run(
        probe, "the probe started by prestart alone", {env.FTLAUNCH_BACKEND: backend}
    )
    problems: list[str] = []

    def judge(res: dict[str, Any], rc_: int, where: str, standby: bool) -> None:
        if rc_ != 0:
            problems.append(f"{where}: exit code {rc_}")
        if res.get("standby") != standby:
            problems.append(f"{where}: {'not ' if standby else ''}forked by the standby")
        if res.get("bad_fork"):
            problems.append(
                f"{where}: torch says bad fork (CUDA was initialised in the parent before the fork)"
            )
        if res.get("cuda_initialized_at_start"):
            problems.append(f"{where}: CUDA initialised before the script ran")
        if not res.get("baby_child_forked"):
            problems.append(f"{where}: prestart did not fork the Baby child")
        if not res.get("baby_child_adopted"):
            problems.append(f"{where}: the process group did not adopt the forked Baby child")
        if not res.get("baby_gloo_ok"):
            problems.append(f"{where}: the forked Baby Gloo child gave a wrong allreduce")
        if ctx.gpu and not res.get("cuda_ok"):
            problems.append(f"{where}: CUDA fails after the fork ({res.get('cuda_error', '?')})")
        if ctx.gpu and not res.get("baby_nccl_ok"):
            problems.append(f"{where}: Baby NCCL fails after the fork ({res.get('baby_nccl_error', '?')})")

    try:
        via = _one(results_in(text), "fork-probe")
    except CheckFailed:
        via, problems = {}, [f"the probe forked by the standby printed no result (exit code {rc})"]
    judge(via, rc, "forked by the standby", True)
    try:
        cold = _one(results_in(text_cold), "fork-probe")
    except CheckFailed:
        cold, problems = (
            {},
            [*problems, f"the probe started by prestart printed no result (exit code {rc_cold})"],
        )
    judge(cold, rc_cold, "prestart alone", False)
    standby = (
        f"standby after forking: libcuda {'mapped' if traces['libcuda'] else 'not mapped'}, "
        f"{traces['nvidia_fds']} /dev/nvidia* open"
    )
    if problems:
        raise CheckFailed("; ".join(problems) + f" [{standby}]")
    used = "CUDA and Baby NCCL used after the fork" if ctx.gpu else "no CUDA here: the forks alone"
    child = "NCCL" if ctx.gpu else "Gloo"
    figure = (
        f"a worker forked by the standby and one by prestart alone: torch imported, CUDA untouched at the "
        f"fork (not a bad fork), Baby {child} child forked and adopted; {used}; {standby}"
    )
    return [Result("standby", "PASS", figure)]


def check_stream(ctx: Ctx) -> list[Result]:
    from ftlaunch.lighthouse.server import LighthouseServer

    token = uuid.uuid4().hex
    sizes = ctx.sizes
    warm = 2
    with LighthouseServer(min_replicas=2, join_timeout=60.0, token=token, expected_replicas=2).start() as lh:
        common = {
            env.NUM_REPLICA_GROUPS: "2",
            env.FTLAUNCH_LIGHTHOUSE: lh.address,
            env.FTLAUNCH_TOKEN: token,
        }
        args = ("--worker", "stream", str(sizes.stream_numel), str(sizes.stream_iters), str(warm))
        procs = [ctx.start(ctx.worker(*args), {**common, env.REPLICA_GROUP_ID: str(g)}) for g in range(2)]
        rcs = [ctx.wait(p, f"stream worker of group {g}") for g, p in enumerate(procs)]
    res = results_in("".join(p.text() for p in procs))
    if any(rcs):
        raise CheckFailed(f"a stream worker failed (exit codes {rcs})")
    r = [_one(res, "stream", group=g) for g in range(2)]
    checked = min(x["checked"] for x in r)
    wrong = {k: sum(x["wrong"][k] for x in r) for k in r[0]["wrong"]}
    worst = {k: max(x["max_err"][k] for x in r) for k in r[0]["max_err"]}
    mib = sizes.stream_numel * 4 / 2**20
    figure = (
        f"{checked} steps x 2 groups x 4 allreduces of {mib:g} MiB, results wrong: read on the side stream "
        f"after wait() there {wrong['side']}, waited for and read on a second stream {wrong['two']}, "
        f"8-bit quantized on a second stream {wrong['quantized']}, default stream {wrong['default']} "
        f"(max error {max(worst[k] for k in worst if k != 'quantized'):g}, quantized {worst['quantized']:g})"
    )
    if checked < sizes.stream_iters:
        raise CheckFailed(f"only {checked} steps committed by both groups [{figure}]")
    if any(wrong.values()):
        hint = (
            ": wait() on a non-default stream did not order that stream after the collective"
            if not wrong["default"]
            else ""
        )
        raise CheckFailed(figure + hint)
    if not ctx.gpu:
        return [Result("stream", "SKIP", f"CUDA streams need a GPU; the same calls on CPU tensors: {figure}")]
    return [Result("stream", "PASS", figure)]


STEP_LINE = re.compile(
    r"^\[rg(\d+)/r(\d+)\] step=(\d+) committed=(True|False) participants=(\d+) loss=(\S+)(?:.* t=([\d.]+))?",
    re.M,
)
CHECKSUM_LINE = re.compile(r"^\[rg(\d+)/r(\d+)\] final_checksum=(\w+) step=(\d+)", re.M)
INIT_LINE = re.compile(
    r"^\[rg(\d+)/r(\d+)\] .*ftlaunch\.init: replica group \d+ of \d+, rank \d+ of \d+, "
    r"backend (\S+), transport \S+, device (\S+)",
    re.M,
)
INIT_TRANSPORT = re.compile(r"^\[rg\d+/r\d+\] .*ftlaunch\.init: .*, transport (\S+), device ", re.M)
HEAL_LINE = re.compile(r"^\[rg1/r(\d+)\] .*healing from rg0 at step (\d+)", re.M)
PLAIN_LINE = re.compile(r"^plain rank=0 step=(\d+) loss=\S+ ms=\S+ t=([\d.]+)", re.M)


def step_interval(times: dict[int, float], first: int, last: int) -> float | None:
    """Median seconds between consecutive steps ``first..last`` (both present)."""
    gaps = [times[s] - times[s - 1] for s in range(first + 1, last + 1) if s in times and s - 1 in times]
    return statistics.median(gaps) if gaps else None


def recovery_phases(phase_log: Path, group: int = 1) -> dict[str, float]:
    """Seconds from the chaos kill to each phase of the restarted group (the latest of its ranks:
    the group is back when all of them are), from ``FTLAUNCH_PHASE_LOG``."""
    recs = phases.read(phase_log)
    kills = [r["t"] for r in recs if r["phase"] == "chaos_kill"]
    if not kills:
        return {}
    kill = kills[0]
    per_rank: dict[str, dict[str, float]] = {}
    out: dict[str, float] = {}
    for r in recs:
        if r["t"] < kill or r.get("replica") != str(group):
            continue
        if r["phase"] == "worker_exit_seen" and r.get("failed") and "worker_exit_seen" not in out:
            out["worker_exit_seen"] = r["t"] - kill
        if int(r.get("restart") or 0) >= 1 and r.get("rank") is not None:
            per_rank.setdefault(r["rank"], {}).setdefault(r["phase"], r["t"] - kill)
    for ph in ("zygote_forked", "init", "ready", "quorum", "configured", "healed", "first_commit"):
        vals = [d[ph] for d in per_rank.values() if ph in d]
        if vals:
            out[ph] = max(vals)
    return out


def judge_run(
    gpu: bool, rc: int, text: str, groups: int, workers: int, steps: int, transport: str | None = None
) -> tuple[list[str], dict[str, Any]]:
    """What every launcher run must show, failure or not: clean exit, the expected backend, device
    (and ``transport`` when given), every rank ending at ``steps`` with the same checksum, finite
    losses, and no worker in a bad fork."""
    problems: list[str] = []
    facts: dict[str, Any] = {}
    if rc != 0:
        problems.append(f"the launcher exited {rc}")
    want_backend, want_dev = ("baby-nccl", "cuda") if gpu else ("baby-gloo", "cpu")
    inits = INIT_LINE.findall(text)
    facts["inits"] = len(inits)
    wrong_init = {(b, d) for _, _, b, d in inits if b != want_backend or not d.startswith(want_dev)}
    if not inits:
        problems.append("no worker logged ftlaunch.init")
    if wrong_init:
        problems.append(f"workers used {sorted(wrong_init)}, not {want_backend} on {want_dev}")
    if transport is not None:
        used = sorted(set(INIT_TRANSPORT.findall(text)))
        if used != [transport]:
            problems.append(f"workers used the transport(s) {used}, not {transport}")
    for p in (r for r in results_in(text) if r.get("worker") == "train"):
        if p["bad_fork"] or p["cuda_initialized_at_start"]:
            who = f"rg{p.get('_group')}/r{p.get('_rank')} (restart {p['restart']})"
            problems.append(f"{who} inherited initialised CUDA from the process it was forked from")
    sums = CHECKSUM_LINE.findall(text)
    facts["checksums"] = sorted({c for _, _, c, _ in sums})
    ranks = {(int(g), int(r)) for g, r, _, _ in sums}
    if len(ranks) < groups * workers:
        problems.append(f"final checksums from {len(ranks)} ranks only")
    if len(facts["checksums"]) > 1:
        problems.append(f"ranks ended with different checksums {facts['checksums']}")
    if any(int(s) != steps for _, _, _, s in sums):
        problems.append(f"not every rank ended at step {steps}")
    last_loss = {}
    for g, r, _s, _c, _n, loss, _t in STEP_LINE.findall(text):
        last_loss[(g, r)] = loss
    facts["last_loss"] = last_loss
    if any(not _finite(v) for v in last_loss.values()):
        problems.append(f"non-finite final losses {last_loss}")
    if "Duplicate GPU" in text:
        problems.append("NCCL: Duplicate GPU detected (the per-process NCCL_HOSTID did not take)")
    return problems, facts


def judge_training(
    gpu: bool,
    rc: int,
    text: str,
    groups: int,
    workers: int,
    steps: int,
    kill_at: int,
    transport: str | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """What a launcher run with a SIGKILLed group must show: `judge_run`'s, and both groups stepping
    together, the killed group restarted from the standby and healed."""
    problems, facts = judge_run(gpu, rc, text, groups, workers, steps, transport)
    probes = [r for r in results_in(text) if r.get("worker") == "train"]
    restarted = [p for p in probes if p.get("_group") == 1 and p["restart"] >= 1]
    first = [p for p in probes if p["restart"] == 0]
    # A group's first workers may start before its standby listens (then they start cold, by
    # design); a restarted worker is forked by the standby, which has been up since.
    facts["first_by_standby"] = f"{sum(p['standby'] for p in first)} of {len(first)}"
    if len(first) < groups * workers:
        problems.append(f"{len(first)} first worker starts seen, expected {groups * workers}")
    if len(restarted) < workers:
        problems.append(f"{len(restarted)} restarted worker(s) of group 1 seen, expected {workers}")
    for p in probes:
        if p["restart"] >= 1 and not p["standby"]:
            who = f"rg{p.get('_group')}/r{p.get('_rank')} (restart {p['restart']})"
            problems.append(f"{who} was not forked by the warm standby")
    together = [s for s in STEP_LINE.findall(text) if s[3] == "True" and s[4] == str(groups)]
    facts["steps_together"] = len({int(s[2]) for s in together})
    if not together:
        problems.append(f"no step committed by {groups} groups together")
    heals = [int(s) for _, s in HEAL_LINE.findall(text) if int(s) >= kill_at]
    facts["healed_at"] = min(heals) if heals else None
    if not heals:
        problems.append(f"group 1 did not heal from group 0 after the kill at step {kill_at}")
    return problems, facts


def where_it_stood(text: str, phase_log: Path) -> str:
    """Where a launcher run that did not finish stood: each group's last committed step and how long
    after the kill it was, the restarted workers, the heals after the kill."""
    kills = [r["t"] for r in phases.read(phase_log) if r["phase"] == "chaos_kill"]
    last: dict[str, tuple[int, float | None]] = {}
    for g, _r, step, committed, _n, _loss, t in STEP_LINE.findall(text):
        if committed == "True" and int(step) >= last.get(g, (-1, None))[0]:
            last[g] = (int(step), float(t) if t else None)
    parts = []
    for g in sorted(last):
        step, t = last[g]
        after = f" ({t - kills[0]:+.1f} s from the kill)" if t is not None and kills else ""
        parts.append(f"rg{g} last committed step {step}{after}")
    if not kills:
        parts.append("no kill injected yet")
    restarted = [r for r in results_in(text) if r.get("worker") == "train" and r.get("restart", 0) >= 1]
    parts.append(f"{len(restarted)} restarted worker(s) started")
    parts.append(f"heals logged by rg1: {len(HEAL_LINE.findall(text))}")
    return "; ".join(parts)


def _finite(text: str) -> bool:
    try:
        return abs(float(text)) < float("inf")
    except ValueError:
        return False


def _recovery_result(name: str, where: str, ph: dict[str, float]) -> Result:
    if "first_commit" not in ph:
        return Result(name, "FAIL", f"{where}: no first commit of the restarted group in the phase log")
    steps = ", ".join(
        f"{label} {ph[k]:.2f}"
        for k, label in (
            ("worker_exit_seen", "death seen"),
            ("zygote_forked", "forked"),
            ("init", "ftlaunch.init"),
            ("quorum", "quorum"),
            ("configured", "configured"),
            ("healed", "healed"),
        )
        if k in ph
    )
    return Result(name, "PASS", f"{where}: kill -> first commit {ph['first_commit']:.2f} s ({steps})")


def check_ddp(ctx: Ctx) -> list[Result]:
    s = ctx.sizes
    device = "cuda" if ctx.gpu else "cpu"
    common = [
        "--device", device, "--steps", str(s.ddp_steps), "--width", str(s.ddp_width),
        "--batch-size", str(s.ddp_batch), "--lr", "0.001",
    ]  # fmt: skip
    last = s.ddp_kill_at - 2  # steps before the kill: both groups healthy
    # Plain torch DDP, the same model, data and loop: torchrun, 2 workers, torch's NCCL/Gloo.
    plain_cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
        "--nproc-per-node", "2",
        str(HERE), "--worker", "plain-ddp", *common[:2], "--steps", str(last + 1), *common[4:],
    ]  # fmt: skip
    rc_plain, text_plain = ctx.run(plain_cmd, "plain torch DDP (torchrun)")
    plain_times = {int(a): float(b) for a, b in PLAIN_LINE.findall(text_plain)}
    plain = step_interval(plain_times, s.warm_steps, last) if rc_plain == 0 else None

    phase_log = ctx.tmp / "ddp_phases.jsonl"
    cmd = ctx.launcher(
        "--replicas", "2", "--min-replicas", "2", "--chaos", f"steps={s.ddp_kill_at},group=1",
        str(HERE), "--worker", "train", str(TRAIN_DDP), *common, "--timeout", "30",
    )  # fmt: skip
    try:
        rc, text = ctx.run(cmd, "ftlaunch with train_ddp.py", {env.FTLAUNCH_PHASE_LOG: str(phase_log)})
    except CheckTimeout as e:
        raise CheckTimeout(f"{e}; {where_it_stood(e.text, phase_log)}") from None
    problems, facts = judge_training(ctx.gpu, rc, text, 2, 1, s.ddp_steps, s.ddp_kill_at)
    pg = "Baby NCCL, CUDA tensors on one GPU" if ctx.gpu else "Baby Gloo, CPU"
    figure = (
        f"2 groups x 1 worker ({pg}) through `ftlaunch --replicas 2 --min-replicas 2 --chaos "
        f"steps={s.ddp_kill_at},group=1`: {facts['steps_together']} steps committed by both, rg1 SIGKILLed, "
        f"restarted by the standby, healed at step {facts['healed_at']}, {s.ddp_steps} steps, checksums "
        f"{'/'.join(facts['checksums']) or '-'}; first starts forked by the standby: "
        f"{facts['first_by_standby']}"
    )
    results = [
        Result(
            "ddp",
            "FAIL" if problems else "PASS",
            "; ".join(problems) + f" [{figure}]" if problems else figure,
        )
    ]

    times = {
        int(st): float(t)
        for g, r, st, c, _n, _l, t in STEP_LINE.findall(text)
        if g == "0" and t and c == "True"
    }
    ft = step_interval(times, s.warm_steps, last)
    backend = "Baby NCCL / torch NCCL" if ctx.gpu else "Baby Gloo / torch Gloo"
    if ft is None or plain is None:
        why = f"plain DDP exited {rc_plain}" if plain is None else "no ftlaunch step times"
        results.append(Result("ddp-step-time", "FAIL", f"not measured: {why}"))
    else:
        results.append(
            Result(
                "ddp-step-time",
                "PASS",
                f"ftlaunch {ft * 1e3:.2f} ms / plain torch DDP (torchrun) {plain * 1e3:.2f} ms = "
                f"{ft / plain:.2f} "
                f"({backend}; median step, steps {s.warm_steps}-{last}, MLP 3x{s.ddp_width}, batch "
                f"{s.ddp_batch})",
            )
        )
    results.append(_recovery_result("kill-to-commit", "DDP, 2 groups x 1 worker", recovery_phases(phase_log)))
    return results


def _hsdp_run(ctx: Ctx, workers: int, name: str) -> list[Result]:
    s = ctx.sizes
    phase_log = ctx.tmp / f"{name}_phases.jsonl"
    device = "cuda" if ctx.gpu else "cpu"
    cmd = ctx.launcher(
        "--replicas", "2", "--nproc-per-node", str(workers), "--min-replicas", "2",
        "--chaos", f"steps={s.hsdp_kill_at},group=1",
        str(HERE), "--worker", "train", str(TRAIN_HSDP), "--device", device, "--mixed-precision", "bf16",
        "--steps", str(s.hsdp_steps), *s.hsdp_args, "--timeout", "30",
    )  # fmt: skip
    try:
        rc, text = ctx.run(
            cmd,
            f"ftlaunch with train_hsdp.py, {workers} worker(s) per group",
            {env.FTLAUNCH_PHASE_LOG: str(phase_log)},
        )
    except CheckTimeout as e:
        raise CheckTimeout(f"{e}; {where_it_stood(e.text, phase_log)}") from None
    problems, facts = judge_training(ctx.gpu, rc, text, 2, workers, s.hsdp_steps, s.hsdp_kill_at)
    if "fault-tolerant HSDP:" not in text:
        problems.append("no worker logged its fault-tolerant HSDP layout (ft.wrap did not see FSDP2)")
    pg = (
        "Baby NCCL across groups, NCCL inside, one GPU" if ctx.gpu else "Baby Gloo across groups, Gloo inside"
    )
    figure = (
        f"FSDP2 bf16, 2 groups x {workers} worker(s) ({pg}), rg1 SIGKILLed at step {s.hsdp_kill_at}: "
        f"{facts['steps_together']} steps by both, healed at step {facts['healed_at']}, all ranks ended at "
        f"step {s.hsdp_steps} with checksums {'/'.join(facts['checksums']) or '-'}"
    )
    ph = recovery_phases(phase_log)
    recovery = (
        f"kill -> first commit {ph['first_commit']:.2f} s" if "first_commit" in ph else "no first commit"
    )
    figure += f"; {recovery}"
    return [
        Result(
            name, "FAIL" if problems else "PASS", "; ".join(problems) + f" [{figure}]" if problems else figure
        )
    ]


def check_hsdp(ctx: Ctx) -> list[Result]:
    workers = ctx.sizes.hsdp_workers
    results = _hsdp_run(ctx, workers, "hsdp")
    if results[0].status == "FAIL" and ctx.gpu and workers > 1 and ctx.left() > 90:
        # Which part failed: the same with one worker per group (no intra-group NCCL; fully_shard
        # over a one-rank mesh still wraps the model and routes its gradients through ftlaunch).
        end_processes(ctx.run_id, ctx.started, grace=8.0)
        results += _hsdp_run(ctx, 1, "hsdp-1-worker")
    return results


SYNC_LINE = re.compile(
    r"^\[rg(\d+)/r\d+\] step=(\d+) committed=True participants=2 .* syncs=\d+ global=(\w+) outer=(\w+)", re.M
)


def check_diloco(ctx: Ctx) -> list[Result]:
    s = ctx.sizes
    phase_log = ctx.tmp / "diloco_phases.jsonl"
    device = "cuda" if ctx.gpu else "cpu"
    cmd = ctx.launcher(
        "--replicas", "2", "--min-replicas", "2", "--chaos", f"steps={s.diloco_kill_at},group=1",
        str(HERE), "--worker", "train", str(TRAIN_DILOCO), "--device", device, "--algorithm", "diloco",
        "--steps", str(s.diloco_steps), *s.diloco_args, "--timeout", "30",
    )  # fmt: skip
    try:
        rc, text = ctx.run(cmd, "ftlaunch with train_diloco.py", {env.FTLAUNCH_PHASE_LOG: str(phase_log)})
    except CheckTimeout as e:
        raise CheckTimeout(f"{e}; {where_it_stood(e.text, phase_log)}") from None
    problems, facts = judge_training(ctx.gpu, rc, text, 2, 1, s.diloco_steps, s.diloco_kill_at)
    # At every sync both groups committed, they hold the same global parameters and outer
    # optimizer state (the healed group too, from its first sync after the heal).
    states: dict[int, set[tuple[str, str]]] = {}
    for _g, step, glob, outer in SYNC_LINE.findall(text):
        states.setdefault(int(step), set()).add((glob, outer))
    differ = sorted(step for step, st in states.items() if len(st) > 1)
    if not states:
        problems.append("no sync line with the global state committed by both groups")
    if differ:
        problems.append(f"the groups' global or outer state differed after the syncs of steps {differ[:5]}")
    ph = recovery_phases(phase_log)
    pg = "Baby NCCL, CUDA parameters on one GPU" if ctx.gpu else "Baby Gloo, CPU"
    figure = (
        f"DiLoCo, 2 groups x 1 worker ({pg}) through `ftlaunch --replicas 2 --min-replicas 2 --chaos "
        f"steps={s.diloco_kill_at},group=1`: {facts['steps_together']} syncs committed by both, global and "
        f"outer state identical at {len(states) - len(differ)} of {len(states)}; rg1 SIGKILLed, restarted by "
        f"the standby, healed at sync {facts['healed_at']}, {s.diloco_steps} inner steps, checksums "
        f"{'/'.join(facts['checksums']) or '-'}; "
        + (f"kill -> first commit {ph['first_commit']:.2f} s" if "first_commit" in ph else "no first commit")
    )
    return [Result("diloco", "FAIL" if problems else "PASS", _verdict(problems, figure))]


def _verdict(problems: list[str], figure: str) -> str:
    return "; ".join(problems) + f" [{figure}]" if problems else figure


def check_http(ctx: Ctx) -> list[Result]:
    s = ctx.sizes
    phase_log = ctx.tmp / "http_phases.jsonl"
    device = "cuda" if ctx.gpu else "cpu"
    cmd = ctx.launcher(
        "--replicas", "2", "--min-replicas", "2", "--chaos", f"steps={s.http_kill_at},group=1",
        str(HERE), "--worker", "train", str(TRAIN_DDP), "--device", device, "--transport", "http",
        "--steps", str(s.http_steps), "--width", str(s.http_width), "--batch-size", str(s.ddp_batch),
        "--lr", "0.001", "--timeout", "30",
    )  # fmt: skip
    try:
        rc, text = ctx.run(
            cmd, "ftlaunch with train_ddp.py --transport http", {env.FTLAUNCH_PHASE_LOG: str(phase_log)}
        )
    except CheckTimeout as e:
        raise CheckTimeout(f"{e}; {where_it_stood(e.text, phase_log)}") from None
    problems, facts = judge_training(ctx.gpu, rc, text, 2, 1, s.http_steps, s.http_kill_at, transport="http")
    ph = recovery_phases(phase_log)
    heal = (
        f", the heal {ph['healed'] - ph['configured']:.2f} s" if "healed" in ph and "configured" in ph else ""
    )
    pg = "CUDA state, Baby NCCL" if ctx.gpu else "CPU state, Baby Gloo"
    figure = (
        f"DDP, 2 groups x 1 worker ({pg}), live recovery over HTTP, MLP 3x{s.http_width}: rg1 SIGKILLed at "
        f"step {s.http_kill_at}, restarted by the standby, healed at step {facts['healed_at']}, "
        f"{facts['steps_together']} steps by both, {s.http_steps} steps, checksums "
        f"{'/'.join(facts['checksums']) or '-'}; "
        + (
            f"kill -> first commit {ph['first_commit']:.2f} s{heal}"
            if "first_commit" in ph
            else "no first commit"
        )
    )
    return [Result("http", "FAIL" if problems else "PASS", _verdict(problems, figure))]


CKPT_NAME = re.compile(r"^step-(\d+)$")  # a complete durable checkpoint (`.tmp` while written)
RESUMED_LINE = re.compile(r"resumed from durable checkpoint (\S+) \(step (\d+)\)")


def complete_checkpoints(directory: Path) -> list[int]:
    """Steps of the complete durable checkpoints in ``directory`` (ascending), from their names."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(m[1]) for n in names if (m := CKPT_NAME.match(n)))


def kill_job(pid: int) -> int:
    """SIGKILL ``pid`` and everything under it at once, as when the job's node is lost: stopped
    first (nothing forks, exits or is reaped meanwhile), then killed. Returns how many."""
    pids = [pid, *descendants(pid)]
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGSTOP)
    pids = list(dict.fromkeys([*pids, *descendants(pid)]))  # forked before the stop reached them
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    return len(pids)


def check_durable(ctx: Ctx) -> list[Result]:
    """LocalSGD with durable checkpoints: the whole job SIGKILLed after a checkpoint, the same
    command run again resumes from it and ends bit-identical to a run that was never interrupted
    (started beside the first; deterministic data)."""
    s = ctx.sizes
    device = "cuda" if ctx.gpu else "cpu"
    ckpt = ctx.tmp / "durable_ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)

    def command(durable: bool) -> list[str]:
        every = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(s.durable_every)] if durable else []
        return ctx.launcher(
            "--replicas", "2", "--min-replicas", "2", *every,
            str(HERE), "--worker", "train", str(TRAIN_DILOCO), "--device", device, "--algorithm", "local_sgd",
            "--steps", str(s.durable_steps), "--sync-every", str(s.durable_sync), *s.durable_args,
            "--timeout", "30",
        )  # fmt: skip

    reference = ctx.start(command(False))
    job = ctx.start(command(True))

    def saved_after() -> int | None:
        """The oldest checkpoint on disk that both groups also saved their own state of, once a
        step after it committed (the kill then loses trained steps: the resume must neither repeat
        nor skip one). Not the newest: a checkpoint of step S appears after the sync of inner step
        (S - 1) x sync, and the next one is due by the time the step after S x sync commits."""
        done = complete_checkpoints(ckpt)
        both = [c for c in done if all(c in complete_checkpoints(ckpt / f"group-{g}") for g in (0, 1))]
        steps = [int(m[2]) for m in STEP_LINE.findall(job.text()) if m[3] == "True"]
        if both and steps and max(steps) > both[0] * s.durable_sync:
            return both[0]
        return None

    saved = None
    while saved is None and job.poll() is None:
        if ctx.left() <= 0:
            dump_stacks(ctx.started)
            end_processes(ctx.run_id, ctx.started, grace=8.0)
            raise CheckTimeout("no durable checkpoint with a step after it by the deadline", job.text())
        saved = saved_after()
        time.sleep(0.1)
    if saved is None:
        raise CheckFailed(
            f"the job ended (exit {job.poll()}) before a durable checkpoint and a step after it"
        )
    killed = kill_job(job.pid)
    ctx.note(f"[gpu_check] SIGKILLed the whole job: {killed} processes, after the checkpoint of step {saved}")
    ctx.wait(job, "the killed job")
    first_text = job.text()
    if CHECKSUM_LINE.search(first_text):
        raise CheckFailed("the job ended before the kill (a final checksum was printed)")
    newest = complete_checkpoints(ckpt)[-1]

    rc, text = ctx.run(command(True), "the resumed job")
    rc_ref = ctx.wait(reference, "the uninterrupted job")
    problems, facts = judge_run(ctx.gpu, rc, text, 2, 1, s.durable_steps)
    ref_problems, ref = judge_run(ctx.gpu, rc_ref, reference.text(), 2, 1, s.durable_steps)
    problems += [f"uninterrupted run: {p}" for p in ref_problems]
    resumed = sorted({int(m[2]) for m in RESUMED_LINE.finditer(text)})
    if not resumed:
        problems.append("no group logged that it resumed from a durable checkpoint")
    elif resumed != [newest]:
        problems.append(f"resumed from the checkpoint(s) of steps {resumed}, not the newest, {newest}")
    firsts = [int(m[2]) for m in STEP_LINE.findall(text) if m[3] == "True"]
    # A checkpoint of the Manager's step S is taken right after the sync that committed it: the
    # job's (S - 1)st sync, whose line counts (S - 1) x sync inner steps; the next line is S x sync.
    want_first = newest * s.durable_sync
    if firsts and min(firsts) != want_first:
        problems.append(f"the resumed job's first sync was at inner step {min(firsts)}, not {want_first}")
    if facts["checksums"] and ref["checksums"] and facts["checksums"] != ref["checksums"]:
        problems.append(
            f"the resumed job ended with {'/'.join(facts['checksums'])}, the uninterrupted one with "
            f"{'/'.join(ref['checksums'])}"
        )
    losses = "/".join(sorted(set(facts["last_loss"].values()))) or "-"
    pg = "CUDA state, Baby NCCL" if ctx.gpu else "CPU state, Baby Gloo"
    figure = (
        f"LocalSGD, 2 groups x 1 worker ({pg}), `--checkpoint-every {s.durable_every}` (syncs of "
        f"{s.durable_sync} steps): whole job SIGKILLed ({killed} processes) with the checkpoint of step "
        f"{newest} on disk; the same command resumed from step {'/'.join(map(str, resumed)) or '-'}, "
        f"first sync at inner step {min(firsts) if firsts else '-'}, ended at {s.durable_steps} with "
        f"checksums {'/'.join(facts['checksums']) or '-'} "
        f"(uninterrupted run: {'/'.join(ref['checksums']) or '-'}), "
        f"last losses {losses}"
    )
    return [Result("durable", "FAIL" if problems else "PASS", _verdict(problems, figure))]


def check_gpu_clean(ctx: Ctx) -> list[Result]:
    before = ctx.info.get("memory_start")
    if before is None:
        return [Result("gpu-clean", "SKIP", "NVML and nvidia-smi did not answer at the start")]
    after = settled_memory(before[0] + MEMORY_TOLERANCE_MIB, min(20.0, ctx.left()))
    if after is None:
        raise CheckFailed("NVML and nvidia-smi stopped answering")
    new = sorted(set(after[1]) - set(before[1]))
    figure = (
        f"{after[0] - before[0]:+d} MiB of GPU memory against the start, compute processes "
        f"{len(before[1])} -> {len(after[1])}"
    )
    if after[0] - before[0] > MEMORY_TOLERANCE_MIB or new:
        raise CheckFailed(figure + (f"; still on the GPU: {[describe(p) for p in new]}" if new else ""))
    return [Result("gpu-clean", "PASS", figure)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Check:
    name: str
    what: str
    run: Callable[[Ctx], list[Result]]
    gpu_timeout: float
    cpu_timeout: float
    #: Why it cannot run without CUDA ("": it runs on CPU too).
    cuda_only: str = ""
    #: Names of the results it may report (besides its own).
    also: tuple[str, ...] = ()


CHECKS = (
    Check(
        "env", "torch, CUDA, NCCL and the GPU; the GPU memory in use before anything runs", check_env, 60, 60
    ),
    Check(
        "nccl-one-gpu",
        "two plain NCCL ranks share the one GPU (own host ids, sockets on loopback): the ground "
        "every NCCL check stands on",
        check_nccl_one_gpu,
        90,
        0,
        cuda_only="NCCL needs CUDA",
    ),
    Check(
        "baby",
        "a Baby NCCL group created, reconfigured 20 times, a waiting configure aborted, shut down: "
        "no process, no GPU memory left",
        check_baby,
        150,
        90,
    ),
    Check(
        "standby",
        "workers forked by the warm standby and by prestart find CUDA untouched and can use it (and "
        "Baby NCCL)",
        check_standby,
        120,
        90,
    ),
    Check(
        "stream",
        "Manager.allreduce results are right when read on non-default CUDA streams after wait()",
        check_stream,
        120,
        90,
    ),
    Check(
        "ddp",
        "2 groups share the GPU through Baby NCCL via `ftlaunch`; a SIGKILLed group heals bit-identical; "
        "step time / plain DDP; kill -> first commit",
        check_ddp,
        180,
        150,
        also=("ddp-step-time", "kill-to-commit"),
    ),
    Check(
        "hsdp",
        "FT-HSDP with FSDP2 in bf16, 2 groups x 2 workers on the GPU via `ftlaunch`, a SIGKILLed "
        "group heals its shards",
        check_hsdp,
        180,
        150,
        also=("hsdp-1-worker",),
    ),
    Check(
        "diloco",
        "DiLoCo with CUDA parameters, 2 groups via `ftlaunch`; a SIGKILLed group heals and every sync's "
        "global and outer state agree",
        check_diloco,
        90,
        150,
    ),
    Check(
        "http",
        "live recovery over the HTTP transport with CUDA state: DDP, 2 groups via `ftlaunch`, a "
        "SIGKILLed group heals bit-identical",
        check_http,
        90,
        150,
    ),
    Check(
        "durable",
        "LocalSGD with durable checkpoints of CUDA state: the whole job SIGKILLed, the same command "
        "resumes and ends bit-identical to an uninterrupted run",
        check_durable,
        120,
        200,
    ),
    Check(
        "gpu-clean",
        "nothing of the run is left on the GPU: no compute process, memory back to the start",
        check_gpu_clean,
        30,
        0,
        cuda_only="no GPU",
    ),
)


# ---------------------------------------------------------------------------------------- driver
def _print(line: str) -> None:
    print(line, flush=True)


def _tail(path: Path | None, lines: int = 20) -> str:
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(f"    | {x[:220]}" for x in text)


def run_checks(
    args: argparse.Namespace,
    started: float,
    gpu: bool,
    why: str,
    probe: dict[str, Any] | None,
    run_id: str,
    log_dir: Path,
    tmp: Path,
    results: list[Result],
) -> None:
    """Run the selected checks in order, appending to ``results`` (kept when interrupted)."""
    # The budget counts from the script's start (the probe that chose the mode included); a few
    # seconds stay for ending what a check cut short left running, and for the summary.
    budget_end = started + args.budget - 15.0
    base_env = dict(os.environ)
    base_env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x)
    base_env[MARKER] = run_id
    base_env["PYTHONUNBUFFERED"] = "1"
    base_env.setdefault("OMP_NUM_THREADS", "1")
    if gpu:
        base_env[SHARE_GPU] = "1"
        base_env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        base_env.setdefault("NCCL_IB_DISABLE", "1")
        base_env.setdefault("NCCL_NET", "Socket")  # not a network plugin the image may carry
        base_env.setdefault("NCCL_DEBUG", "WARN")
    else:
        base_env["CUDA_VISIBLE_DEVICES"] = ""  # CPU mode on a GPU machine: nothing sees the GPU
    ctx = Ctx(gpu, GPU_SIZES if gpu else CPU_SIZES, tmp, run_id, base_env)
    ctx.info["why"], ctx.info["probe"] = why, probe
    only = set(args.only.split(",")) if args.only else None
    for check in CHECKS:
        if only is not None and check.name not in only and check.name not in ("env", "gpu-clean"):
            continue
        if check.cuda_only and not gpu:
            results.append(Result(check.name, "SKIP", f"CUDA only ({check.cuda_only})"))
            _report(results[-1])
            continue
        timeout = args.check_timeout or (check.gpu_timeout if gpu else check.cpu_timeout)
        left_s = budget_end - 2.0 - time.monotonic()
        if left_s < min(20.0, timeout):  # not enough left to run it
            results.append(Result(check.name, "SKIP", f"out of budget ({max(0.0, left_s):.0f} s left)"))
            _report(results[-1])
            continue
        t0 = time.monotonic()
        ctx.begin(log_dir / f"{check.name}.log", min(t0 + timeout, budget_end - 2.0))
        try:
            got = check.run(ctx)
        except CheckTimeout as e:
            got = [Result(check.name, "FAIL", f"timed out after {time.monotonic() - t0:.0f} s: {e}")]
        except CheckFailed as e:
            got = [Result(check.name, "FAIL", str(e))]
        except Exception as e:  # noqa: BLE001 - a bug in a check is a FAIL with its traceback, not a crash
            ctx.note(traceback.format_exc())
            got = [Result(check.name, "FAIL", f"{type(e).__name__}: {e}")]
        left = end_processes(run_id, ctx.started, grace=10.0)
        ctx.end()
        if left:
            got[0] = Result(
                got[0].name, "FAIL", f"left {len(left)} process(es) behind: {left[:4]}; " + got[0].figure
            )
        seconds = time.monotonic() - t0
        for r in got:
            r.seconds, r.log = seconds, ctx.log
            results.append(r)
            _report(r)


def _report(r: Result) -> None:
    _print(f"{r.status:<4}  {r.name:<15} {r.figure}  ({r.seconds:.1f} s)")
    if r.status == "FAIL" and r.log is not None:
        tail = _tail(r.log)
        if tail:
            _print(f"    last lines of {r.log}:\n{tail}")


def detect_gpu(args: argparse.Namespace) -> tuple[bool, str, dict[str, Any] | None]:
    """(GPU mode, why, what the probe found), from a probe in a process of its own (the driver
    never imports torch)."""
    if args.cpu:
        return False, "--cpu", None
    try:
        out = subprocess.run(
            [sys.executable, str(HERE), "--worker", "env"],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(
                os.environ,
                PYTHONPATH=os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x),
            ),
        )
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"the probe failed: {e}", None
    info = next((r for r in results_in(out.stdout) if r.get("worker") == "env"), None)
    if info is None:
        return False, f"the probe printed nothing (exit {out.returncode}): {out.stderr.strip()[-300:]}", None
    return bool(info.get("cuda")), "CUDA available" if info.get("cuda") else "no CUDA device", info


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return worker_main(argv[1:])
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Checks, in order: " + "; ".join(f"{c.name}: {c.what}" for c in CHECKS),
    )
    ap.add_argument(
        "--cpu", action="store_true", help="CPU mode (Gloo / Baby Gloo) even where CUDA is available"
    )
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run (default 480)")
    ap.add_argument(
        "--check-timeout", type=float, default=None, help="seconds per check (default: each check's own)"
    )
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated checks to run (env and gpu-clean always run): see --list",
    )
    ap.add_argument("--list", action="store_true", help="list the checks and exit")
    ap.add_argument(
        "--log-dir",
        default=None,
        help="keep every check's log here (default: a temporary directory, kept on failure)",
    )
    args = ap.parse_args(argv)
    if args.list:
        for c in CHECKS:
            also = f" (also reports {', '.join(c.also)})" if c.also else ""
            cuda = f" [CUDA only: {c.cuda_only}]" if c.cuda_only else ""
            _print(f"{c.name:<14} {c.what}{also}{cuda}")
        return 0
    if args.only:
        unknown = set(args.only.split(",")) - {c.name for c in CHECKS}
        if unknown:
            ap.error(f"unknown check(s) {sorted(unknown)}; --list names them")
    if args.budget <= 0:
        ap.error("--budget must be > 0")
    t0 = time.monotonic()
    gpu, why, probe = detect_gpu(args)
    run_id = uuid.uuid4().hex
    tmp_root = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    log_dir = Path(args.log_dir).resolve() if args.log_dir else tmp_root / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    _print(
        f"[gpu_check] {'GPU' if gpu else 'CPU'} mode ({why}); budget {args.budget:.0f} s; logs in {log_dir}"
    )

    def _stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _stop)
    results: list[Result] = []
    interrupted = False
    try:
        run_checks(args, t0, gpu, why, probe, run_id, log_dir, tmp_root, results)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        left = end_processes(run_id, [], grace=5.0)
        if left:
            _print(f"[gpu_check] ended {len(left)} leftover process(es): {left[:4]}")
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    if results:  # one short line at the very end, whatever scrolled away above
        _print("[gpu_check] " + ", ".join(f"{r.status} {r.name}" for r in results))
    failed = counts["FAIL"] > 0 or interrupted
    _print(
        f"[gpu_check] summary: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
        f"in {time.monotonic() - t0:.1f} s (budget {args.budget:.0f} s, {'GPU' if gpu else 'CPU'} mode)"
        + (" -- interrupted" if interrupted else "")
    )
    if failed or args.log_dir:
        _print(f"[gpu_check] logs kept in {log_dir}")
    if args.log_dir or not failed:  # without --log-dir, a failed run's logs are in tmp_root
        _rmtree(tmp_root)
    return 1 if failed else 0


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
