"""``ftlaunch`` end to end with a stand-in training script (tests/workers/worker.py): real supervisor,
agents and workers, real signals. The fault-tolerant training itself (scripts/train_ddp.py) is
covered in test_launcher_e2e.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import xml.etree.ElementTree as ET

import psutil
import pytest
from workers.helpers import FTLAUNCH, WORKER, alive, finish, kill_tree, records, run, start, wait_for

from ftlaunch.lighthouse.server import LighthouseServer

pytestmark = pytest.mark.timeout(120)


def summary_row(stdout: str, group: int) -> list[str]:
    for line in stdout.splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[0] == "[ftlaunch]" and fields[1] == f"rg{group}":
            return fields[2:]
    raise AssertionError(f"no summary row for rg{group} in:\n{stdout}")


def timeline_marks(stdout: str, where: str | None = None) -> list[tuple[str, str, float]]:
    """The marks of the timeline picture the summary names (kind, group, seconds), checked to sit
    in ``where`` when given; else in the temporary log directory of a job that succeeded, alone (the
    worker logs removed), and that directory is removed."""
    m = re.search(r"^\[ftlaunch\] timeline \(steps per group, failures and rejoins\): (\S+)$", stdout, re.M)
    assert m, stdout[-3000:]
    path = m.group(1)
    try:
        assert os.path.basename(path) == "timeline.svg" and (where is None or os.path.dirname(path) == where)
        assert where is not None or os.listdir(os.path.dirname(path)) == ["timeline.svg"]
        root = ET.parse(path).getroot()
    finally:
        if where is None:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    svg = "{http://www.w3.org/2000/svg}"
    assert [p.get("data-line") for p in root.iter(f"{svg}path") if p.get("class") == "series"] == [
        "rg0",
        "rg1",
    ]
    return [
        (g.get("data-kind", ""), g.get("data-line", ""), float(g.get("data-t", "nan")))
        for g in root.iter(f"{svg}g")
        if g.get("data-kind")
    ]


def test_environment_prefixes_and_summary(tmp_path) -> None:
    out = str(tmp_path)
    res = run(
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--nproc-per-node",
            "2",
            WORKER,
            "--out",
            out,
            "--steps",
            "3",
            "--check-torch",
            "--probe-lighthouse",
            "--checksum",
            "c0ffee",
        ],
        timeout=100,
    )
    assert res.returncode == 0, res.stderr
    recs = records(out)
    assert sorted((r["group"], r["rank"]) for r in recs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    lighthouses, tokens, ports = set(), set(), {}
    for r in recs:
        e = r["env"]
        # torchrun's contract inside each group ...
        assert r["is_torchelastic_launched"] is True
        assert e["WORLD_SIZE"] == "2" and e["LOCAL_WORLD_SIZE"] == "2" and e["GROUP_RANK"] == "0"
        assert e["LOCAL_RANK"] == e["RANK"]
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0" and e["TORCHELASTIC_RUN_ID"].endswith(
            f"-rg{r['group']}"
        )
        assert e["MASTER_ADDR"] and e["MASTER_PORT"].isdigit()
        # ... plus ftlaunch's.
        assert e["NUM_REPLICA_GROUPS"] == "2"
        lighthouses.add(e["FTLAUNCH_LIGHTHOUSE"])
        tokens.add(e["FTLAUNCH_TOKEN"])
        ports.setdefault(r["group"], set()).add(e["MASTER_PORT"])
        assert r["lighthouse_status_address"] == e["FTLAUNCH_LIGHTHOUSE"]  # the embedded lighthouse answered
        assert r["lighthouse_token_accepted"] is True  # the job token reached the worker and works
    assert len(lighthouses) == 1 and re.fullmatch(r"http://127\.0\.0\.1:\d+", lighthouses.pop())
    assert len(tokens) == 1 and len(tokens.pop()) >= 16
    assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1]  # each group its own store
    # Every worker line carries its group and rank.
    for g in (0, 1):
        for rank in (0, 1):
            assert f"[rg{g}/r{rank}] step=2 committed=True" in res.stdout
    # Steps come from the lighthouse (rank 0's reports); "last step" is the group's step after its
    # last commit (the Manager's current_step()), so 3 after three steps.
    assert summary_row(res.stdout, 0)[:5] == ["succeeded", "3", "3", "0", "0"]
    assert summary_row(res.stdout, 1)[:5] == ["succeeded", "3", "3", "0", "0"]
    assert "2/2 groups ended bit-identical (c0ffee)" in res.stdout
    assert "timeline" not in res.stdout  # nothing happened: no picture, and the temporary logs are gone


def test_failed_group_restarts_alone_and_lighthouse_is_told(tmp_path) -> None:
    """rg1 crashes once: its agent restarts it, rg0 runs on untouched, the lighthouse hears at once."""
    out = str(tmp_path)
    with LighthouseServer("127.0.0.1:0", token="sekrit", heartbeat_timeout=10).start() as server:
        res = run(
            [
                *FTLAUNCH,
                "--replicas",
                "2",
                "--lighthouse",
                server.address,
                "--token",
                "sekrit",
                WORKER,
                "--out",
                out,
                "--steps",
                "30",
                "--step-time",
                "0.05",
                "--heartbeat",
                "--fail-group",
                "1",
                "--fail-step",
                "3",
                "--exit-code",
                "7",
            ],
            timeout=100,
        )
        history = server.status()["history"]
    assert res.returncode == 0, res.stderr
    recs = records(out)
    assert [(r["rank"], r["restart"]) for r in recs if r["group"] == 0] == [(0, 0)]  # never restarted
    assert sorted((r["rank"], r["restart"]) for r in recs if r["group"] == 1) == [(0, 0), (0, 1)]
    assert "replica group 1: rank 0" in res.stderr and "exited with code 7; lighthouse told" in res.stderr
    failed = [h for h in history if h["replica_id"] == "rg1" and h["event"] == "failed"]
    assert failed and "exited with code 7" in failed[0]["detail"], history
    assert not [h for h in history if h["replica_id"] == "rg0" and h["event"] == "failed"]
    row0, row1 = summary_row(res.stdout, 0), summary_row(res.stdout, 1)
    assert row0[:1] + row0[3:5] == ["succeeded", "0", "0"]
    assert row1[:1] + row1[3:5] == ["succeeded", "1", "1"]


def test_root_cause_and_min_replicas_stop_the_job(tmp_path) -> None:
    """rg1 fails on every attempt: once it is out of restarts, fewer than --min-replicas groups are
    left, so the supervisor stops rg0 (which would run for minutes) and exits 1 with the root cause."""
    res = run(
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--min-replicas",
            "2",
            "--max-restarts",
            "1",
            "--log-dir",
            str(tmp_path),
            WORKER,
            "--steps",
            "100000",
            "--step-time",
            "0.05",
            "--fail-group",
            "1",
            "--fail-step",
            "2",
            "--fail-restarts",
            "all",
            "--raise-error",
        ],
        timeout=100,
    )
    assert res.returncode == 1, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ftlaunch: error: replica group 1 failed: rank 0 (pid ")
    assert "exited with code 1: ValueError: injected failure in rg1/r0 at step 2" in last
    assert "--min-replicas 2" in last
    assert summary_row(res.stdout, 0)[0] == "stopped"
    assert summary_row(res.stdout, 1)[:1] + summary_row(res.stdout, 1)[3:5] == ["failed", "2", "1"]
    assert f"[ftlaunch] logs kept in {tmp_path}" in res.stdout
    marks = timeline_marks(res.stdout, where=str(tmp_path))  # next to the logs of the --log-dir
    # Both attempts failed (the restart may commit step 1 first: a rejoin between), then for good.
    assert [(kind, line) for kind, line, _ in marks if kind != "rejoin"] == [
        ("failure", "rg1"),
        ("failure", "rg1"),
        ("gave_up", "rg1"),
    ], marks
    assert marks[-1][0] == "gave_up"


def test_chaos_kills_groups_and_training_finishes(tmp_path) -> None:
    out = str(tmp_path)
    res = run(
        # Each incarnation trains 10 s on its own (this stand-in worker does not heal): long enough
        # for three kills, each waiting for the last victim to step again, and the chaos stops once
        # a group finished.
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--max-restarts",
            "6",
            "--chaos",
            "every=0.7,count=3,seed=3",
            WORKER,
            "--out",
            out,
            "--steps",
            "200",
            "--step-time",
            "0.05",
            "--checksum",
            "same",
        ],
        timeout=100,
    )
    assert res.returncode == 0, res.stderr
    injected = re.findall(r"chaos: SIGKILL -> replica group (\d) workers \(pids (\d+)\)", res.stderr)
    assert len(injected) == 3, res.stderr
    killed_pids = {int(pid) for _, pid in injected}
    recs = records(out)
    assert killed_pids <= {r["pid"] for r in recs}  # the victims were real workers
    for g in (0, 1):
        hits = sum(1 for grp, _ in injected if int(grp) == g)
        row = summary_row(res.stdout, g)
        assert row[0] == "succeeded" and row[3:5] == [str(hits), str(hits)], (g, row)
        assert (
            len([r for r in recs if r["group"] == g]) == hits + 1
        )  # one incarnation per kill, plus the first
    assert "[ftlaunch] chaos: 3 injection(s)" in res.stdout
    assert res.stdout.count("group committed again") == 3
    assert "training finished despite 3 failure(s)" in res.stdout
    assert "2/2 groups ended bit-identical (same)" in res.stdout
    # The picture, kept after a successful run (its temporary logs removed): each kill on its
    # victim's line at the time the summary says, then that victim's rejoin.
    told = re.findall(
        r"t=(\d+\.\d)s SIGKILL rg(\d) workers at step \d+: group committed again (\d+\.\d)s", res.stdout
    )
    marks = timeline_marks(res.stdout)
    assert len(told) == 3 and sorted(kind for kind, _, _ in marks) == ["failure"] * 3 + ["rejoin"] * 3, marks
    for at, group, after in told:
        assert any(
            k == "failure" and line == f"rg{group}" and abs(t - float(at)) <= 0.06 for k, line, t in marks
        )
        back = float(at) + float(after)
        assert any(k == "rejoin" and line == f"rg{group}" and abs(t - back) <= 0.11 for k, line, t in marks)


def test_dead_agent_is_respawned_and_its_workers_killed(tmp_path) -> None:
    out = str(tmp_path)
    proc = start(
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--chaos",
            "every=0.5,count=1,group=1,target=agent",
            WORKER,
            "--out",
            out,
            "--steps",
            "80",
            "--step-time",
            "0.05",
        ]
    )
    res = finish(proc, timeout=100)
    assert res.returncode == 0, res.stderr
    assert "chaos: SIGKILL -> replica group 1 agent" in res.stderr
    assert "replica group 1: agent killed by SIGKILL; respawning it (1/3)" in res.stderr
    g1 = [r for r in records(out) if r["group"] == 1]
    assert len(g1) == 2  # the orphaned first worker, and the one the respawned agent started
    assert len({r["env"]["MASTER_PORT"] for r in g1}) == 2  # a fresh agent, with a fresh store
    assert not any(alive(r["pid"]) for r in g1)
    row = summary_row(res.stdout, 1)
    assert row[0] == "succeeded" and row[3:5] == ["1", "1"]
    assert summary_row(res.stdout, 0)[3:5] == ["0", "0"]
    assert [(kind, line) for kind, line, _ in timeline_marks(res.stdout)] == [
        ("agent", "rg1"),
        ("rejoin", "rg1"),
    ]


def test_sigstop_chaos_pauses_a_group_then_it_continues(tmp_path) -> None:
    res = run(
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--chaos",
            "steps=5,group=0,signal=STOP,stop_for=1",
            WORKER,
            "--steps",
            "40",
            "--step-time",
            "0.05",
        ],
        timeout=100,
    )
    assert res.returncode == 0, res.stderr
    assert re.search(r"chaos: SIGSTOP -> replica group 0 workers \(pids \d+\) at step \d+", res.stderr)
    m = re.search(r"SIGSTOP rg0 workers at step \d+: group committed again (\d+\.\d)s later", res.stdout)
    assert m and float(m.group(1)) >= 1.0, res.stdout  # it really was paused for stop_for
    assert summary_row(res.stdout, 0)[:5] == ["succeeded", "40", "40", "0", "0"]
    marks = timeline_marks(res.stdout)
    assert [(kind, line) for kind, line, _ in marks] == [("hang", "rg0"), ("rejoin", "rg0")]
    assert marks[1][2] - marks[0][2] >= 1.0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_everything(tmp_path, sig: int) -> None:
    """SIGTERM/SIGINT to the launcher: every group and worker is gone, exit 128+N. (The autouse
    fixture also fails the test if any process of this session survives.) With SIGINT one group is
    SIGSTOPped by chaos at that moment: stopped workers must die too."""
    out = str(tmp_path)
    chaos = ["--chaos", "steps=20,group=1,signal=STOP,stop_for=100"] if sig == signal.SIGINT else []
    proc = start(
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--nproc-per-node",
            "2",
            "--grace-period",
            "5",
            *chaos,
            "--log-dir",
            str(tmp_path / "logs"),
            WORKER,
            "--out",
            out,
            "--steps",
            "100000",
            "--step-time",
            "0.05",
        ]
    )
    try:
        wait_for(lambda: len(_workers(proc.pid)) == 4, timeout=60, what="all 4 workers to start")
        if chaos:
            wait_for(lambda: any(status == "stopped" for _, status in _workers(proc.pid)), 30, "the SIGSTOP")
        pids = [p.pid for p in _descendants(proc.pid)]
        proc.send_signal(sig)
        res = finish(proc, timeout=60)
    finally:
        kill_tree(proc.pid)
    assert res.returncode == 128 + sig, res.stderr
    assert res.stderr.strip().splitlines()[-1] == f"ftlaunch: error: stopped by {signal.Signals(sig).name}"
    assert len(pids) >= 6 and not [pid for pid in pids if alive(pid)]  # 2 agents + 4 workers, all gone
    assert summary_row(res.stdout, 0)[0] == "stopped" and summary_row(res.stdout, 1)[0] == "stopped"


def _workers(pid: int) -> list[tuple[int, str]]:
    """(pid, status) of the test workers under ``pid``."""
    found = []
    for p in _descendants(pid):
        try:
            if "worker.py" in " ".join(p.cmdline()):
                found.append((p.pid, p.status()))
        except psutil.Error:
            continue
    return found


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


@pytest.mark.parametrize("mode", ["--run-path", "-m", "--no-python"])
def test_torchrun_entrypoint_modes(tmp_path, mode: str) -> None:
    out = str(tmp_path)
    if mode == "--no-python":
        target = [sys.executable, WORKER]  # any program: here the interpreter itself
    elif mode == "-m":
        target = ["worker"]
    else:
        target = [WORKER]
    res = run(
        [*FTLAUNCH, "--replicas", "1", mode, *target, "--out", out, "--steps", "2"],
        timeout=60,
        cwd=os.path.dirname(WORKER),
    )
    assert res.returncode == 0, res.stderr
    assert "[rg0/r0] step=1 committed=True" in res.stdout
    assert [r["group"] for r in records(out)] == [0]


def test_console_script_installed() -> None:
    exe = shutil.which("ftlaunch")
    assert exe is not None, "the ftlaunch console script is not installed (pip install -e .)"
    res = run([exe, "--help"], timeout=30)
    assert res.returncode == 0 and "usage: ftlaunch" in res.stdout
