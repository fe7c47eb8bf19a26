"""torchrun's own flags inside ``ftlaunch``: taken from torch's parser, each with a decision.

``ftlaunch`` does not re-declare torchrun's flags: `add_torchrun_flags` copies every action of
``torch.distributed.run.get_args_parser()`` into ftlaunch's parser, so the names, spellings
(``--nproc-per-node``/``--nproc_per_node``), types, choices, help texts and ``PET_*`` environment
defaults are torch's own. What differs is decided here, once per flag, in `TORCHRUN_FLAGS`:

* most flags are **accepted with torchrun's meaning**, applied to every replica group (each group is
  one torchelastic agent, i.e. one torchrun node);
* a few get **another default** (``--max-restarts 3``: restarting is the point here; ``--tee 3``:
  the ``[rgG/rR]`` prefixes need teed output; ``--rdzv-backend ftlaunch``);
* a few are **refused with a one-line reason** when set to a value that cannot apply to replica
  groups on one machine (``--nnodes 2``, ``--node-rank 1``, ``--rdzv-backend c10d``, ...).

A flag that a newer torch adds and this table does not know yet is still listed by ``--help`` and
parsed, but refused unless left at its default -- so a new torch never changes a job silently
(``tests/processes/test_torchrun_flags.py`` walks torch's parser and fails until the new flag is decided).

On the agent side, `launch_config` turns the options back into torchrun's namespace and hands it to
torch's own ``config_from_args``, so every accepted flag reaches ``LaunchConfig`` exactly as under
torchrun; only the rendezvous, the run id and the line prefix are ftlaunch's.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

from ftlaunch import env
from ftlaunch.errors import ConfigurationError

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

    from ftlaunch.launcher.options import LaunchOptions

#: The rendezvous every replica group uses (`ftlaunch.launcher.rendezvous.BACKEND_NAME`; not imported
#: here: that module imports torch's rendezvous at import time).
BACKEND = "ftlaunch"

_MULTI_NODE = (
    "for multi-node groups run one `torchrun --rdzv-backend ftlaunch` per node (see docs/launcher.md)"
)


def _nnodes(value: Any) -> str | None:
    if str(value).strip() in ("1", "1:1"):
        return None
    return f"ftlaunch runs each replica group as one node on this machine; {_MULTI_NODE}"


def _rdzv_backend(value: Any) -> str | None:
    if value == BACKEND:
        return None
    return (
        "ftlaunch groups always use the ftlaunch rendezvous (each group its own, the lighthouse "
        "across groups)"
    )


def _node_rank(value: Any) -> str | None:
    if int(value) == 0:
        return None
    return f"each replica group is a single node, so its node rank is 0; {_MULTI_NODE}"


def _master_addr(value: Any) -> str | None:
    from ftlaunch.addresses import is_local_host

    if is_local_host(str(value)):
        return None
    return (
        "every replica group's rank 0 runs on this machine (torchrun uses --master-addr only for the static "
        f"rendezvous); {_MULTI_NODE}"
    )


#: torchrun's own master port: the parser's default before torch 2.13 (None since), so it is what
#: an untouched ``--master-port`` reads there, and is not the user's choice.
_TORCHRUN_MASTER_PORT = 29500


def _master_port(value: Any) -> str | None:
    if value is None or int(value) == _TORCHRUN_MASTER_PORT:
        return None
    return (
        "each replica group's store binds its own free port, so no fixed port can serve N groups "
        "(torchrun uses --master-port only for the static rendezvous); MASTER_PORT is set per group"
    )


def _logs_specs(value: Any) -> str | None:
    if value is None:
        return None
    if any(ep.name == value for ep in metadata.entry_points(group="torchrun.logs_specs")):
        return None
    return f"no entry point named {value!r} in group torchrun.logs_specs"


def _event_log_handler(value: Any) -> str | None:
    from torch.distributed.elastic.events.handlers import get_logging_handler

    try:
        get_logging_handler(str(value))
    except KeyError:
        return "not a registered torchelastic event log handler (e.g. null, console)"
    return None


def _signals(value: Any) -> str | None:
    try:
        parse_signals(str(value))
    except ConfigurationError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class Flag:
    """ftlaunch's decision about one torchrun flag (keyed by its argparse ``dest``)."""

    #: What the flag does under ftlaunch, appended to torch's help text (and documented).
    note: str = ""
    #: ftlaunch's default where it differs from torchrun's (a ``PET_*`` variable still wins).
    default: Any = dataclasses.field(default=None)
    has_default: bool = False
    #: Returns why a value cannot apply (the flag is refused), or None when it is accepted.
    refuse: Callable[[Any], str | None] | None = None


