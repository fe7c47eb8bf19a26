"""What ``ftlaunch`` records for the picture it writes at exit (ftlaunch.launcher.timeline), fed by
hand in one process: the supervisor's clock is an argument."""

from __future__ import annotations

from ftlaunch.launcher.chaos import Injection
from ftlaunch.launcher.group import Group
from ftlaunch.launcher.timeline import JobTimeline, keep_timeline
from ftlaunch.lighthouse.timeline import (
    AGENT,
    FAILURE,
    GAVE_UP,
    HANG,
    HEALTH,
    LIGHTHOUSE,
    REJOIN,
    SLOW,
    STRAGGLER,
    TAKEOVER,
)


def groups(n: int) -> list[Group]:
    return [Group(g) for g in range(n)]


def kinds(tl: JobTimeline) -> list[tuple[float, str, str | None]]:
    return [(m.at, m.kind, m.line) for m in tl.timeline(200.0, "t", "").marks]


def test_steps_are_sampled_per_group_from_the_first_committed_step() -> None:
    tl = JobTimeline(started=100.0)
    a, b = groups(2)
    tl.sample(100.5, [a, b])  # nothing committed yet: no line
    a.last_step = 3
    tl.sample(101.0, [a, b])
    a.last_step, b.last_step = 8, 7
    tl.sample(102.0, [a, b])
    pic = tl.timeline(103.0, "title", "sub")
    assert [(line.name, line.points) for line in pic.lines] == [
        ("rg0", ((1.0, 3), (2.0, 8))),
        ("rg1", ((2.0, 7),)),
    ]
    assert (pic.title, pic.subtitle, pic.end) == ("title", "sub", 3.0)


def test_a_chaos_kill_is_one_mark_with_the_failure_it_causes() -> None:
    tl = JobTimeline(started=0.0)
    tl.injected(Injection(10.0, 1, "SIGKILL", "workers", 42))
    tl.failed(1, 10.01, "rank 0 (pid 7) killed by SIGKILL")  # the agent's report of the same death
    tl.failed(1, 12.0, "workers of restart 1 failed")  # its restart died too: another failure
    tl.recovered(1, 15.0, REJOIN)
    assert kinds(tl) == [(10.0, FAILURE, "rg1"), (12.0, FAILURE, "rg1"), (15.0, REJOIN, "rg1")]
    assert tl.timeline(20.0, "", "").marks[0].detail == "chaos: SIGKILL to its workers at step 42"
    assert tl.failures == 2


def test_hangs_agent_kills_and_failing_for_good() -> None:
    tl = JobTimeline(started=0.0)
    tl.injected(Injection(5.0, 0, "SIGSTOP", "workers", None))
    tl.failed(0, 5.02, "rank 0 (pid 9) stopped by SIGSTOP", HANG)  # the agent saw the stop: same
    tl.recovered(0, 8.0, REJOIN)
    tl.injected(Injection(20.0, 1, "SIGKILL", "agent", 50))
    tl.failed(1, 20.1, "agent killed by SIGKILL", AGENT)
    tl.failed(1, 30.0, "replica group 1 failed: no restarts left", GAVE_UP)  # never absorbed
    tl.failed(0, 40.0, "rank 0 (pid 11) stopped by SIGSTOP", HANG)  # no chaos: its own mark
    assert kinds(tl) == [
        (5.0, HANG, "rg0"),
        (8.0, REJOIN, "rg0"),
        (20.0, AGENT, "rg1"),
        (30.0, GAVE_UP, "rg1"),
        (40.0, HANG, "rg0"),
    ]


def test_a_spare_taking_over_ends_the_failed_groups_down_time() -> None:
    tl = JobTimeline(started=0.0)
    tl.failed(1, 3.0, "rank 0 exited with code 1")
    tl.recovered(1, 4.5, TAKEOVER, "rg2, a hot spare, took its slot")
    assert kinds(tl) == [(3.0, FAILURE, "rg1"), (4.5, TAKEOVER, "rg1")]


def test_the_lighthouse_down_is_a_span_and_still_down_at_the_end_says_so() -> None:
    tl = JobTimeline(started=100.0)
    tl.lighthouse_down(110.0)
    tl.lighthouse_back(122.0)
    tl.lighthouse_back(150.0)  # restarted after it stopped on its own: a span of no width
    tl.lighthouse_down(160.0)
    spans = [(m.at, m.until, m.kind) for m in tl.timeline(170.0, "", "").marks]
    assert spans == [(10.0, 22.0, LIGHTHOUSE), (50.0, 50.0, LIGHTHOUSE), (60.0, None, LIGHTHOUSE)]


def test_marks_are_bounded_and_the_dropped_ones_counted() -> None:
    tl = JobTimeline(started=0.0, max_marks=10)
    for i in range(25):
        tl.failed(0, float(i), "x")
    pic = tl.timeline(30.0, "", "")
    assert len(pic.marks) == 10 and pic.marks[0].at == 15.0 and pic.marks_dropped == 15


