"""``ftlaunch``: run a training script as N fault-tolerant replica groups on this machine.

    ftlaunch --replicas 2 --nproc-per-node 2 train.py --steps 100

Every torchrun flag is accepted with torchrun's meaning (torch's own parser, see `torchrun_flags`)
or refused with a reason when it cannot apply to replica groups; the fault-tolerance flags are ours.
Every bad input is one line on stderr and exit code 2, and so is a bad setting a worker ended on
(the job stops at once: restarting cannot fix it); a failed job exits 1 with its root cause.
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

from ftlaunch import env
from ftlaunch.cli_args import OneLineParser, duration, duration_help, integer
from ftlaunch.errors import ConfigurationError
from ftlaunch.launcher import torchrun_flags
from ftlaunch.launcher.options import CHAOS_HELP, GRACE_PERIOD, MAX_GROUPS, ChaosSpec, LaunchOptions
from ftlaunch.launcher.torchrun_flags import add_torchrun_flags
from ftlaunch.lighthouse.quorum import HEARTBEAT_TIMEOUT, JOIN_TIMEOUT

EXAMPLES = """\
examples:
  ftlaunch --replicas 2 scripts/train_ddp.py --steps 100
  ftlaunch --replicas 3 --nproc-per-node 2 --chaos every=10 scripts/train_ddp.py
  ftlaunch --replicas 2 --chaos steps=20/40,group=1,signal=STOP scripts/train_ddp.py
  ftlaunch --replicas 3 --spares 1 --stragglers replace --chaos steps=20,group=1,slow=2,slow_for=60 \
scripts/train_ddp.py
  ftlaunch --replicas 2 --lighthouse http://lh-host:29510 -m mypkg.train

