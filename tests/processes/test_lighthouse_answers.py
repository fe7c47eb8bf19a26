"""Quorum answers as deltas from the quorum a member holds (lighthouse/quorum_delta.py, answers.py):
the format, the server's choice of answer, and clients old and new against servers old and new."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ftlaunch.addresses import parse_host_port
from ftlaunch.lighthouse import LighthouseClient, LighthouseServer, Quorum, QuorumMember
from ftlaunch.lighthouse.answers import QuorumAnswers
from ftlaunch.lighthouse.quorum_delta import apply_delta, encode_delta


def _quorum(qid: int, steps: list[int], data: list[dict] | None = None, created: float = 1.0) -> Quorum:
    data = data or [{} for _ in steps]
    members = tuple(
        QuorumMember(f"g{i:02d}", address=f"h{i}:1", store_address=f"h{i}:2/p", step=s, data=d)
        for i, (s, d) in enumerate(zip(steps, data, strict=True))
    )
    return Quorum(qid, members, created)


# ---------------------------------------------------------------------------------- the format


def test_steady_round_is_a_few_bytes_and_rebuilds_the_same_quorum():
    base = _quorum(7, [5] * 64, [{"ckpt": [{"addr": f"h{i}"}]} for i in range(64)])
    new = Quorum(7, tuple(QuorumMember(**{**m.to_json(), "step": 6}) for m in base.participants), 2.0)
    delta = encode_delta(base, new, "r1")
    assert delta == {"base": "r1", "quorum_id": 7, "created": 2.0, "steps": [[6, 64]], "changed": []}
    assert len(json.dumps(delta)) < 100 < len(json.dumps(new.to_json())) // 50
    rebuilt = apply_delta(base, json.loads(json.dumps(delta)))
    assert rebuilt == new and rebuilt.to_json() == new.to_json()


def test_changed_fields_and_data_keys_travel_and_only_they():
    base = _quorum(7, [3, 3, 3], [{"a": 1, "b": [1]}, {"a": 1}, {"a": 1}])
    ms = list(base.participants)
    ms[0] = QuorumMember(**{**ms[0].to_json(), "step": 4, "data": {"a": 1, "c": "x"}})  # b dropped, c added
    ms[2] = QuorumMember(**{**ms[2].to_json(), "commit_failures": 2, "address": "new:1"})
    new = Quorum(8, tuple(ms), 3.0)
    delta = encode_delta(base, new, "r")
    assert delta is not None
    assert delta["steps"] == [[4, 1], [3, 2]]
    assert delta["changed"] == [
        [0, {"data": {"c": "x"}, "data_drop": ["b"]}],
        [2, {"address": "new:1", "commit_failures": 2}],
    ]
    rebuilt = apply_delta(base, json.loads(json.dumps(delta)))
    assert rebuilt == new
    assert rebuilt.participants[1] is base.participants[1], "an unchanged member is the held object"


def test_a_membership_change_has_no_delta():
    base = _quorum(7, [1, 1, 1])
    assert encode_delta(base, Quorum(8, base.participants[:2], 2.0), "r") is None
    other = (*base.participants[:2], QuorumMember("zz", step=1))
    assert encode_delta(base, Quorum(8, other, 2.0), "r") is None


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("steps"),
        lambda d: d.update(extra=1),
        lambda d: d.update(steps=[[1, 2]]),  # covers 2 of 3 members
        lambda d: d.update(steps=[[1, 10**12]]),  # no giant list is built
        lambda d: d.update(steps=[[1, 0], [1, 3]]),
        lambda d: d.update(steps=[[-1, 3]]),
        lambda d: d.update(steps=[[True, 3]]),
        lambda d: d.update(changed=[[3, {"address": "x"}]]),
        lambda d: d.update(changed=[[0, {"replica_id": "x"}]]),
        lambda d: d.update(changed=[[0, {"world_size": "x"}]]),
        lambda d: d.update(changed=[[0, {"data": []}]]),
        lambda d: d.update(quorum_id="7"),
    ],
)
def test_malformed_deltas_are_refused(mutate):
    base = _quorum(7, [1, 1, 1])
    delta = encode_delta(base, Quorum(7, base.participants, 2.0), "r")
    assert delta is not None
    mutate(delta)
    with pytest.raises(ValueError):
        apply_delta(base, delta)


# ---------------------------------------------------------------------------------- the server's answers


def test_answers_whole_for_newcomers_delta_for_holders_each_encoded_once():
    answers = QuorumAnswers()
    q1 = _quorum(7, [1, 1])
    full1 = answers.response(q1)
    body1 = json.loads(full1.body)
    rev1 = body1["revision"]
    assert Quorum.from_json(body1["quorum"]) == q1 and body1["version"] == 1
    q2 = _quorum(7, [2, 2], created=2.0)
    delta = answers.response(q2, rev1)
    body2 = json.loads(delta.body)
    assert set(body2) == {"delta", "revision", "version"} and body2["revision"] != rev1
    assert apply_delta(q1, body2["delta"]) == q2
    assert answers.response(q2, rev1) is delta, "the same bytes for every member holding rev1"
    assert "quorum" in json.loads(answers.response(q2).body), "no revision named: the whole quorum"
    assert "quorum" in json.loads(answers.response(q2, "forgotten-1").body), "an unknown revision: whole"
    q3 = _quorum(8, [2], created=3.0)
    assert "quorum" in json.loads(answers.response(q3, body2["revision"]).body), "membership changed: whole"


# ---------------------------------------------------------------------------------- clients and servers


@pytest.fixture
def server() -> Iterator[LighthouseServer]:
    s = LighthouseServer(min_replicas=1, join_timeout=10.0, heartbeat_timeout=30.0).start()
    yield s
    s.shutdown()


def _raw_quorum(addr: str, body: dict) -> dict:
    host, port = parse_host_port(addr)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("POST", "/v1/quorum", json.dumps(body))
        resp = conn.getresponse()
        assert resp.status == 200
        return json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.timeout(60)
def test_new_client_gets_deltas_and_the_whole_quorum(server, monkeypatch):
    client = LighthouseClient(server.address)
    seen: list[dict] = []
    take = client._take_quorum
    monkeypatch.setattr(
        client, "_take_quorum", lambda answer, held: seen.append(answer) or take(answer, held)
    )
    data = {"ckpt": [{"rank": 0, "addr": "x"}]}
    try:
        for step in range(4):
            q = client.quorum(
                QuorumMember("g0", address="a:1", store_address="s:2", step=step, data=data), timeout=10
            )
            assert q == server.snapshot().quorum, "the client returns the quorum the lighthouse formed, whole"
            assert q.participants[0].step == step and q.participants[0].data == data
    finally:
        client.close()
    assert "quorum" in seen[0] and all("delta" in a for a in seen[1:]), [sorted(a) for a in seen]


@pytest.mark.timeout(60)
def test_old_client_gets_the_whole_quorum_as_before(server):
    obj = _raw_quorum(server.address, {"member": {"replica_id": "g0", "step": 1}, "timeout": 10})
    assert Quorum.from_json(obj["quorum"]).replica_ids == ("g0",), "an old client's strict parse still works"
    obj = _raw_quorum(
        server.address, {"member": {"replica_id": "g0", "step": 2}, "timeout": 10, "known": obj["revision"]}
    )
    assert "delta" in obj and "quorum" not in obj


class _OldLighthouse(BaseHTTPRequestHandler):
    """A lighthouse from before answer deltas: 'known' is an unknown field (400); no revision sent
    unless ``revision`` is set (a restarted older install while the client holds a newer one's)."""

    revision: str | None = "newer-1"
    requests: list[dict] = []

    def do_POST(self) -> None:
        obj = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(obj)
        if "known" in obj:
            status, answer = 400, {"error": "unknown field(s): 'known'"}
        else:
            member = QuorumMember.from_json(obj["member"])
            status, answer = 200, {"quorum": Quorum(5, (member,), 1.0).to_json()}
            if self.revision:
                answer["revision"] = self.revision
        payload = json.dumps({**answer, "version": 1}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.timeout(60)
def test_new_client_against_an_older_lighthouse_asks_for_whole_quorums():
    _OldLighthouse.requests = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _OldLighthouse)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    client = LighthouseClient(f"127.0.0.1:{httpd.server_address[1]}")
    try:
        steps = [client.quorum(QuorumMember("g0", step=s), timeout=5).participants[0].step for s in range(3)]
    finally:
        client.close()
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
    assert steps == [0, 1, 2]
    # the second request named the revision, was refused once, and from then on none names one
    assert ["known" in r for r in _OldLighthouse.requests] == [False, True, False, False]
