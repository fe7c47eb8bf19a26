"""``ftlaunch``: run a training script as N fault-tolerant replica groups on this machine.

    ftlaunch --replicas 2 --nproc-per-node 2 train.py --steps 100

Flags keep torchrun's names and meanings where they apply; the fault-tolerance flags are ours.
Every bad input is one line on stderr and exit code 2; a failed job exits 1 with its root cause.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import shutil
import sys
from typing import NoReturn

from ftlaunch.errors import ConfigurationError
from ftlaunch.launcher.options import CHAOS_HELP, ChaosSpec, LaunchOptions

EXAMPLES = """\
examples:
  ftlaunch --replicas 2 scripts/train_ddp.py --steps 100
  ftlaunch --replicas 3 --nproc-per-node 2 --chaos every=10 scripts/train_ddp.py
  ftlaunch --replicas 2 --chaos steps=20/40,group=1,signal=STOP scripts/train_ddp.py
  ftlaunch --replicas 2 --lighthouse http://lh-host:29510 -m mypkg.train

workers see torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) for their own
replica group, plus REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, FTLAUNCH_LIGHTHOUSE and FTLAUNCH_TOKEN.
exit status: 0 the job finished, 1 it failed (root cause printed), 2 bad usage, 128+N stopped by signal N.
multi-node replica groups: run one `torchrun --rdzv-backend ftlaunch` per node (docs/launcher.md)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage block hides the message on small terminals)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"ftlaunch: error: {message} (see ftlaunch --help)\n")


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _chaos(text: str) -> ChaosSpec:
    try:
        return ChaosSpec.parse(text)
    except ConfigurationError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--chaos").strip(": ")) from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ftlaunch",
        description="Run a PyTorch training script as N replica groups with per-step fault tolerance: "
        "a lighthouse decides each step's quorum, each group is a torchelastic agent that restarts its "
        "own workers, and a failed group rejoins without stopping the others.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    ft = p.add_argument_group("fault tolerance")
    ft.add_argument("--replicas", type=_nonneg_int, default=2, help="number of replica groups (default 2)")
    ft.add_argument("--min-replicas", "--min_replicas", type=_nonneg_int, default=1,
                    help="groups needed for a step to commit; the job stops when fewer can run (default 1)")
    ft.add_argument("--join-timeout", "--join_timeout", type=_number, default=60.0,
                    help="seconds the lighthouse waits for stragglers before forming a quorum (default 60)")
    ft.add_argument("--heartbeat-timeout", "--heartbeat_timeout", type=_number, default=5.0,
                    help="seconds after which a silent (hung) group leaves the quorum (default 5)")
    ft.add_argument("--lighthouse", "--rdzv-endpoint", "--rdzv_endpoint", dest="lighthouse", default=None,
                    metavar="ADDR", help="use the lighthouse at http://HOST:PORT instead of starting one")
    ft.add_argument("--lighthouse-bind", "--lighthouse_bind", default="127.0.0.1:0", metavar="HOST:PORT",
                    help="where the embedded lighthouse listens (default 127.0.0.1:0, a free loopback port)")
    ft.add_argument("--token", default=None,
                    help="job token for the lighthouse admin calls (default: $FTLAUNCH_TOKEN or a random one)")
    ft.add_argument("--max-agent-restarts", "--max_agent_restarts", type=_nonneg_int, default=3,
                    help="times the supervisor respawns a group whose agent died (default 3)")
    ft.add_argument("--grace-period", "--grace_period", type=_number, default=15.0,
                    help="seconds SIGTERM/SIGINT gives groups to stop before SIGKILL (default 15)")
    ft.add_argument("--chaos", type=_chaos, default=None, metavar="SPEC", help=CHAOS_HELP)
    ft.add_argument("--status", dest="status_line", action="store_true", default=None,
                    help="force the live status line (default: only on a terminal)")
    ft.add_argument("--no-status", dest="status_line", action="store_false", help="never draw the status line")
    ft.add_argument("--no-summary", dest="summary", action="store_false", default=True,
                    help="do not print the summary table at exit")

    tr = p.add_argument_group("torchrun flags (same names and meanings)")
    tr.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                    help="workers per replica group: an integer, or cpu, gpu, xpu, auto (default 1)")
    tr.add_argument("--nnodes", default="1",
                    help="nodes per replica group; ftlaunch runs each group as one node on this machine, so 1")
    tr.add_argument("--max-restarts", "--max_restarts", type=_nonneg_int, default=3,
                    help="restarts of a group's workers by its agent before the group fails (default 3; "
                    "torchrun's default is 0)")
    tr.add_argument("--monitor-interval", "--monitor_interval", type=_number, default=0.1,
                    help="seconds between the agents' worker checks (default 0.1)")
    tr.add_argument("--start-method", "--start_method", default="spawn", choices=["spawn", "fork", "forkserver"])
    tr.add_argument("--role", default="default", help="user-defined role of the workers")
    tr.add_argument("-m", "--module", action="store_true", help="run the script as a module, like python -m")
    tr.add_argument("--no-python", "--no_python", action="store_true",
                    help="run the script directly instead of with python")
    tr.add_argument("--run-path", "--run_path", action="store_true",
                    help="run the script with runpy.run_path in the worker interpreter")
    tr.add_argument("--log-dir", "--log_dir", default=None,
                    help="keep worker logs here (default: a temporary directory, removed after success)")
    tr.add_argument("-r", "--redirects", default="0", help="redirect worker streams to files (torchrun syntax)")
    tr.add_argument("-t", "--tee", default="3",
                    help="tee worker streams to files and console (default 3: both, prefixed [rgG/rR])")
    tr.add_argument("--local-ranks-filter", "--local_ranks_filter", default="",
                    help="only show these local ranks' output, e.g. 0 or 0,1")
    tr.add_argument("--shutdown-timeout", "--shutdown_timeout", type=_nonneg_int, default=None,
                    help="seconds an agent gives workers between SIGTERM and SIGKILL (default: grace-period - 2)")
    tr.add_argument("--standalone", action="store_true",
                    help="accepted for torchrun compatibility: every group already has its own local store")
    tr.add_argument("--rdzv-backend", "--rdzv_backend", default="ftlaunch",
                    help="must be ftlaunch (each group uses its own rendezvous)")
    tr.add_argument("--rdzv-id", "--rdzv_id", default="", help="job id (groups use <id>-rg<g>)")
    tr.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                    help="extra rendezvous settings key=value,... passed to every group's rendezvous")
    p.add_argument("training_script", help="the training script (or module with -m, program with --no-python)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments of the training script")
    return p


