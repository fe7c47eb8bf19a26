"""The lighthouse role of the torchx components: serve until every replica group has finished.

``python -m ftlaunch.launcher.lighthouse_role --job-dir DIR --groups N [lighthouse options]`` binds a
free port, writes ``DIR/lighthouse.addr`` (read by the group roles, `group_role`), and exits once
``DIR`` holds N ``*.exit`` files -- each group role writes one when its ``torchrun`` ends -- so the
torchx app finishes when the training does. SIGTERM (torchx cancel) stops it at once.

``--job-dir auto`` and ``--bind auto`` are decided here from the scheduler (`placement`): on one
machine a loopback port and ``/tmp``; on a cluster all interfaces and, on Slurm, the shared
submission directory. A lighthouse on all interfaces always has a job token (``FTLAUNCH_TOKEN`` or a
random one, written to ``DIR/lighthouse.token`` readable by the job's user only).

If a group's node is lost it never writes its exit file; the role then also ends once some group has
finished and no group has been live for ``--idle-exit`` seconds.

The lighthouse is the job's single point of failure (docs/lighthouse.md, *When the lighthouse
dies*). The role restarts it in-process if it stops serving, and the torchx components give the role
``max_retries`` with ``RetryPolicy.REPLICA`` so that a scheduler that supports it (Kubernetes/Volcano)
replaces a dead lighthouse alone. A restarted role finds the previous incarnation's files in the job
directory and serves on the same port with the same token, so the groups' address and token stay
valid; they wait for it (``FTLAUNCH_LIGHTHOUSE_OUTAGE``) and resume.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import secrets
import shutil
import sys
import time

from ftlaunch import env
from ftlaunch.addresses import parse_host_port
from ftlaunch.cli_args import OneLineParser, count, duration
from ftlaunch.env import Count, Duration
from ftlaunch.errors import ConfigurationError
from ftlaunch.launcher import placement
from ftlaunch.launcher.lighthouse_host import HostedLighthouse, LighthouseSettings
from ftlaunch.launcher.placement import ADDRESS_FILE, TOKEN_FILE
from ftlaunch.lifetime import StopSignals
from ftlaunch.lighthouse.quorum import HEARTBEAT_TIMEOUT, JOIN_TIMEOUT, REPLICAS

__all__ = ["ADDRESS_FILE", "build_parser", "finished_groups", "main"]

logger = logging.getLogger("ftlaunch.launcher.lighthouse_role")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m ftlaunch.launcher.lighthouse_role", description=__doc__.splitlines()[0])
    p.add_argument("--job-dir", required=True, help="directory shared with the group roles, or auto")
    p.add_argument(
        "--groups", type=count(Count(1)), required=True, help="exit files to wait for (group roles x nodes)"
    )
    p.add_argument(
        "--bind",
        default=placement.AUTO,
        help="HOST:PORT to listen on (default auto: 127.0.0.1:0 on one machine, else 0.0.0.0:0)",
    )
    p.add_argument("--app-id", default="", help="torchx's ${app_id} (names the automatic job directory)")
    p.add_argument("--rank0-env", default="", help="torchx's ${rank0_env} (tells one machine from a cluster)")
    p.add_argument(
        "--idle-exit",
        type=duration(Duration(0.0)),
        default=300.0,
        help="after a group finished, exit when no group was live for this long (lost nodes)",
    )
    p.add_argument("--min-replicas", type=count(REPLICAS), default=1)
    p.add_argument(
        "--expected-replicas",
        type=count(Count(0)),
        default=0,
        help="replica groups of the job: the first quorum waits for them (up to --join-timeout)",
    )
    p.add_argument("--join-timeout", type=duration(JOIN_TIMEOUT), default=60.0)
    p.add_argument("--heartbeat-timeout", type=duration(HEARTBEAT_TIMEOUT), default=5.0)
    p.add_argument(
        "--stragglers",
        choices=env.STRAGGLER_POLICIES,
        default=None,
        help="slow groups: report them, or also replace persistent ones (default: "
        f"${env.FTLAUNCH_STRAGGLERS}, "
        "else report)",
    )
    p.add_argument("--cleanup", action="store_true", help="remove --job-dir when every group has finished")
    return p


def finished_groups(job_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(job_dir, "*.exit")))


def _write(path: str, text: str, mode: int = 0o644) -> None:
    """Atomically: readers never see a partial file."""
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(path + ".tmp", path)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _same_port_as_before(bind: str, job_dir: str) -> str:
    """``bind`` with the port of a previous incarnation of this role (its address file in
    ``job_dir``) when ``bind`` asks for any free port: the groups keep the address they were given."""
    previous = _read(os.path.join(job_dir, ADDRESS_FILE))
    if previous is None:
        return bind
    try:
        host, port = parse_host_port(bind, default_port=0)
        _, old_port = parse_host_port(previous)
    except ValueError:
        return bind
    if port != 0:
        return bind
    logger.info("a previous lighthouse of this job served on port %d: serving there again", old_port)
    return f"[{host}]:{old_port}" if ":" in host else f"{host}:{old_port}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=env.log_level("INFO", lenient=True),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    where = placement.detect(args.rank0_env)
    try:
        stragglers = args.stragglers or env.stragglers() or "report"
        job_dir = placement.job_dir(args.job_dir, args.app_id, where, needed=True)
        bind = placement.lighthouse_bind(args.bind, where)
        loopback = placement.is_loopback_bind(bind)
    except (ConfigurationError, ValueError) as e:
        print(f"lighthouse role: error: {e}", file=sys.stderr)
        return 2
    assert job_dir is not None  # noqa: S101 - needed=True: a directory or ConfigurationError
    os.makedirs(job_dir, exist_ok=True)
    previous_token = _read(os.path.join(job_dir, TOKEN_FILE))
    token = env.job_token() or previous_token or (None if loopback else secrets.token_hex(16))
    restarted = _read(os.path.join(job_dir, ADDRESS_FILE)) is not None  # a previous incarnation served
    bind = _same_port_as_before(bind, job_dir)
    settings = LighthouseSettings(
        bind=bind,
        min_replicas=args.min_replicas,
        expected_replicas=args.expected_replicas,
        join_timeout=args.join_timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        token=token,
        stragglers=stragglers,
    )
    try:
        lighthouse = HostedLighthouse.start(settings, restarted=restarted)
    except ConfigurationError as e:
        print(f"lighthouse role: error: {e}", file=sys.stderr)
        return 2
    stop = (
        StopSignals()
    )  # SIGTERM (torchx cancel) / SIGINT (why not an Event set by a handler: see StopSignals)
    if token:
        _write(os.path.join(job_dir, TOKEN_FILE), token, mode=0o600)  # for the job's user (dashboard, evict)
    _write(os.path.join(job_dir, ADDRESS_FILE), lighthouse.address)
    print(
        f"ftlaunch lighthouse role listening on {lighthouse.address} ({where.scheduler}; job directory "
        f"{job_dir}{'; job token in ' + TOKEN_FILE if token else ''})",
        flush=True,
    )
    idle_since: float | None = None
    try:
        while not stop.wait(0.2):
            done = finished_groups(job_dir)
            if len(done) >= args.groups:
                logger.info("all %d group role(s) finished; lighthouse role exits", len(done))
                break
            if lighthouse.needs_restart:  # its event loop died: serve again on the same address
                try:
                    lighthouse.restart()
                except ConfigurationError as e:
                    logger.error("cannot restart the lighthouse on %s: %s", lighthouse.address, e)
            now = time.monotonic()
            idle_since = (idle_since or now) if done and lighthouse.live_groups() == 0 else None
            if idle_since is not None and now - idle_since > args.idle_exit:
                logger.warning(
                    "%d of %d group role(s) finished and no group was live for %.0fs (lost "
                    "nodes?); lighthouse role exits",
                    len(done),
                    args.groups,
                    args.idle_exit,
                )
                break
    finally:
        stop.close()
        lighthouse.stop()
        if args.cleanup:
            shutil.rmtree(job_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