def _ours(default: Any, note: str) -> Flag:
    return Flag(note=note, default=default, has_default=True)


#: Every flag of torch 2.13's torchrun. Keep in the order of torch's parser; docs/launcher.md has the
#: same table for users.
TORCHRUN_FLAGS: dict[str, Flag] = {
    "nnodes": Flag("ftlaunch: only 1 (each replica group is one node on this machine)", refuse=_nnodes),
    "nproc_per_node": Flag("workers per replica group"),
    "rdzv_backend": Flag(
        "ftlaunch: must be ftlaunch, the default", default=BACKEND, has_default=True, refuse=_rdzv_backend
    ),
    "rdzv_endpoint": Flag("ftlaunch: the lighthouse, like --lighthouse"),
    "rdzv_id": Flag("ftlaunch: the job id; group G's rendezvous is <id>-rgG (default: a random id)"),
    "rdzv_conf": Flag("ftlaunch: passed to every group's rendezvous (keys: docs/launcher.md)"),
    "standalone": Flag("ftlaunch: accepted, no effect: every group already has its own local store"),
    "max_restarts": _ours(
        3, "ftlaunch: restarts of one group's workers by its agent (default 3; torchrun's is 0)"
    ),
    "monitor_interval": _ours(
        0.02,
        "ftlaunch: the agent looks at its workers every 20 ms (torchrun's 0.1 s): a dead worker is "
        "restarted sooner; the cost is one waitpid per tick",
    ),
    "start_method": Flag(),
    "event_log_handler": Flag("applies to every group's agent", refuse=_event_log_handler),
    "role": Flag(),
    "module": Flag(),
    "no_python": Flag(),
    "run_path": Flag(),
    "log_dir": Flag(
        "ftlaunch: one sub-directory per group (default: a temporary directory, removed after success)"
    ),
    "redirects": Flag(),
    "tee": _ours("3", "ftlaunch: default 3, both streams teed with a [rgG/rR] prefix"),
    "local_ranks_filter": Flag("applies to every group"),
    "duplicate_stdout_filters": Flag("applies to every group (the copies are under --log-dir)"),
    "duplicate_stderr_filters": Flag("applies to every group (the copies are under --log-dir)"),
    "node_rank": Flag("ftlaunch: only 0 (each replica group is a single node)", refuse=_node_rank),
    "master_addr": Flag(
        "ftlaunch: only this machine (each group's store is on this machine)", refuse=_master_addr
    ),
    "master_port": Flag("ftlaunch: refused (each group's store binds a free port)", refuse=_master_port),
    "local_addr": Flag("address each group's stores bind and advertise (default loopback)"),
    "logs_specs": Flag("applies to every group", refuse=_logs_specs),
    "numa_binding": Flag("applies to every group's workers (by local rank)"),
    "signals_to_handle": Flag(
        "ftlaunch: these signals stop the job; each is forwarded to the agents and by them to the workers",
        refuse=_signals,
    ),
    "shutdown_timeout": Flag("ftlaunch: default --grace-period minus 2"),
    "virtual_local_rank": Flag("applies to every group's workers"),
}

#: torch's positionals; ftlaunch declares its own with the same names.
_POSITIONALS = ("training_script", "training_script_args")


def torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def torchrun_actions(parser: argparse.ArgumentParser | None = None) -> list[argparse.Action]:
    """torchrun's optional flags (no help, no positionals), in the order of its parser."""
    parser = parser or torchrun_parser()
    return [
        a
        for a in parser._actions  # noqa: SLF001 - argparse exposes no public list of a parser's actions
        if a.option_strings and a.dest not in ("help", *_POSITIONALS)
    ]


def add_torchrun_flags(group: argparse._ArgumentGroup) -> list[argparse.Action]:
    """Copy torchrun's flags into ``group`` with ftlaunch's defaults and notes; returns the copies."""
    added = []
    for action in torchrun_actions():
        flag = TORCHRUN_FLAGS.get(action.dest)
        ours = copy.copy(action)
        if flag is None:
            ours.help = f"{action.help} (not supported by this ftlaunch yet: leave it at its default)"
        else:
            if flag.has_default and not env.is_set(f"{env.TORCHRUN_FLAG_PREFIX}{action.dest.upper()}"):
                ours.default = flag.default
            if flag.note:
                ours.help = f"{action.help or ''} ({flag.note})".strip()
        group._add_action(ours)  # noqa: SLF001 - argparse's documented-by-use way to adopt an Action
        added.append(ours)
    return added


