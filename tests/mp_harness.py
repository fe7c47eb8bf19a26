"""Helpers for multi-process tests: replica groups as real subprocesses with real kills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from workers.helpers import kill_tree

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "workers" / "manager_worker.py"


class Group:
    """One replica group of ``nworkers`` worker processes; the test plays torchelastic's agent
    (hosts the group's store, restarts the whole group with a new attempt number)."""

    def __init__(
        self,
        gid: int,
        nworkers: int,
        lighthouse: str,
        tmp: Path,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.gid = gid
        self.nworkers = nworkers
        self.lighthouse = lighthouse
        self.tmp = tmp
        self.args = list(args or [])
        self.extra_env = dict(env or {})
        self.attempt = 0
        self.procs: list[subprocess.Popen[bytes]] = []
        self.store: dist.TCPStore | None = None

    def out(self, rank: int = 0) -> Path:
        return self.tmp / f"rg{self.gid}_r{rank}.jsonl"

    def start(self, extra_args: list[str] | None = None) -> None:
        self.procs = []
        if self.nworkers > 1:
            # A fresh store per attempt, as ftlaunch's rendezvous hosts one per round (torch's
            # gloo rendezvous does not prefix its keys per restart attempt).
            self.store = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
            )
        for rank in range(self.nworkers):
            env = dict(os.environ)
            env.update(self.extra_env)
            env.update(
                {
                    "REPLICA_GROUP_ID": str(self.gid),
                    "FTLAUNCH_LIGHTHOUSE": self.lighthouse,
                    "TORCHELASTIC_RESTART_COUNT": str(self.attempt),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(self.nworkers),
                }
            )
            if self.store is not None:
                env.update(
                    {
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(self.store.port),
                        "TORCHELASTIC_USE_AGENT_STORE": "True",
                    }
                )
            else:
                for k in ("MASTER_ADDR", "MASTER_PORT"):
                    env.pop(k, None)
            log = open(self.tmp / f"rg{self.gid}_r{rank}_a{self.attempt}.log", "wb")
            cmd = [sys.executable, str(WORKER), "--out", str(self.out(rank)), *self.args, *(extra_args or [])]
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))

    def restart(self, extra_args: list[str] | None = None) -> None:
        self.attempt += 1
        self.start(extra_args)

    def kill(self, sig: int = signal.SIGKILL) -> float:
        t = time.time()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)
        for p in self.procs:
            p.wait(timeout=30)
        return t

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"group rg{self.gid} did not finish in {timeout}s: {self.log_tail()}"
                ) from None
        return codes

    def log_tail(self, n: int = 3000) -> str:
        parts = []
        for rank in range(self.nworkers):
            f = self.tmp / f"rg{self.gid}_r{rank}_a{self.attempt}.log"
            if f.exists():
                parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-n:]}")
        return "\n".join(parts)

    def records(self, rank: int = 0) -> list[dict[str, Any]]:
        f = self.out(rank)
        if not f.exists():
            return []
        return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]

    def steps(self, rank: int = 0) -> list[dict[str, Any]]:
        return [r for r in self.records(rank) if "checksum" in r and not r.get("final")]

    def final(self, rank: int = 0) -> dict[str, Any] | None:
        finals = [r for r in self.records(rank) if r.get("final")]
        return finals[-1] if finals else None

    def wait_for_step(self, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r["after"] >= step for r in self.steps()):
                return
            if all(p.poll() is not None for p in self.procs):
                raise AssertionError(f"rg{self.gid} exited before step {step}: {self.log_tail()}")
            time.sleep(0.05)
        raise AssertionError(f"rg{self.gid} did not reach step {step} in {timeout}s: {self.log_tail()}")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                kill_tree(p.pid)
        self.store = None
