"""The lighthouse dashboard in a real browser: Debian's ``chromium``, headless, against a live
lighthouse with two groups, one of which failed and rejoined. Asserts on the DOM after the page's
scripts ran (``--dump-dom``): the tables, and the timeline picture (one line per group, the failure
and the rejoin marked); saves a screenshot under the test's tmp dir
(``FTLAUNCH_DASHBOARD_SCREENSHOT=PATH`` also copies it there: docs/dashboard.png is made so); watches
the picture redraw in place as the lighthouse learns more, and types a token and clicks Evict, through
Chromium's DevTools protocol (a wrong token is refused, the right one evicts).

Chromium is installed with ``apt-get install -y chromium`` when missing and apt-get is usable (root);
otherwise the test is skipped with the reason.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import tempfile
import time

import pytest

from ftlaunch.lighthouse.client import LighthouseClient
from ftlaunch.lighthouse.health import HealthReport
from ftlaunch.lighthouse.progress import ProgressReport
from ftlaunch.lighthouse.quorum import QuorumMember, decode_quorum_id
from ftlaunch.lighthouse.server import LighthouseServer

pytestmark = pytest.mark.timeout(900)

TOKEN = "dashboard-secret-token"


def _find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def chromium() -> str:
    exe = _find_chromium()
    if exe:
        return exe
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        pytest.skip("chromium is not installed and apt-get is not usable here (needs apt-get as root)")
    for cmd in (
        [apt, "install", "-y", "-q", "chromium"],
        [apt, "update", "-q"],
        [apt, "install", "-y", "-q", "chromium"],
    ):
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=600,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            )
        except subprocess.TimeoutExpired:
            pytest.skip(f"{' '.join(cmd)} did not finish within 600 s")
        if done.returncode == 0 and _find_chromium():
            break
    exe = _find_chromium()
    if exe is None:
        pytest.skip(f"apt-get could not install chromium: {done.stderr.strip()[-300:]}")
    return exe


def _browser(chromium: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    profile = tempfile.mkdtemp(prefix="ftlaunch_chromium_")
    try:
        return subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--virtual-time-budget=3000",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def _quorum_round(clients: list[LighthouseClient]) -> None:
    import threading

    answers: dict[int, object] = {}
    threads = [
        threading.Thread(target=lambda i=i, c=c: answers.__setitem__(i, c.quorum(QuorumMember(f"rg{i}"), 10)))
        for i, c in enumerate(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert len(answers) == len(clients)


def _step(c: LighthouseClient, rid: str, session: str, step: int, commits: int, heals: int = 0) -> None:
    c.set_progress(
        rid,
        ProgressReport(
            session,
            step=step,
            commits=commits,
            heals=heals,
            heal_seconds=0.125 * heals,
            step_seconds=0.031,
            quorum_seconds=0.004,
            commit_seconds=0.002,
        ),
    )
    c.heartbeat(rid)


def _job(steps: int, fail_at: int | None = None, back_at: int | None = None):
    """A lighthouse with two groups in one quorum reporting ``steps`` steps; from ``fail_at`` rg1 is
    down (reported failed) while rg0 steps on, and at ``back_at`` it is back in the quorum, healed."""
    with LighthouseServer("127.0.0.1:0", token=TOKEN, expected_replicas=2) as server:
        clients = [LighthouseClient(server.address, connect_timeout=5, token=TOKEN) for _ in range(2)]
        try:
            for i, c in enumerate(clients):
                c.start_heartbeat(f"rg{i}", 0.2)
            _quorum_round(clients)
            for step in range(1, steps + 1):
                if step == fail_at:
                    server.report_failure("rg1", "rank 0 (pid 4242) killed by SIGKILL")
                if step == back_at:
                    _quorum_round(clients)  # rg1's restart is back in the quorum, healed
                for i, c in enumerate(clients):
                    if i == 1 and fail_at is not None and back_at is not None and fail_at <= step < back_at:
                        continue  # down
                    if i == 1 and back_at is not None and step >= back_at:
                        _step(c, "rg1", "s1b", step, commits=step - back_at + 1, heals=1)
                    else:
                        _step(c, f"rg{i}", f"s{i}", step, commits=step)
                time.sleep(0.1)  # a plausible step rate for the picture
            yield server, clients
        finally:
            for c in clients:
                c.close()


@pytest.fixture
def live_job():
    """rg1 fails after step 8 while rg0 steps on, and is back 1.2 s later, healed to step 21 (one
    heal); both go on to step 30: the story the dashboard's picture tells."""
    yield from _job(30, fail_at=9, back_at=21)