def check(args: argparse.Namespace, actions: list[argparse.Action]) -> None:
    """Refuse every torchrun flag whose value cannot apply to replica groups.

    Raises `ConfigurationError` with one line: the flag, its value and why.
    """
    for action in actions:
        value = getattr(args, action.dest)
        flag = TORCHRUN_FLAGS.get(action.dest)
        name = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
        if flag is None:
            if value != action.default:
                raise ConfigurationError(
                    f"{name}: this torch's torchrun flag is not supported by this ftlaunch yet; leave it out"
                )
            continue
        reason = flag.refuse(value) if flag.refuse is not None else None
        if reason:
            raise ConfigurationError(f"{name} {value}: {reason}")


def parse_signals(text: str) -> tuple[str, ...]:
    """``SIGTERM,SIGINT`` -> names, validated (torchrun's ``--signals-to-handle`` syntax)."""
    import signal

    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if not names:
        raise ConfigurationError("--signals-to-handle: empty list")
    for name in names:
        if not name.startswith("SIG") or not hasattr(signal, name) or name in ("SIGKILL", "SIGSTOP"):
            raise ConfigurationError(f"--signals-to-handle: {name} is not a signal that can be handled")
    return names


def launch_config(
    opts: LaunchOptions,
    *,
    run_id: str,
    log_dir: str,
    lighthouse: str,
    rdzv_configs: Mapping[str, Any],
    log_line_prefix_template: str,
    workers_on_host: int | None = None,
) -> LaunchConfig:
    """One replica group's ``LaunchConfig``, built by torchrun's own ``config_from_args``.

    Every torchrun flag goes through torch's translation; then the group's rendezvous (ftlaunch
    backend, the lighthouse as endpoint, the group's keys), run id, line prefix and shutdown timeout
    replace torchrun's. Like torchrun, it sets ``OMP_NUM_THREADS=1`` in this (the agent's) process when
    it is unset and the host runs several workers -- ``workers_on_host``: every group's, since the
    ``ftlaunch`` launcher puts all its groups on one machine (default: this group's). Torch's
    intra-op threads default to the core count in each worker; with two one-worker groups on a host
    they spin against each other and starve in-process Gloo's collective thread (a step ~10x slower).
    """
    from torch.distributed.run import config_from_args

    on_host = opts.nproc_per_node if workers_on_host is None else workers_on_host
    if not env.is_set(env.OMP_NUM_THREADS) and on_host > 1:
        env.publish({env.OMP_NUM_THREADS: "1"})  # what torchrun does, without its banner in every group
    values: dict[str, Any] = {a.dest: a.default for a in torchrun_actions()}
    values.update(
        nnodes="1:1",
        nproc_per_node=str(opts.nproc_per_node),
        rdzv_backend=BACKEND,
        rdzv_endpoint=lighthouse,  # non-empty: also keeps torchrun's "master_addr is only used..." quiet
        rdzv_id=run_id,
        rdzv_conf="",
        standalone=False,
        max_restarts=opts.max_restarts,
        monitor_interval=opts.monitor_interval,
        start_method=opts.start_method,
        event_log_handler=opts.event_log_handler,
        role=opts.role,
        module=False,
        no_python=False,
        run_path=opts.run_path,
        log_dir=log_dir,
        redirects=opts.redirects,
        tee=opts.tee,
        local_ranks_filter=opts.local_ranks_filter,
        duplicate_stdout_filters=list(opts.duplicate_stdout_filters),
        duplicate_stderr_filters=list(opts.duplicate_stderr_filters),
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=None,
        local_addr=opts.local_addr,
        logs_specs=opts.logs_specs,
        numa_binding=opts.numa_binding,
        signals_to_handle=opts.signals_to_handle,
        shutdown_timeout=opts.agent_shutdown_timeout,
        virtual_local_rank=opts.virtual_local_rank,
        training_script=opts.entrypoint,
        training_script_args=list(opts.args),
    )
    config, _cmd, _args = config_from_args(argparse.Namespace(**values))
    return dataclasses.replace(
        config,
        run_id=run_id,
        rdzv_configs=dict(rdzv_configs),
        log_line_prefix_template=log_line_prefix_template,
    )