workers see torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) for their own
replica group, plus REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, FTLAUNCH_LIGHTHOUSE and FTLAUNCH_TOKEN.
durations (--join-timeout, --heartbeat-timeout, --grace-period, --chaos, FTLAUNCH_*_TIMEOUT) are
seconds, or with an s/m suffix: 30, 30s, 1.5m; flags in the environment are 1/true/yes/on or 0/false/no/off.
exit status: 0 the job finished, 1 it failed (root cause printed), 2 bad usage or a bad setting (a worker's
ConfigurationError stops the job at once, without restarts), 128+N stopped by signal N.
timeline: at exit a picture of the run (each group's step against time, failures and rejoins marked)
is written as timeline.svg into the log directory: always with --log-dir; into the temporary one when
the job failed or was stopped (its logs are kept), or succeeded after --chaos or a failure (its logs
are removed, the picture stays). The summary prints its path; open it in a browser.
multi-node replica groups: run one `torchrun --rdzv-backend ftlaunch` per node (docs/launcher.md)."""


def _chaos(text: str) -> ChaosSpec:
    try:
        return ChaosSpec.parse(text)
    except ConfigurationError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--chaos").strip(": ")) from None


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="ftlaunch",
        description="Run a PyTorch training script as N replica groups with per-step fault tolerance: "
        "a lighthouse decides each step's quorum, each group is a torchelastic agent that restarts its "
        "own workers, and a failed group rejoins without stopping the others.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    ft = p.add_argument_group("fault tolerance")
    ft.add_argument(
        "--replicas",
        type=integer,
        default=2,
        help=f"number of replica groups (1 to {MAX_GROUPS} with the spares; default 2)",
    )
    ft.add_argument(
        "--spares",
        type=integer,
        default=0,
        help="hot spares: extra groups that start, build their process groups and wait; one replaces "
        "a failed group at the next quorum, with its replica-group id (default 0)",
    )
    ft.add_argument(
        "--min-replicas",
        "--min_replicas",
        type=integer,
        default=1,
        help="groups needed for a step to commit; the job stops when fewer can run (default 1)",
    )
    ft.add_argument(
        "--join-timeout",
        "--join_timeout",
        type=duration(JOIN_TIMEOUT),
        default=60.0,
        metavar="SECONDS",
        help=duration_help(
            "how long the lighthouse waits for stragglers before forming a quorum", JOIN_TIMEOUT, "60"
        ),
    )
    ft.add_argument(
        "--heartbeat-timeout",
        "--heartbeat_timeout",
        type=duration(HEARTBEAT_TIMEOUT),
        default=5.0,
        metavar="SECONDS",
        help=duration_help("silence after which a (hung) group leaves the quorum", HEARTBEAT_TIMEOUT, "5"),
    )
    ft.add_argument(
        "--kill-stopped",
        "--kill_stopped",
        action="store_true",
        help="a worker stopped by a signal (SIGSTOP, SIGTSTP: a hang) is killed at once and its group "
        "restarted, as after a crash; the others go on without waiting for it (default: it stays "
        "in the quorum until --heartbeat-timeout and goes on where it was when continued)",
    )
    ft.add_argument(
        "--stragglers",
        choices=env.STRAGGLER_POLICIES,
        default=None,
        help="slow groups (a throttled GPU, a bad link): report them in the status, metrics and summary, "
        "or also replace a persistent one -- its slot to a hot spare when one waits, else a restart -- "
        f"never below --min-replicas, one at a time (default: ${env.FTLAUNCH_STRAGGLERS}, else report)",
    )
    ft.add_argument(
        "--health-check",
        "--health_check",
        default=None,
        metavar="CMD",
        help="a shell command each group's agent runs before its workers start or restart, e.g. "
        "'python -m ftlaunch.health': a nonzero exit keeps the group out (reported with the check's "
        "last output line in the status, metrics and summary) and retries it with backoff while the "
        f"job trains on (default: ${env.FTLAUNCH_HEALTH_CHECK}, else none)",
    )
    ft.add_argument(
        "--health-check-timeout",
        "--health_check_timeout",
        type=duration(env.HEALTH_CHECK_TIMEOUT),
        default=None,
        metavar="SECONDS",
        help=duration_help(
            "how long one run of the health check may take before it is killed and counts as failed",
            env.HEALTH_CHECK_TIMEOUT,
            f"${env.FTLAUNCH_HEALTH_CHECK_TIMEOUT}, else 60",
        ),
    )
    ft.add_argument(
        "--lighthouse",
        dest="lighthouse",
        default=None,
        metavar="ADDR",
        help="use the lighthouse at http://HOST:PORT instead of starting one (= --rdzv-endpoint)",
    )
    ft.add_argument(
        "--lighthouse-bind",
        "--lighthouse_bind",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="where the embedded lighthouse listens (default 127.0.0.1:0, a free loopback port)",
    )
    ft.add_argument(
        "--token",
        default=None,
        help="job token every lighthouse request carries (default: $FTLAUNCH_TOKEN or a random one)",
    )
    ft.add_argument(
        "--max-agent-restarts",
        "--max_agent_restarts",
        type=integer,
        default=3,
        help="times the supervisor respawns a group whose agent died (default 3)",
    )
    ft.add_argument(
        "--grace-period",
        "--grace_period",
        type=duration(GRACE_PERIOD),
        default=15.0,
        metavar="SECONDS",
        help=duration_help("how long SIGTERM/SIGINT gives groups to stop before SIGKILL", GRACE_PERIOD, "15"),
    )
    ft.add_argument(
        "--checkpoint-dir",
        "--checkpoint_dir",
        default=None,
        metavar="DIR",
        help="durable checkpoints: one group writes the committed state here every --checkpoint-every "
        "steps, in the background (torch.distributed.checkpoint layout); a job started on a directory "
        "with a checkpoint resumes from the newest complete one (default: none)",
    )
    ft.add_argument(
        "--checkpoint-every",
        "--checkpoint_every",
        type=integer,
        default=None,
        metavar="N",
        help="committed steps between two durable checkpoints (default 100; 0: resume only)",
    )
    ft.add_argument(
        "--checkpoint-keep",
        "--checkpoint_keep",
        type=integer,
        default=None,
        metavar="K",
        help="complete durable checkpoints kept, the newest (default 3; 0: all)",
    )
    ft.add_argument("--chaos", type=_chaos, default=None, metavar="SPEC", help=CHAOS_HELP)
    ft.add_argument(
        "--status",
        dest="status_line",
        action="store_true",
        default=None,
        help="force the live status line (default: only on a terminal)",
    )
    ft.add_argument(
        "--no-status", dest="status_line", action="store_false", help="never draw the status line"
    )
    ft.add_argument(
        "--no-summary",
        dest="summary",
        action="store_false",
        default=True,
        help="do not print the summary table at exit",
    )

    tr = p.add_argument_group(
        "torchrun's flags (torch's own definitions: every flag of this torch's torchrun, applied to each "
        "replica group, or refused with a reason)"
    )
    p.set_defaults(_torchrun_actions=add_torchrun_flags(tr))
    p.add_argument(
        "training_script", help="the training script (or module with -m, program with --no-python)"
    )
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
    return env.python_exec(), [*prefix, script, *args.training_script_args]


def _make_log_dir(path: str | None) -> None:
    """``--log-dir``, created now (and checked writable) so a bad path is one line before anything
    starts, not a traceback once the lighthouse and the first agent are up."""
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        _fail(f"--log-dir {path}: cannot create it: {e.strerror or e}")
    if not os.access(path, os.W_OK | os.X_OK):
        _fail(f"--log-dir {path}: not writable by this user")


def _lighthouse(args: argparse.Namespace) -> str | None:
    """``--lighthouse`` and torchrun's ``--rdzv-endpoint`` name the same thing."""
    ours, theirs = args.lighthouse, args.rdzv_endpoint or None
    if ours and theirs and ours != theirs:
        _fail(f"--lighthouse {ours} and --rdzv-endpoint {theirs} name different lighthouses; give one")
    return ours or theirs


def options_from_args(argv: list[str] | None = None) -> LaunchOptions:
    """Parse ``argv`` into validated `LaunchOptions` (exits 2 with one line on bad input)."""
    args = build_parser().parse_args(argv)
    try:
        torchrun_flags.check(args, args._torchrun_actions)
    except ConfigurationError as e:
        _fail(str(e))
    entrypoint, script_args = _entrypoint(args)
    try:
        opts = LaunchOptions(
            entrypoint=entrypoint,
            args=script_args,
            run_path=args.run_path,
            replicas=args.replicas,
            spares=args.spares,
            nproc_per_node=_nproc(args.nproc_per_node),
            min_replicas=args.min_replicas,
            join_timeout=args.join_timeout,
            heartbeat_timeout=args.heartbeat_timeout,
            kill_stopped=args.kill_stopped,
            stragglers=args.stragglers,
            health_check=args.health_check or env.health_check(),
            health_check_timeout=args.health_check_timeout,
            lighthouse=_lighthouse(args),
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
            event_log_handler=args.event_log_handler,
            duplicate_stdout_filters=list(args.duplicate_stdout_filters),
            duplicate_stderr_filters=list(args.duplicate_stderr_filters),
            local_addr=args.local_addr,
            logs_specs=args.logs_specs,
            numa_binding=args.numa_binding,
            signals_to_handle=args.signals_to_handle,
            virtual_local_rank=args.virtual_local_rank,
            rdzv_conf=_rdzv_conf(args.rdzv_conf),
            run_id="" if args.rdzv_id == "none" else args.rdzv_id,
            # torchrun's --shutdown-timeout is new in torch 2.13: older torch has no such flag.
            shutdown_timeout=getattr(args, "shutdown_timeout", None),
            grace_period=args.grace_period,
            chaos=args.chaos,
            status_line=args.status_line,
            summary=args.summary,
        )
    except ConfigurationError as e:
        _fail(str(e))
    _make_log_dir(opts.log_dir)
    _publish_checkpoints(args)
    return opts


def _publish_checkpoints(args: argparse.Namespace) -> None:
    """``--checkpoint-*`` as the variables every worker reads (`env.CheckpointEnv`), over the
    environment's own values; checked here, so a bad one is one line before anything starts."""
    try:
        from_env = env.CheckpointEnv.from_environ()
    except ConfigurationError as e:
        _fail(str(e))
    directory = args.checkpoint_dir or from_env.directory
    every = from_env.every if args.checkpoint_every is None else args.checkpoint_every
    keep = from_env.keep_last if args.checkpoint_keep is None else args.checkpoint_keep
    for flag, value in (("--checkpoint-every", every), ("--checkpoint-keep", keep)):
        if value < 0:
            _fail(f"{flag} {value} must be >= 0")
    if not directory:
        if args.checkpoint_every is not None or args.checkpoint_keep is not None:
            _fail("--checkpoint-every/--checkpoint-keep need --checkpoint-dir")
        return
    directory = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        _fail(f"--checkpoint-dir {directory}: cannot create it: {e.strerror or e}")
    if not os.access(directory, os.W_OK | os.X_OK):
        _fail(f"--checkpoint-dir {directory}: not writable by this user")
    env.publish(env.CheckpointEnv(directory, every, keep).to_environ())


def _check_environment() -> None:
    """Read every setting the workers will read from the environment they inherit, now: a bad one
    is one line here, before anything starts, not the same error in every worker of every group at
    every restart."""
    from ftlaunch.timeouts import Timeouts

    try:
        env.WorkerEnv.from_environ()
        env.SyncEnv.from_environ()
        env.zygote_wanted()
        env.prestart_fork()
        env.stragglers()
        env.health_check_timeout()
        Timeouts.derive()
    except ConfigurationError as e:
        _fail(str(e))


def main(argv: list[str] | None = None) -> int:
    from ftlaunch.launcher.supervisor import EXIT_USAGE, LaunchError, Supervisor

    try:
        level = env.log_level("WARNING")
    except ConfigurationError as e:
        _fail(str(e))
    logging.basicConfig(level=level, format="[ftlaunch] %(levelname)s %(name)s: %(message)s")
    opts = options_from_args(argv)
    _check_environment()
    try:
        return Supervisor(opts).run()
    except LaunchError as e:
        print(f"ftlaunch: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