@pytest.fixture
def live_lighthouse():
    """Two groups at step 5, nothing happened (for the admin endpoints)."""
    for server, _ in _job(5):
        yield server


def test_dashboard_in_headless_chromium(chromium, live_job, tmp_path) -> None:
    server, _ = live_job
    url = server.address + "/"
    # The screenshot first: the picture as the steps just reported left it.
    shot = tmp_path / "dashboard.png"
    res = _browser(chromium, f"--screenshot={shot}", "--window-size=1500,900", "--hide-scrollbars", url)
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    target = os.environ.get("FTLAUNCH_DASHBOARD_SCREENSHOT")
    if target:
        shutil.copyfile(shot, target)
    dom = _browser(chromium, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = dom.stdout
    # Both groups, with their progress columns and the action buttons.
    for rid in ("rg0", "rg1"):
        row = re.search(rf"<tr data-replica=\"{rid}\">(.*?)</tr>", page, re.S)
        assert row, page[:3000]
        cells = [
            html.unescape(re.sub(r"<[^>]+>", "", c)).strip()
            for c in re.findall(r"<td[^>]*>(.*?)</td>", row.group(1), re.S)
        ]
        assert cells[0] == rid and cells[1] == "live" and cells[2] == "30"  # step: the reports are newer
        assert cells[3] == ("30" if rid == "rg0" else "18")  # committed steps, from the progress reports
        assert float(cells[4]) >= 0  # steps/s column
        assert cells[7] == ("0.00 s" if rid == "rg0" else "0.12 s")  # heal time column
        assert re.search(rf"data-action=\"evict\" data-replica=\"{rid}\"", row.group(1))
        assert re.search(rf"data-action=\"kill\" data-replica=\"{rid}\"", row.group(1))
    # The token is typed, never embedded.
    assert 'id="token"' in page and 'type="password"' in page
    assert TOKEN not in page
    # Readable quorum id (#N), raw id on hover; times with date and zone.
    qid = server.snapshot().quorum_id
    assert qid is not None
    label = re.search(r"<span class=\"qid mono\" title=\"quorum id (\d+)\"[^>]*>#(\d+)</span>", page)
    assert label and int(label.group(1)) == qid and int(label.group(2)) == decode_quorum_id(qid)[1]
    assert re.search(r"formed \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} [A-Z+\-0-9]+", page), page[:3000]
    assert "<th>heal time</th>" in page and "<th>steps/s</th>" in page
    # The page's script ran in the browser without breaking the DOM it refreshes.
    assert 'id="live"' in page
    # The picture, as refreshed in place by the page: a line per group, rg1's failure and rejoin.
    chart = re.search(r'<div id="timeline">(<svg .*?</svg>)</div>', page, re.S)
    assert chart, page[:3000]
    series = re.findall(r'<path class="series" data-line="(\w+)"', chart.group(1))
    assert series == ["rg0", "rg1"]
    marks = re.findall(r'<g class="mark [\w ]+" data-kind="(\w+)" data-line="(\w*)"', chart.group(1))
    assert marks == [("failure", "rg1"), ("rejoin", "rg1")], marks
    assert re.search(r'<path class="down" data-line="rg1"', chart.group(1))  # its down time


def test_the_picture_redraws_in_place_as_the_lighthouse_learns(chromium, live_job) -> None:
    """What a user watching the page sees: rg0's line grows and its failure appears, without a reload,
    each mark inside the drawn plot area."""
    server, clients = live_job
    tools = _DevTools(chromium)
    try:
        target = tools.call("Target.createTarget", {"url": server.address + "/"})["targetId"]
        session = tools.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

        def evaluate(expr: str) -> object:
            res = tools.call("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session)
            return res["result"].get("value")

        picture = """(() => {
            const svg = document.querySelector('#timeline svg');
            if (!svg || document.readyState !== 'complete') return null;
            const area = svg.querySelector('rect.plot-area').getBoundingClientRect();
            const marks = [...svg.querySelectorAll('g.mark')].map(g => {
                const r = g.getBoundingClientRect(), x = r.left + r.width / 2, y = r.top + r.height / 2;
                return [g.dataset.kind, g.dataset.line,
                        x >= area.left - 1 && x <= area.right + 1 && \
y >= area.top - 1 && y <= area.bottom + 1];
            });
            const rg0 = svg.querySelector('path.series[data-line="rg0"]');
            return {marks, rg0: rg0.getAttribute('d').split('L').length, \
loaded: window.__loaded = window.__loaded || Date.now()};
        })()"""
        deadline = time.monotonic() + 30
        while (before := evaluate(picture)) is None:
            assert time.monotonic() < deadline, "the dashboard did not load"
            time.sleep(0.1)
        assert before["marks"] == [["failure", "rg1", True], ["rejoin", "rg1", True]], before
        for step in range(31, 37):
            _step(clients[0], "rg0", "s0", step, commits=step)
            time.sleep(0.1)
        server.report_failure("rg0", "rank 0 (pid 4343) exited with code 1")
        deadline = time.monotonic() + 15
        while True:
            now = evaluate(picture)
            if now is not None and ["failure", "rg0", True] in now["marks"]:
                break
            assert time.monotonic() < deadline, f"the picture did not redraw: {now}"
            time.sleep(0.2)
        assert now["rg0"] > before["rg0"] and now["loaded"] == before["loaded"]  # more points, same page
    finally:
        tools.close()


def test_stragglers_and_health_checks_are_marked_on_the_picture(chromium) -> None:
    """A live lighthouse finds rg1 a straggler from the leaders' reports (twice rg0's own work per
    step) while rg2's agent reports a failing health check: the page, as Chromium runs it, marks
    both on their lines and names both in the legend, the health check's output in the tooltip."""
    with LighthouseServer("127.0.0.1:0", token=TOKEN, expected_replicas=2) as server:
        clients = [LighthouseClient(server.address, connect_timeout=5, token=TOKEN) for _ in range(3)]
        try:
            for i, c in enumerate(clients[:2]):
                c.start_heartbeat(f"rg{i}", 0.2)
            _quorum_round(clients[:2])
            clients[2].report_health(
                "rg2", HealthReport("python -m ftlaunch.health", False, "cuda:0 unusable: ECC error", 5.0)
            )
            for step in range(1, 16):
                for i, c in enumerate(clients[:2]):
                    own = 0.03 * (i + 1)  # rg1 does the same work twice as slowly
                    report = ProgressReport(f"s{i}", step=step, commits=step, compute_seconds=own)
                    c.report_progress(f"rg{i}", report)
                time.sleep(0.05)
            deadline = time.monotonic() + 15
            while not any(v.replica_id == "rg1" for v in server.stragglers().stragglers):
                assert time.monotonic() < deadline, server.stragglers()
                time.sleep(0.1)
            dom = _browser(chromium, "--dump-dom", server.address + "/")
        finally:
            for c in clients:
                c.close()
    assert dom.returncode == 0, dom.stderr[-2000:]
    chart = re.search(r'<div id="timeline">(<svg .*?</svg>)</div>', dom.stdout, re.S)
    assert chart, dom.stdout[:3000]
    marks = re.findall(r'<g class="mark [\w ]+" data-kind="(\w+)" data-line="(\w*)"', chart.group(1))
    assert sorted(marks) == [("health", "rg2"), ("slow", "rg1")], marks
    text = html.unescape(chart.group(1))
    assert "health check failed (1)" in text and "slowed / straggler found (1)" in text
    assert "cuda:0 unusable: ECC error" in text  # the mark's tooltip: the check's last line


def test_admin_buttons_endpoints_need_the_token(live_lighthouse) -> None:
    """What the Evict/Kill buttons send: refused without the token, done with it."""
    server = live_lighthouse
    anonymous = LighthouseClient(server.address, connect_timeout=5)
    admin = LighthouseClient(server.address, connect_timeout=5, token=TOKEN)
    try:
        from ftlaunch.errors import LighthouseError

        with pytest.raises(LighthouseError, match="401"):
            anonymous.kill("rg1", "no token")
        with pytest.raises(LighthouseError, match="404"):
            admin.kill("nobody")
        admin.evict("rg0", "from the test")
        assert server.snapshot().group("rg0") is None
        # Kill a group beating from no thread of this process: its leader would kill its own process.
        admin.report_progress("rg9", ProgressReport("s9", step=1, commits=1))
        admin.kill("rg9", "from the test")
        assert any(h.event == "kill_requested" and h.replica_id == "rg9" for h in server.snapshot().history)
        # what its next heartbeat (from the process holding the id: the admin client here) hears
        assert server._membership.heartbeat("rg9", incarnation=admin.incarnation) == "from the test"
    finally:
        anonymous.close()
        admin.close()


class _DevTools:
    """Chromium driven over its DevTools protocol on a pipe (``--remote-debugging-pipe``: commands
    on fd 3, answers on fd 4, NUL-terminated JSON), so the test can type and click like a user."""

    def __init__(self, chromium: str) -> None:
        import json

        self._json = json
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        self._profile = tempfile.mkdtemp(prefix="ftlaunch_chromium_")

        # The shell puts our pipe ends on chromium's fds 3 (commands in) and 4 (answers out).
        args = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            f"--user-data-dir={self._profile}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            # bash: dash's redirections take single-digit fds only.
            [
                shutil.which("bash") or "/bin/bash",
                "-c",
                f'exec "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}',
                "sh",
                *args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(to_chrome_r, from_chrome_w),
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._next_id = 0

    def call(
        self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30
    ) -> dict:
        import select

        self._next_id += 1
        msg: dict = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, self._json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                answer = self._json.loads(raw)
                if answer.get("id") == self._next_id:
                    if "error" in answer:
                        raise AssertionError(f"{method}: {answer['error']}")
                    return answer["result"]
            left = deadline - time.monotonic()
            assert left > 0, f"no answer to {method} within {timeout}s"
            ready, _, _ = select.select([self._from_chrome], [], [], left)
            if ready:
                chunk = os.read(self._from_chrome, 1 << 16)
                assert chunk, "chromium closed its DevTools pipe"
                self._buf += chunk

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)
        shutil.rmtree(self._profile, ignore_errors=True)


def test_evict_button_sends_the_token_the_user_types(chromium, live_lighthouse) -> None:
    server = live_lighthouse
    tools = _DevTools(chromium)
    try:
        target = tools.call("Target.createTarget", {"url": server.address + "/"})["targetId"]
        session = tools.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

        def evaluate(expr: str) -> object:
            res = tools.call(
                "Runtime.evaluate", {"expression": expr, "awaitPromise": True, "returnByValue": True}, session
            )
            return res["result"].get("value")

        deadline = time.monotonic() + 30
        while (
            evaluate("document.readyState === 'complete' && !!document.getElementById('token')") is not True
        ):
            assert time.monotonic() < deadline, "the dashboard did not load"
            time.sleep(0.1)
        click = """new Promise(done => {
            window.confirm = () => true;
            const out = document.getElementById('admin-result');
            out.textContent = '';
            document.getElementById('token').value = %s;
            document.querySelector('button[data-action="evict"][data-replica="rg0"]').click();
            const t0 = Date.now();
            (function poll() { out.textContent || Date.now() - t0 > 10000 \
? done(out.textContent) : setTimeout(poll, 50); })();
        })"""
        assert "HTTP 403" in str(evaluate(click % "'not-the-token'"))  # the lighthouse checks what was typed
        assert server.snapshot().group("rg0") is not None
        assert evaluate(click % repr(TOKEN)) == "evict rg0: done"
        assert server.snapshot().group("rg0") is None
        assert any(h.event == "evicted" and h.replica_id == "rg0" for h in server.snapshot().history)
        assert TOKEN not in str(
            evaluate("document.documentElement.outerHTML.replace(document.getElementById('token').value, '')")
        )
    finally:
        tools.close()
