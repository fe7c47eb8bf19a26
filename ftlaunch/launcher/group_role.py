"""One replica group's role in ``torchx run ftlaunch:hsdp``: torchrun, then wait for the job's end.

``python -m ftlaunch.launcher.group_role [options] -- TORCHRUN_ARGS`` is what every group role (one
per replica group, one replica per node of the group) runs:

1. **Find the lighthouse** (`placement`): ``--lighthouse`` if given, else the address the lighthouse
   role wrote to the job directory -- with the host replaced by the scheduler's own name for the
   lighthouse role's node (torchx's ``${rank0_env}``) when it has one. The result is torchrun's
   ``--rdzv-endpoint``, so torchrun never sees an empty endpoint.
2. **Run torchrun in this process** (``torch.distributed.run.main``) with the ``ftlaunch`` rendezvous
   and the group's keys: torchelastic restarts the group's workers, as under plain torchrun.
3. **Write the exit status** to ``<job dir>/rg<G>.<node>.exit`` (the lighthouse role counts them).
4. **Hold until the job ends** -- every group role's exit file is there, the job directory is gone,
   or the lighthouse has had no live group (or has not answered) for ``--hold-timeout`` seconds --
   then exit with torchrun's status. Holding is what gives each group its own lifetime on schedulers
   that end the whole job with its first task: torchx's Slurm scheduler runs all roles as one
   ``srun`` step with ``--kill-on-bad-exit=1`` and ``--wait=60``, so a group out of restarts that
   exited at once would kill the groups still training, and one that finished early would end them
   60 s later. A signal (torchx cancel) ends it at once.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import sys
import time

from ftlaunch import env
from ftlaunch.addresses import format_host_port, parse_address
from ftlaunch.cli_args import OneLineParser
from ftlaunch.errors import ConfigurationError
from ftlaunch.launcher import placement
from ftlaunch.launcher.lighthouse_host import RemoteLighthouse
from ftlaunch.launcher.placement import ADDRESS_FILE, TOKEN_FILE
from ftlaunch.lifetime import StopSignals

logger = logging.getLogger("ftlaunch.launcher.group_role")

#: How often the hold loop looks at the job directory and the lighthouse.
_POLL_S = 1.0


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m ftlaunch.launcher.group_role", description=__doc__.splitlines()[0])
    p.add_argument("--group", type=int, required=True, help="this replica group's id")
    p.add_argument("--groups", type=int, required=True, help="number of replica groups")
    p.add_argument(
        "--spares", type=int, default=0, help="hot spares of the job (group ids --groups.. are spares)"
    )
    p.add_argument("--nnodes", type=int, default=1, help="nodes of each replica group (torchrun --nnodes)")
    p.add_argument("--node", default="0", help="this node's index in the group (torchx's ${replica_id})")
    p.add_argument("--app-id", default="", help="torchx's ${app_id}")
    p.add_argument(
        "--rank0-env", default="", help="torchx's ${rank0_env}: where the lighthouse role's host is"
    )
    p.add_argument("--job-dir", default=placement.AUTO, help="directory shared by all roles, or auto")
    p.add_argument("--lighthouse", default="", help="HOST:PORT of a lighthouse you run (no lighthouse role)")
    p.add_argument(
        "--lighthouse-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the lighthouse role's address",
    )
    p.add_argument(
        "--hold-timeout",
        type=float,
        default=60.0,
        help="after torchrun ended, stop waiting once no group was live for this long",
    )
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER, help="-- then torchrun's arguments")
    return p


def resolve_endpoint(address: str, where: placement.Placement) -> str:
    """The lighthouse role's ``address``, on the host the scheduler gives its node when it gives one."""
    parsed = parse_address(address, allow_http=True)
    if where.rank0_host is None:
        return parsed.url
    return f"http://{format_host_port(where.rank0_host, parsed.port)}"


def _wait_for_address(job_dir: str, timeout: float) -> str:
    path = os.path.join(job_dir, ADDRESS_FILE)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                return text
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise ConfigurationError(
                f"no lighthouse address in {path} after {timeout:g}s: the lighthouse role did not start, or "
                "--job_dir is not shared by all roles (it must be: pass one on a shared filesystem)"
            )
        time.sleep(0.2)


