"""The public surface: torchft's names resolve, and `import ftlaunch` stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ftlaunch


def test_every_public_name_resolves() -> None:
    for name in ftlaunch.__all__:
        assert getattr(ftlaunch, name) is not None, name


def test_torchft_style_imports() -> None:
    """torchft's names are the real classes, with the shapes torchft code relies on."""
    import inspect

    import torch

    from ftlaunch import DistributedDataParallel, Manager, Optimizer, ProcessGroupBabyGloo, ProcessGroupGloo

    # torchft's Manager constructor, keyword for keyword (scripts pass them by name).
    torchft_manager_params = {
        "pg",
        "load_state_dict",
        "state_dict",
        "min_replica_size",
        "use_async_quorum",
        "timeout",
        "quorum_timeout",
        "connect_timeout",
        "rank",
        "world_size",
        "world_size_mode",
        "store_addr",
        "store_port",
        "lighthouse_addr",
        "replica_id",
        "port",
        "hostname",
        "heartbeat_interval",
        "checkpoint_transport",
        "init_sync",
        "max_retries",
    }
    missing = torchft_manager_params - set(inspect.signature(Manager).parameters)
    assert not missing, f"Manager lacks torchft's parameters {sorted(missing)}"
    assert issubclass(ProcessGroupGloo, ftlaunch.ProcessGroup)
    assert issubclass(ProcessGroupBabyGloo, ftlaunch.ProcessGroup)
    assert issubclass(ProcessGroupGloo, torch.distributed.ProcessGroup)  # torch APIs accept it
    assert issubclass(DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)
    assert issubclass(Optimizer, torch.optim.Optimizer)


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        ftlaunch.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("expected AttributeError")


def test_import_does_not_pull_in_torch() -> None:
    code = "import sys, ftlaunch; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_torchx_components_survive_importing_the_training_wrappers() -> None:
    """`ftlaunch:ddp` is a torchx component function; no submodule may shadow it."""
    import ftlaunch.worker.data_parallel  # noqa: F401
    from ftlaunch import DistributedDataParallel  # noqa: F401

    assert callable(ftlaunch.ddp) and callable(ftlaunch.hsdp)


def test_torchft_module_paths_resolve_to_the_worker_package() -> None:
    import ftlaunch.data
    import ftlaunch.manager
    import ftlaunch.optim
    import ftlaunch.process_group

    assert ftlaunch.manager.Manager is ftlaunch.Manager
    assert ftlaunch.optim.OptimizerWrapper is ftlaunch.optim.Optimizer is ftlaunch.Optimizer
    assert ftlaunch.data.DistributedSampler is ftlaunch.DistributedSampler
    assert ftlaunch.process_group.ManagedProcessGroup is ftlaunch.ManagedProcessGroup
    assert ftlaunch.Manager.__module__ == "ftlaunch.worker.manager"
    import ftlaunch.local_sgd

    assert ftlaunch.local_sgd.DiLoCo is ftlaunch.DiLoCo and ftlaunch.local_sgd.LocalSGD is ftlaunch.LocalSGD


def test_nothing_in_the_package_imports_the_torchft_shims() -> None:
    import ast
    from pathlib import Path

    shims = {
        "ftlaunch.manager",
        "ftlaunch.optim",
        "ftlaunch.data",
        "ftlaunch.parameter_server",
        "ftlaunch.local_sgd",
        "ftlaunch.coordination",
        "ftlaunch.work",
    }
    root = Path(ftlaunch.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names = {a.name for a in node.names}
            else:
                continue
            if names & shims:
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == []


def test_a_worker_importing_the_lighthouse_client_does_not_load_the_server() -> None:
    """Workers import the lighthouse package for its client (and the outage-tolerant wrapper): the
    server, its asyncio transport and the bookkeeping must not come with it."""
    code = (
        "import sys\n"
        "from ftlaunch.lighthouse import LighthouseClient, QuorumMember\n"
        "import ftlaunch.lighthouse.reconnect\n"
        "server = {'asyncio', 'ftlaunch.lighthouse.server', 'ftlaunch.lighthouse.transport',\n"
        "          'ftlaunch.lighthouse.connection', 'ftlaunch.lighthouse.routes', "
        "'ftlaunch.lighthouse.membership'}\n"
        "sys.exit(', '.join(sorted(server & set(sys.modules))) or 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, f"loaded with the client: {done.stderr.strip()}"


def test_the_lighthouse_packages_public_names_resolve() -> None:
    import ftlaunch.lighthouse as lighthouse
    from ftlaunch.lighthouse import LighthouseServer
    from ftlaunch.lighthouse.server import LighthouseServer as Defined

    assert LighthouseServer is Defined
    assert set(lighthouse.__all__) <= set(dir(lighthouse))
    for name in lighthouse.__all__:
        assert getattr(lighthouse, name).__name__ == name
    with pytest.raises(AttributeError, match="NoSuchThing"):
        lighthouse.NoSuchThing  # noqa: B018