def test_when_the_picture_is_written() -> None:
    # Into a --log-dir the user gave: always.
    assert keep_timeline(own_log_dir=False, code=0, chaos=False, failures=0)
    # Into the temporary directory: when it is kept (failed or stopped job) ...
    assert keep_timeline(own_log_dir=True, code=1, chaos=False, failures=0)
    assert keep_timeline(own_log_dir=True, code=130, chaos=False, failures=0)
    # ... or when there is something to see in a job that succeeded.
    assert keep_timeline(own_log_dir=True, code=0, chaos=True, failures=0)
    assert keep_timeline(own_log_dir=True, code=0, chaos=False, failures=2)
    assert not keep_timeline(own_log_dir=True, code=0, chaos=False, failures=0)


def test_the_picture_is_written_whole_or_not_at_all(tmp_path) -> None:
    """Where it cannot be written (here: its temporary name is taken by a directory, as a full disk
    would refuse it), the job is told in one line and no partial file is left."""
    import io

    from ftlaunch.launcher.options import LaunchOptions
    from ftlaunch.launcher.output import Console
    from ftlaunch.launcher.supervisor import Supervisor

    err = io.StringIO()
    sup = Supervisor(
        LaunchOptions(entrypoint="x", log_dir=str(tmp_path)), Console(io.StringIO(), err, status=False)
    )
    sup._timeline.failed(1, sup._started + 1.0, "rank 0 exited with code 1")
    assert sup._write_timeline(1) == str(tmp_path / "timeline.svg")
    assert (tmp_path / "timeline.svg").read_text().startswith("<svg") and not (
        tmp_path / "timeline.svg.tmp"
    ).exists()
    (tmp_path / "timeline.svg").unlink()
    (tmp_path / "timeline.svg.tmp").mkdir()
    assert sup._write_timeline(1) is None
    assert not (tmp_path / "timeline.svg").exists()
    assert err.getvalue().startswith(f"[ftlaunch] could not write the timeline {tmp_path / 'timeline.svg'}: ")
    assert len(err.getvalue().splitlines()) == 1


def test_a_slowdown_is_a_span_and_a_straggler_replacement_one_incident() -> None:
    """``--chaos slow=`` draws a span to where it ended (known only at its end); the lighthouse's
    verdict is a moment; its replacement of the group is the incident, the failure of the group's
    workers that follows (fenced, or told to end) the same one."""
    tl = JobTimeline(started=0.0)
    slow = Injection(10.0, 1, "SLOW", "workers", 20, factor=2.0, lasted=60.0)
    tl.injected(slow)
    tl.found_slow(1, 22.0, "straggler: 2.0x slower")
    tl.straggler_replaced(1, 40.0, "straggler (2.0x): its slot went to a hot spare")
    tl.failed(1, 41.0, "rank 0 (pid 9) exited with code 1")  # the fenced worker ends: same incident
    tl.recovered(1, 40.5, TAKEOVER, "rg3, a hot spare, took its slot")
    slow.lasted = 31.5  # its workers ended: the slowdown with them
    marks = tl.timeline(100.0, "", "").marks
    assert [(m.at, m.kind, m.line, m.until) for m in marks] == [
        (10.0, SLOW, "rg1", 41.5),
        (22.0, SLOW, "rg1", None),
        (40.0, STRAGGLER, "rg1", None),
        (40.5, TAKEOVER, "rg1", None),
    ]
    assert marks[0].detail == "chaos: slowed down 2x for 31.5s at step 20"
    assert tl.failures == 1
    # Still slowed when the picture is taken: the span ends there.
    tl2 = JobTimeline(started=0.0)
    tl2.injected(Injection(10.0, 0, "SLOW", "workers", None, factor=3.0, lasted=600.0))
    assert tl2.timeline(50.0, "", "").marks[0].until == 50.0


def test_a_failing_health_check_is_a_mark_and_something_to_see() -> None:
    """As on the dashboard: each time a group's health check began failing is a mark on its line
    (its agent keeps it out: no failure of its own), and a job with one keeps its picture."""
    tl = JobTimeline(started=100.0)
    tl.health_failed(2, 103.0, "health check failed, kept out: rg2: GPU 0 lost")
    tl.health_failed(2, 110.0, "health check failed, kept out: rg2: GPU 0 lost")
    marks = tl.timeline(200.0, "t", "").marks
    assert [(m.at, m.kind, m.line) for m in marks] == [(3.0, HEALTH, "rg2"), (10.0, HEALTH, "rg2")]
    assert marks[0].detail == "health check failed, kept out: rg2: GPU 0 lost"
    assert tl.failures == 0 and tl.health_failures == 2
