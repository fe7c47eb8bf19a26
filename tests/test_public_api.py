"""The public surface: torchft's names resolve, and `import ftlaunch` stays light."""

from __future__ import annotations

import subprocess
import sys

import ftlaunch


def test_every_public_name_resolves() -> None:
    for name in ftlaunch.__all__:
        assert getattr(ftlaunch, name) is not None, name


def test_torchft_style_imports() -> None:
    from ftlaunch import DistributedDataParallel, Manager, Optimizer, ProcessGroupBabyGloo, ProcessGroupGloo

    assert Manager.__name__ == "Manager"
    assert issubclass(ProcessGroupGloo, ftlaunch.ProcessGroup)
    assert issubclass(ProcessGroupBabyGloo, ftlaunch.ProcessGroup)
    assert DistributedDataParallel and Optimizer


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
