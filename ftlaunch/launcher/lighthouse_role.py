"""The lighthouse role of the torchx components: serve until every replica group has finished.

``python -m ftlaunch.launcher.lighthouse_role --job-dir DIR --groups N [lighthouse options]`` binds a
free port, writes ``DIR/lighthouse.addr`` (read by the groups' rendezvous through
``lighthouse_file=``), and exits once ``DIR`` holds N ``*.exit`` files -- each group role writes one
when its ``torchrun`` ends -- so the torchx app finishes when the training does. SIGTERM (torchx
cancel) stops it at once.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import shutil
import signal
import sys
import threading
from typing import NoReturn

from ftlaunch import env
from ftlaunch.errors import ConfigurationError
from ftlaunch.launcher.lighthouse_host import HostedLighthouse, LighthouseSettings

ADDRESS_FILE = "lighthouse.addr"

logger = logging.getLogger("ftlaunch.launcher.lighthouse_role")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m ftlaunch.launcher.lighthouse_role", description=__doc__.splitlines()[0])
    p.add_argument("--job-dir", required=True, help="directory shared with the group roles")
    p.add_argument("--groups", type=int, required=True, help="exit files to wait for (group roles x nodes)")
    p.add_argument("--bind", default="127.0.0.1:0", help="HOST:PORT to listen on (default: a free loopback port)")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--join-timeout", type=float, default=60.0)
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--cleanup", action="store_true", help="remove --job-dir when every group has finished")
    return p


def finished_groups(job_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(job_dir, "*.exit")))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.makedirs(args.job_dir, exist_ok=True)
    settings = LighthouseSettings(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout=args.join_timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        token=os.environ.get(env.FTLAUNCH_TOKEN) or None,
    )
    try:
        lighthouse = HostedLighthouse.start(settings)
    except ConfigurationError as e:
        print(f"lighthouse role: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    path = os.path.join(args.job_dir, ADDRESS_FILE)
    with open(path + ".tmp", "w") as f:
        f.write(lighthouse.address + "\n")
    os.replace(path + ".tmp", path)  # readers never see a partial address
    print(f"ftlaunch lighthouse role listening on {lighthouse.address}", flush=True)
    try:
        while not stop.wait(0.2):
            done = finished_groups(args.job_dir)
            if len(done) >= args.groups:
                logger.info("all %d group role(s) finished; lighthouse role exits", len(done))
                if args.cleanup:
                    shutil.rmtree(args.job_dir, ignore_errors=True)
                break
    finally:
        lighthouse.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