def _fail(message: str) -> NoReturn:
    print(f"ftlaunch: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _nproc(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        pass
    if value not in ("cpu", "gpu", "xpu", "auto"):
        _fail(f"--nproc-per-node {value!r} must be an integer or cpu, gpu, xpu, auto")
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(value)
    except ValueError as e:
        _fail(f"--nproc-per-node {value}: {e}")


_STD = re.compile(r"^[0-3]$|^\d+:[0-3](,\d+:[0-3])*$")


def _std(flag: str, value: str) -> str:
    if not _STD.match(value):
        _fail(f"{flag} {value!r}: expected 0-3 (1 stdout, 2 stderr, 3 both) or LOCAL_RANK:N,...")
    return value


def _rdzv_conf(text: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            _fail(f"--rdzv-conf {item!r} is not key=value")
        conf[key.strip()] = value.strip()
    return conf


def _entrypoint(args: argparse.Namespace) -> tuple[str, list[str]]:
    """torchrun's command construction: python -u [-m] script args, or the program itself."""
    script = args.training_script
    if args.run_path:
        if not os.path.isfile(script):
            _fail(f"training script not found: {script}")
        # torchrun's --run-path: the entrypoint is run_script_path(script, *args) inside the worker.
        return "run_script_path", [os.path.abspath(script), *args.training_script_args]
    if args.no_python:
        if args.module:
            _fail("--no-python and -m/--module cannot be used together")
        if shutil.which(script) is None:
            _fail(f"program not found or not executable: {script}")
        return script, list(args.training_script_args)
    prefix = ["-u"]
    if args.module:
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(script) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            _fail(f"module not found: {script}")
        prefix.append("-m")
    elif not os.path.isfile(script):
        _fail(f"training script not found: {script}")
    return os.getenv("PYTHON_EXEC", sys.executable), [*prefix, script, *args.training_script_args]


def options_from_args(argv: list[str] | None = None) -> LaunchOptions:
    """Parse ``argv`` into validated `LaunchOptions` (exits 2 with one line on bad input)."""
    args = build_parser().parse_args(argv)
    if args.rdzv_backend != "ftlaunch":
        _fail(f"--rdzv-backend {args.rdzv_backend}: ftlaunch groups always use the ftlaunch rendezvous")
    if args.nnodes not in ("1", "1:1"):
        _fail(
            f"--nnodes {args.nnodes}: ftlaunch runs each replica group as one node on this machine; for "
            "multi-node groups run one `torchrun --rdzv-backend ftlaunch` per node (see docs/launcher.md)"
        )
    entrypoint, script_args = _entrypoint(args)
    try:
        return LaunchOptions(
            entrypoint=entrypoint,
            args=script_args,
            run_path=args.run_path,
            replicas=args.replicas,
            nproc_per_node=_nproc(args.nproc_per_node),
            min_replicas=args.min_replicas,
            join_timeout=args.join_timeout,
            heartbeat_timeout=args.heartbeat_timeout,
            lighthouse=args.lighthouse,
            lighthouse_bind=args.lighthouse_bind,
            token=args.token,
            max_restarts=args.max_restarts,
            max_agent_restarts=args.max_agent_restarts,
            monitor_interval=args.monitor_interval,
            role=args.role,
            start_method=args.start_method,
            log_dir=args.log_dir,
            redirects=_std("--redirects", args.redirects),
            tee=_std("--tee", args.tee),
            local_ranks_filter=args.local_ranks_filter,
            rdzv_conf=_rdzv_conf(args.rdzv_conf),
            run_id=args.rdzv_id,
            shutdown_timeout=args.shutdown_timeout,
            grace_period=args.grace_period,
            chaos=args.chaos,
            status_line=args.status_line,
            summary=args.summary,
        )
    except ConfigurationError as e:
        _fail(str(e))


def main(argv: list[str] | None = None) -> int:
    from ftlaunch.launcher.supervisor import EXIT_USAGE, LaunchError, Supervisor

    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING").upper(), format="[ftlaunch] %(levelname)s %(name)s: %(message)s")
    opts = options_from_args(argv)
    try:
        return Supervisor(opts).run()
    except LaunchError as e:
        print(f"ftlaunch: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
