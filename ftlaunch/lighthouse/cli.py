"""``ftlaunch-lighthouse``: run a standalone lighthouse until SIGINT/SIGTERM.

Prints one line ``ftlaunch-lighthouse listening on http://HOST:PORT`` (flushed) once it accepts
connections, so scripts can start it with port 0 and read the address.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from ftlaunch import env
from ftlaunch.cli_args import OneLineParser, count, duration, duration_help, milliseconds
from ftlaunch.env import Count
from ftlaunch.errors import ConfigurationError
from ftlaunch.lifetime import StopSignals
from ftlaunch.lighthouse.quorum import HEARTBEAT_TIMEOUT, JOIN_TIMEOUT, REPLICAS
from ftlaunch.lighthouse.server import QUORUM_TICK, STARTUP_GRACE

PROG = "ftlaunch-lighthouse"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG, description="ftlaunch quorum server (lighthouse). Protocol: docs/lighthouse.md."
    )
    p.add_argument(
        "--bind",
        default="127.0.0.1:0",
        help="HOST:PORT to listen on; port 0 picks a free port (default %(default)s)",
    )
    # torchft's flag spellings (--min_replicas, *_ms in milliseconds) are aliases: its README's command
    # works unchanged. Each pair writes the same destination, in seconds.
    p.add_argument(
        "--min-replicas",
        "--min_replicas",
        type=count(REPLICAS),
        default=1,
        help="smallest quorum (default %(default)s)",
    )
    p.add_argument(
        "--expected-replicas",
        type=count(Count(0)),
        default=0,
        help="replica groups of the job: the first quorum waits for them, up to --join-timeout "
        "(default %(default)s: form with whoever asks)",
    )
    for name, default, what, bounds in (
        ("join-timeout", 60.0, "how long the first quorum waits for stragglers", JOIN_TIMEOUT),
        ("quorum-tick", 0.1, "timer period for what only time changes (join timeout, silence)", QUORUM_TICK),
        ("heartbeat-timeout", 5.0, "silence after which a group is out", HEARTBEAT_TIMEOUT),
    ):
        dest = name.replace("-", "_")
        p.add_argument(
            f"--{name}",
            dest=dest,
            type=duration(bounds),
            default=default,
            metavar="SECONDS",
            help=duration_help(what, bounds),
        )
        p.add_argument(
            f"--{dest}_ms",
            dest=dest,
            type=milliseconds(bounds),
            default=argparse.SUPPRESS,
            metavar="MS",
            help=f"torchft's spelling of --{name}, in milliseconds",
        )
    p.add_argument(
        "--startup-grace",
        type=duration(STARTUP_GRACE),
        default=0.0,
        metavar="SECONDS",
        help=duration_help(
            "when restarting the lighthouse of a running job: form no first quorum for this long "
            "unless the groups report their last one (use the heartbeat timeout)",
            STARTUP_GRACE,
        ),
    )
    p.add_argument(
        "--stragglers",
        choices=env.STRAGGLER_POLICIES,
        default=None,
        help="slow groups (docs/lighthouse.md, Stragglers): report them, or also replace a persistent "
        f"one with a hot spare or by restarting it (default: ${env.FTLAUNCH_STRAGGLERS}, else report)",
    )
    p.add_argument(
        "--token",
        default=env.job_token(),
        help=f"job token every group and admin request must carry (default: ${env.FTLAUNCH_TOKEN}); "
        "without one the lighthouse serves loopback only and its admin endpoints are disabled",
    )
    p.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ftlaunch.lighthouse.server import LighthouseServer, collect_less

    try:
        stragglers = args.stragglers or env.stragglers() or "report"
        server = LighthouseServer(
            args.bind,
            min_replicas=args.min_replicas,
            expected_replicas=args.expected_replicas,
            join_timeout=args.join_timeout,
            quorum_tick=args.quorum_tick,
            heartbeat_timeout=args.heartbeat_timeout,
            token=args.token,
            startup_grace=args.startup_grace,
            stragglers=stragglers,
        )
    except ConfigurationError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1

    stop = StopSignals()  # SIGTERM / SIGINT (why not an Event set by a handler: see StopSignals)
    collect_less()  # this process only serves: see its docstring
    try:
        server.start()
        print(f"{PROG} listening on {server.address}", flush=True)
        stop.wait()
        if stop.received is not None:
            logging.getLogger(__name__).info(
                "lighthouse: %s received, shutting down", signal.Signals(stop.received).name
            )
    finally:
        server.shutdown()
        stop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
