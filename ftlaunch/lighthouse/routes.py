"""The lighthouse's endpoints (docs/lighthouse.md): JSON bodies checked, membership asked, its refusals
turned into status codes.

`Routes` is the `http.Handler` the transport serves. Every request but a read passes one check,
`Routes.authorize` (the job token, 401/403), before its endpoint runs. Each endpoint validates its
JSON body (unknown, missing and mistyped fields are 400 with the field named; nesting past
`MAX_JSON_DEPTH` too), calls `Membership`, and maps the membership's domain errors to HTTP through
`ERROR_STATUS`. ``POST /quorum`` returns a `http.LongPoll` over the membership's `QuorumTicket`:
the transport parks the connection until the ticket is resolved or the request's timeout passes.
Every error answer is logged here, once (warnings rate-limited per client host).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from ftlaunch.env import FTLAUNCH_TOKEN
from ftlaunch.lighthouse import dashboard, metrics
from ftlaunch.lighthouse.answers import QuorumAnswers
from ftlaunch.lighthouse.bodies import Fields as _Fields
from ftlaunch.lighthouse.bodies import expect_fields as _expect
from ftlaunch.lighthouse.bodies import loads as _loads
from ftlaunch.lighthouse.bodies import printable as _printable
from ftlaunch.lighthouse.bodies import too_deep as _too_deep
from ftlaunch.lighthouse.health import HealthReport
from ftlaunch.lighthouse.http import Head, HttpError, LongPoll, Request, Response
from ftlaunch.lighthouse.hung import parse_blocked
from ftlaunch.lighthouse.limits import WarningLimiter
from ftlaunch.lighthouse.membership import (
    ANONYMOUS,
    Abandoned,
    Evicted,
    HeldElsewhere,
    ImplausibleStep,
    Left,
    Membership,
    MembershipError,
    QuorumTicket,
    QuorumTimeout,
    ShuttingDown,
    Superseded,
    TooManyGroups,
    TrainingFinished,
)
from ftlaunch.lighthouse.progress import ProgressReport
from ftlaunch.lighthouse.protocol import (
    API_VERSION,
    DEFAULT_QUORUM_TIMEOUT,
    INCARNATION_HEADER,
    MAX_INCARNATION_LEN,
    MAX_JSON_DEPTH,
    MAX_QUORUM_TIMEOUT,
    MAX_REPLICA_ID_LEN,
    PATH_PREFIX,
    REPLICA_HEADER,
)
from ftlaunch.lighthouse.quorum import QuorumMember
from ftlaunch.lighthouse.spares import ClaimError, ClaimTicket
from ftlaunch.lighthouse.status import LighthouseStatus

log = logging.getLogger(__name__)

#: How each refusal of the membership reads in HTTP.
ERROR_STATUS: dict[type[MembershipError], int] = {
    QuorumTimeout: 408,
    Superseded: 409,
    Left: 409,
    Evicted: 410,
    HeldElsewhere: 409,
    TrainingFinished: 412,
    ImplausibleStep: 422,
    TooManyGroups: 429,
    ShuttingDown: 503,
}

#: Distinct request paths whose route is remembered.
_PATH_CACHE_SIZE = 256

#: Methods anyone who reaches the port may use (reads); every other request needs the job token.
_OPEN_METHODS = frozenset({"GET", "HEAD"})
#: Endpoints below this path are operators' (evict, report failure): disabled without a token.
_ADMIN_PREFIX = "/admin/"

#: Error codes that are part of normal operation (logged at INFO, the others at WARNING).
_ROUTINE = frozenset({408, 409, 410, 412, 503})

# The fields of each body (bodies.expect_fields): built once, not per request.
_QUORUM_REQUIRED: _Fields = {"member": (dict,)}
_QUORUM_OPTIONAL: _Fields = {"timeout": (float, int), "progress": (dict,), "known": (str,)}
_REPLICA_REQUIRED: _Fields = {"replica_id": (str,)}
_HEARTBEAT_OPTIONAL: _Fields = {"progress": (dict,), "blocked": (dict,), "resume": (dict,)}
_LEAVE_OPTIONAL: _Fields = {"progress": (dict,)}
_CLAIM_REQUIRED: _Fields = {"claimant": (str,), "slots": (int,)}
_CLAIM_OPTIONAL: _Fields = {"preferred": (int, type(None)), "timeout": (float, int)}
_HEALTH_REQUIRED: _Fields = {"replica_id": (str,), "check": (str,), "ok": (bool,)}
_HEALTH_OPTIONAL: _Fields = {"last_line": (str,), "retry_in": (float, int, type(None))}
#: Longest a claim is parked before it is answered "ask again" (spares wait for hours: they re-poll).
MAX_CLAIM_TIMEOUT = 300.0
_REPLICA_HEADER_KEY = REPLICA_HEADER.lower()
_INCARNATION_HEADER_KEY = INCARNATION_HEADER.lower()


def _json(
    status: int, payload: dict[str, Any], headers: dict[str, str] | None = None, *, close: bool = False
) -> Response:
    payload["version"] = API_VERSION
    return Response(status, json.dumps(payload).encode(), "application/json", headers, close=close)


#: The answer to every good heartbeat and admin call: encoded once.
_OK = _json(200, {"ok": True})


def _route_path(path: str) -> str:
    """The endpoint a request path names: query dropped, ``/v1`` prefix and trailing ``/`` removed."""
    path = urlsplit(path).path
    if path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/"):
        path = path[len(PATH_PREFIX) :] or "/"
    return path.rstrip("/") if len(path) > 1 else path


def _incarnation(request: Request) -> str:
    """Which process of a group sent ``request`` (`INCARNATION_HEADER`; none: the anonymous one)."""
    value = request.head.headers.get(_INCARNATION_HEADER_KEY)
    if value is None:
        return ANONYMOUS
    if len(value) > MAX_INCARNATION_LEN or not value.isprintable():
        raise HttpError(
            400, f"{INCARNATION_HEADER} must be at most {MAX_INCARNATION_LEN} printable characters"
        )
    return value


def _check_replica_id(rid: str) -> None:
    if not rid or len(rid) > MAX_REPLICA_ID_LEN or not rid.isprintable():
        raise HttpError(400, f"replica_id must be 1..{MAX_REPLICA_ID_LEN} printable characters")


class Routes:
    """The endpoints over one `Membership`; ``snapshot`` gives the status that ``/`` and ``/status`` show."""

    def __init__(
        self, membership: Membership, *, token: str | None, snapshot: Callable[[], LighthouseStatus]
    ) -> None:
        self._membership = membership
        self._token = token
        #: The header a client sends with the token, as LighthouseClient spells it (checked first).
        self._bearer = f"Bearer {token}".encode() if token is not None else b""
        self._snapshot = snapshot
        self._metrics = metrics.MetricsExporter(snapshot)
        self._table: dict[str, dict[str, Callable[[Request], Response | LongPoll]]] = {
            "/": {"GET": self._dashboard},
            "/status": {"GET": self._status},
            "/quorum": {"POST": self._quorum},
            "/heartbeat": {"POST": self._heartbeat},
            "/leave": {"POST": self._leave},
            "/admin/report_failure": {"POST": self._report_failure},
            "/admin/evict": {"POST": self._evict},
            "/claim": {"POST": self._claim},
            "/health": {"POST": self._health},
            "/metrics": {"GET": self._serve_metrics},
            "/admin/kill": {"POST": self._kill},
        }
        self._answers = QuorumAnswers()
        self._warnings = WarningLimiter()
        #: request path -> its route path and that route's endpoints (a client sends the same paths)
        self._paths: dict[str, tuple[str, dict[str, Callable[[Request], Response | LongPoll]] | None]] = {}
        self._paced: dict[float, Response] = {}  # advised heartbeat pace -> the plain heartbeat answer

    # -- http.Handler

    def handle(self, request: Request) -> Response | LongPoll:
        head = request.head
        route = self._paths.get(head.path)
        if route is None:
            path = _route_path(head.path)
            route = (path, self._table.get(path))
            if len(self._paths) < _PATH_CACHE_SIZE:
                self._paths[head.path] = route
        path, methods = route
        if methods is None:
            raise HttpError(404, f"no such endpoint: {path}")
        endpoint = methods.get(head.method)
        if endpoint is None:
            allow = ", ".join(methods)
            raise HttpError(
                405, f"{request.method} not allowed on {path} (use {allow})", headers={"Allow": allow}
            )
        self.authorize(path, request)
        try:
            return endpoint(request)
        except MembershipError as e:
            raise HttpError(ERROR_STATUS[type(e)], str(e)) from None

    def error(self, error: HttpError, head: Head | None, peer: str) -> Response:
        level = logging.INFO if error.status in _ROUTINE else logging.WARNING
        if level == logging.INFO or self._warnings.allow(peer):  # a bad client's warnings are rate-limited
            dropped = self._warnings.take_suppressed(peer) if level == logging.WARNING else 0
            log.log(
                level,
                "lighthouse: %d for %s %s from %s: %s%s",
                error.status,
                head.method if head else "-",
                _printable(head.path) if head else "-",
                peer,
                _printable(error.message),
                f" ({dropped} similar warnings from this host suppressed)" if dropped else "",
            )
        return _json(error.status, {"error": error.message}, error.headers, close=error.close)

    def identity_lost(self, identity: str) -> None:
        self._membership.connection_lost(identity)

    # -- endpoints

    def _dashboard(self, request: Request) -> Response:
        return Response(200, dashboard.render(self._snapshot()).encode(), "text/html; charset=utf-8")

    def _status(self, request: Request) -> Response:
        return Response(200, json.dumps(self._snapshot().to_json()).encode())

    def _quorum(self, request: Request) -> LongPoll:
        obj = self._read_json(request)
        _expect(obj, _QUORUM_REQUIRED, _QUORUM_OPTIONAL)
        try:
            # Every answer and /status encode the member again: what json.loads made of a body
            # nested at most MAX_JSON_DEPTH deep (`_read_json`) always encodes, so it is not encoded
            # here as a check (test_lighthouse_limits.py: a member nested right at the limit is answered).
            member = QuorumMember.from_json(obj["member"])
        except (TypeError, ValueError, RecursionError) as e:
            raise HttpError(400, f"bad member: {e}") from None
        rid = self._replica_id(request, member.replica_id)
        timeout = float(obj.get("timeout", DEFAULT_QUORUM_TIMEOUT))
        if not (0 < timeout <= MAX_QUORUM_TIMEOUT):
            raise HttpError(400, f"timeout must be in (0, {MAX_QUORUM_TIMEOUT:g}] seconds, got {timeout:g}")
        ticket = self._membership.request_quorum(member, _progress(obj), incarnation=_incarnation(request))
        self._bind(request, rid)
        return _QuorumPoll(self, ticket, timeout, request, obj.get("known"))

    def _heartbeat(self, request: Request) -> Response:
        obj = self._read_json(request)
        _expect(obj, _REPLICA_REQUIRED, _HEARTBEAT_OPTIONAL)
        rid = self._replica_id(request, obj["replica_id"])
        blocked = parse_blocked(obj["blocked"]) if "blocked" in obj else None
        kill = self._membership.heartbeat(
            rid, _progress(obj), incarnation=_incarnation(request), blocked=blocked, resume=obj.get("resume")
        )
        self._bind(request, rid)
        lost = self._membership.lost_in_quorum(rid)
        if lost is None and blocked is not None:  # its peers left the step it waits in
            lost = self._membership.left_behind(rid)
        superseded = self._membership.superseded_for(rid) if lost is None else None
        pace = self._membership.advised_pace()
        if kill is None and lost is None and superseded is None:
            return _OK if pace is None else self._paced_ok(pace)
        answer: dict[str, Any] = {"ok": True}
        if pace is not None:  # the pace to beat at (protocol.advised_heartbeat_interval)
            answer["interval"] = pace
        if kill is not None:
            answer["kill"] = kill
        if lost is not None:  # a participant of its quorum is gone: abort that quorum's step
            answer["lost"] = {"quorum_id": lost[0], "replica_ids": list(lost[1])}
        if superseded is not None:  # its quorum went on without it: abort a step of an older one
            answer["superseded"] = superseded
        return _json(200, answer)

    def _paced_ok(self, pace: float) -> Response:
        """``{"ok": true, "interval": pace}``, encoded once per pace (a tenth of a second each)."""
        answer = self._paced.get(pace)
        if answer is None:
            answer = self._paced[pace] = _json(200, {"ok": True, "interval": pace})
        return answer

    def _leave(self, request: Request) -> Response:
        obj = self._read_json(request)
        _expect(obj, _REPLICA_REQUIRED, _LEAVE_OPTIONAL)
        rid = self._replica_id(request, obj["replica_id"])
        return _json(
            200, {"left": self._membership.leave(rid, _progress(obj), incarnation=_incarnation(request))}
        )

    def _report_failure(self, request: Request) -> Response:
        rid, reason = self._admin_body(request)
        if not self._membership.report_failure(rid, reason or f"reported failed by admin {request.peer}"):
            raise HttpError(404, f"unknown replica {rid!r}")
        return _OK

    def _health(self, request: Request) -> Response:
        """A group's agent ran its health check (lighthouse/health.py)."""
        obj = self._read_json(request)
        _expect(obj, _HEALTH_REQUIRED, _HEALTH_OPTIONAL)
        rid = self._replica_id(request, obj["replica_id"])
        try:
            report = HealthReport.from_json(obj)
        except ValueError as e:
            raise HttpError(400, str(e)) from None
        self._membership.report_health(rid, report)
        return _OK

    def _claim(self, request: Request) -> LongPoll:
        """A hot spare's (or a group's) claim for a replica-group slot (docs/lighthouse.md, *Hot spares*)."""
        obj = self._read_json(request)
        _expect(obj, _CLAIM_REQUIRED, _CLAIM_OPTIONAL)
        claimant = obj["claimant"]
        _check_replica_id(claimant)
        timeout = float(obj.get("timeout", 30.0))
        if not (0 < timeout <= MAX_CLAIM_TIMEOUT):
            raise HttpError(400, f"timeout must be in (0, {MAX_CLAIM_TIMEOUT:g}] seconds, got {timeout:g}")
        if obj["slots"] < 1:
            raise HttpError(400, f"slots must be >= 1, got {obj['slots']}")
        try:
            ticket = self._membership.claim(claimant, slots=obj["slots"], preferred=obj.get("preferred"))
        except ClaimError as e:
            raise HttpError(409, str(e)) from None
        return _ClaimPoll(self, ticket, timeout, request)

    def _evict(self, request: Request) -> Response:
        rid, reason = self._admin_body(request)
        if not self._membership.evict(rid, reason or f"evicted by admin {request.peer}"):
            raise HttpError(404, f"unknown replica {rid!r}")
        return _OK

    # -- metrics and kills (lighthouse/metrics.py)

    def _serve_metrics(self, request: Request) -> Response:
        body, content_type = self._metrics.render()
        return Response(200, body, content_type)

    def _kill(self, request: Request) -> Response:
        """Ask the group's leader to kill its own process (its agent restarts the group), as a crash
        would: the answer to its next heartbeat says so."""
        rid, reason = self._admin_body(request)
        if not self._membership.kill(rid, reason or f"killed by admin {request.peer}"):
            raise HttpError(404, f"unknown replica {rid!r}")
        return _OK

    # -- request checks

    @staticmethod
    def _read_json(request: Request) -> dict[str, Any]:
        if "content-length" not in request.head.headers:
            raise HttpError(411, "Content-Length required")
        try:
            obj = _loads(request.body)
        except (ValueError, UnicodeDecodeError) as e:
            raise HttpError(400, f"malformed JSON: {e}") from None
        except RecursionError:  # nested past the interpreter's limit: refused like any deep body
            raise HttpError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
        if not isinstance(obj, dict):
            raise HttpError(400, f"request body must be a JSON object, got {type(obj).__name__}")
        body = (
            request.body
        )  # fewer brackets than the limit cannot nest deeper: skip the walk (the usual case)
        if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _too_deep(obj, MAX_JSON_DEPTH):
            raise HttpError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        return obj

    @staticmethod
    def _replica_id(request: Request, rid: str) -> str:
        _check_replica_id(rid)
        header = request.head.headers.get(_REPLICA_HEADER_KEY)
        if header is not None and header != rid:
            raise HttpError(400, f"header {REPLICA_HEADER}={header!r} does not match replica_id {rid!r}")
        return rid

    @staticmethod
    def _bind(request: Request, rid: str) -> None:
        """A request carrying the replica header ties its connection's life to the group's."""
        if _REPLICA_HEADER_KEY in request.head.headers:
            request.bind(rid)

    def _admin_body(self, request: Request) -> tuple[str, str]:
        obj = self._read_json(request)
        _expect(obj, {"replica_id": (str,)}, {"reason": (str,)})
        rid = obj["replica_id"]
        _check_replica_id(rid)
        return rid, obj.get("reason", "")

    def authorize(self, path: str, request: Request) -> None:
        """The one access check, made before any endpoint reads its body (docs/security.md).

        Reads (``GET``/``HEAD``: the dashboard, ``/status``, metrics) are open to whoever reaches
        the port. Every other request -- a group's quorum, heartbeat and leave, an admin call, any
        endpoint added later -- must carry the job token (``Authorization: Bearer <token>``),
        compared in constant time; without it the answer is 401, with a wrong one 403, and nothing
        changes. A lighthouse without a token (only allowed on loopback) lets every process of the
        machine act as a group; its admin endpoints stay disabled (403).
        """
        if request.head.method in _OPEN_METHODS:
            return
        admin = path.startswith(_ADMIN_PREFIX)
        if self._token is None:
            if admin:
                raise HttpError(
                    403, "admin endpoints are disabled: the lighthouse was started without a token"
                )
            return
        header = request.head.headers.get("authorization")
        if header and hmac.compare_digest(header.encode(), self._bearer):  # the usual spelling, whole
            return
        if not header:
            raise HttpError(
                401,
                f"{path} needs 'Authorization: Bearer <token>' (the job token, ${FTLAUNCH_TOKEN})",
                headers={"WWW-Authenticate": "Bearer"},
            )
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), self._token.encode()
        ):
            raise HttpError(403, "wrong token")