def torchrun_argv(
    args: argparse.Namespace, endpoint: str, job_dir: str | None, requeued: int = 0
) -> list[str]:
    """torchrun's arguments: the endpoint and the group's rendezvous keys, then the spec's own.

    ``requeued``: how often Slurm requeued the job. A requeued job keeps its id, so its job
    directory, and a multi-node group meets in a store file of that run's own: the previous run's
    file holds a rendezvous of nodes that are gone."""
    # The lighthouse is the lighthouse role's (or yours): a group must never start one of its own, even
    # when the endpoint is this machine and the lighthouse is gone.
    conf = f"replica_group_id={args.group},num_replica_groups={args.groups},start_lighthouse=false"
    if args.spares:
        conf += f",spares={args.spares}"
    if args.nnodes > 1:
        if job_dir is None:  # placement.job_dir(needed=True) has refused already
            raise ConfigurationError("a multi-node replica group needs a job directory")
        run = f".r{requeued}" if requeued else ""
        conf += f",group_endpoint=file:{os.path.join(job_dir, env.replica_id(args.group))}{run}.store"
    rest = list(args.torchrun_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    return ["--rdzv-endpoint", endpoint, "--rdzv-conf", conf, *rest]


def run_torchrun(argv: list[str]) -> tuple[int, bool]:
    """torchrun in this process; returns (exit status, stopped by a signal)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except ChildFailedError as e:
        logger.error("replica group workers failed for good: %s", e)
        return 1, False
    except SignalException as e:
        return 128 + int(e.sigval), True
    except SystemExit as e:  # torchrun's own usage errors
        return (e.code if isinstance(e.code, int) else 1), False
    except Exception:  # noqa: BLE001 - reported like torchrun would, then the role still holds
        logger.exception("torchrun failed")
        return 1, False
    return 0, False


def _live_groups(address: str) -> int:
    """Live groups at the lighthouse; one that does not answer has none."""
    try:
        lighthouse = RemoteLighthouse.connect(address, timeout=2.0)
    except Exception:  # noqa: BLE001 - unreachable, refused, malformed: no live group to wait for
        return 0
    try:
        return lighthouse.live_groups()
    finally:
        lighthouse.close()


def hold(job_dir: str | None, expected: int, lighthouse: str, hold_timeout: float, stop: StopSignals) -> str:
    """Wait until the job ends (see the module docstring); returns why."""
    quiet_since: float | None = None
    while not stop.wait(_POLL_S):
        if job_dir is not None:
            if not os.path.isdir(job_dir):
                return "the job directory was removed (the lighthouse role finished)"
            if len(glob.glob(os.path.join(job_dir, "*.exit"))) >= expected:
                return "every group role has finished"
        live = _live_groups(lighthouse)
        now = time.monotonic()
        quiet_since = None if live else (quiet_since or now)
        if quiet_since is not None and now - quiet_since > hold_timeout:
            return f"no replica group was live for {hold_timeout:g}s"
    return "stopped by a signal"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=env.log_level("INFO", lenient=True),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    rid = env.replica_id(args.group)
    where = placement.detect(args.rank0_env)
    try:
        job_dir = placement.job_dir(
            args.job_dir, args.app_id, where, needed=not args.lighthouse or args.nnodes > 1
        )
        if job_dir is not None:
            os.makedirs(job_dir, exist_ok=True)
        if args.lighthouse:
            endpoint = args.lighthouse
        else:
            assert job_dir is not None  # noqa: S101 - needed without --lighthouse
            endpoint = resolve_endpoint(_wait_for_address(job_dir, args.lighthouse_timeout), where)
            token_file = os.path.join(job_dir, TOKEN_FILE)
            if env.job_token() is None and os.path.exists(token_file):
                with open(token_file) as f:
                    env.publish({env.FTLAUNCH_TOKEN: f.read().strip()})  # the rendezvous publishes it
        command = torchrun_argv(args, endpoint, job_dir, env.slurm_restart_count())
    except (ConfigurationError, ValueError) as e:
        print(f"ftlaunch group role {rid}: error: {e}", file=sys.stderr)
        return 2
    logger.info("%s node %s (%s): torchrun %s", rid, args.node, where.scheduler, " ".join(command))
    code, signaled = run_torchrun(command)
    if job_dir is not None and os.path.isdir(job_dir):
        path = placement.exit_file(job_dir, rid, args.node)
        with open(path + ".tmp", "w") as f:
            f.write(f"{code}\n")
        os.replace(path + ".tmp", path)
    if signaled:
        return code
    if code != 0:
        logger.warning(
            "%s node %s: torchrun exited %d; this task waits for the other groups to finish "
            "(its end must not end theirs)",
            rid,
            args.node,
            code,
        )
    with (
        StopSignals() as stop
    ):  # SIGTERM (torchx cancel) / SIGINT (why not an Event set by a handler: see there)
        why = hold(job_dir, (args.groups + args.spares) * args.nnodes, endpoint, args.hold_timeout, stop)
    logger.info("%s node %s: torchrun exited %d; job over (%s)", rid, args.node, code, why)
    return code


if __name__ == "__main__":
    sys.exit(main())