def _progress(obj: dict[str, Any]) -> ProgressReport | None:
    """The request's ``progress`` field, checked (400 with the field named when it is not one)."""
    raw = obj.get("progress")
    if raw is None:
        return None
    try:
        return ProgressReport.from_json(raw)
    except (TypeError, ValueError) as e:
        raise HttpError(400, f"bad progress: {e}") from None


class _Poll:
    """What a parked request (`http.LongPoll`) holds: its routes, its ticket (anything with
    ``add_done_callback``), its timeout and the request it answers."""

    __slots__ = ("_routes", "_ticket", "timeout", "_request")

    def __init__(self, routes: Routes, ticket: Any, timeout: float, request: Request) -> None:
        self._routes = routes
        self._ticket = ticket
        self.timeout = timeout
        self._request = request

    def on_ready(self, callback: Callable[[], None]) -> None:
        self._ticket.add_done_callback(lambda _ticket: callback())


class _QuorumPoll(_Poll):
    """A parked ``POST /quorum`` as the transport sees it (`http.LongPoll`), with the answer
    revision its member holds (``known``), if it named one."""

    __slots__ = ("_known",)
    _ticket: QuorumTicket

    def __init__(
        self, routes: Routes, ticket: QuorumTicket, timeout: float, request: Request, known: str | None
    ) -> None:
        super().__init__(routes, ticket, timeout, request)
        self._known = known

    def expire(self) -> None:
        self._routes._membership.expire(self._ticket, self.timeout)

    def cancel(self) -> None:
        self._routes._membership.abandon(self._ticket)

    def answer(self) -> Response | None:
        ticket = self._ticket
        if ticket.quorum is not None:
            return self._routes._answers.response(ticket.quorum, self._known)
        if ticket.error is None or isinstance(ticket.error, Abandoned):
            return None
        error = HttpError(ERROR_STATUS[type(ticket.error)], str(ticket.error))
        return self._routes.error(error, self._request.head, self._request.peer)


class _ClaimPoll(_Poll):
    """A parked ``POST /claim`` (`http.LongPoll`): a grant, ``done`` or, at its timeout, "ask again"."""

    __slots__ = ()
    _ticket: ClaimTicket

    def expire(self) -> None:
        self._routes._membership.end_claim(self._ticket, timed_out=True)

    def cancel(self) -> None:
        self._routes._membership.end_claim(self._ticket, timed_out=False)

    def answer(self) -> Response | None:
        ticket = self._ticket
        if ticket.grant is not None:
            grant = ticket.grant
            return _json(
                200, {"slot": grant.slot, "replica_id": grant.replica_id, "replaced": grant.replaced}
            )
        if isinstance(ticket.error, MembershipError):
            error = HttpError(ERROR_STATUS[type(ticket.error)], str(ticket.error))
            return self._routes.error(error, self._request.head, self._request.peer)
        return _json(200, {"slot": None, "done": ticket.done_job})
