"""Durable checkpoints, the files: write one step's state in torch.distributed.checkpoint's (DCP)
layout, publish it atomically, verify it, read it back.

Why DCP: users open the checkpoint with torch's own tools (``dcp.load`` into a plain model, the
format converters), and sharded (FSDP2) state is written per shard by the ranks that hold it.

Why the extra manifest: DCP's ``.metadata`` says where each tensor's bytes are, not whether those
bytes are still the ones written. The manifest (``ftlaunch-manifest.json``, written after DCP's
files and its ``.metadata``) holds a SHA-256 of every file, the step, and the tree of the state
(dict keys keep their types -- an optimizer's parameter ids are ints, which DCP's own names turn
into text). A checkpoint is a directory that becomes visible only when complete::

    DIR/step-00000100.tmp/   DCP's files and .metadata (fsynced), then the manifest (fsynced)
    DIR/step-00000100/       the same, renamed in one step (and the directory entry fsynced)

so a writer killed mid-save, a full disk or a crash leaves at most a ``.tmp`` directory that no
reader looks at, and never touches a published checkpoint. Names are DCP's: the entry at path
``("default", "model", "0.weight")`` is ``default.model.0.weight``, which is what ``dcp.load`` of
``{"default": {"model": model.state_dict()}}`` looks for.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ftlaunch.checkpointing import durable_plan
from ftlaunch.errors import FtlaunchError

__all__ = [
    "MANIFEST",
    "DurableCheckpointError",
    "Published",
    "flatten",
    "newest",
    "read",
    "retain",
    "unflatten",
    "verify",
    "write",
]

#: The manifest's file name inside a checkpoint directory.
MANIFEST = "ftlaunch-manifest.json"
FORMAT = "ftlaunch.durable"
VERSION = 1
_CHUNK = 1 << 20


class DurableCheckpointError(FtlaunchError):
    """A durable checkpoint could not be written or read (the message says which and why)."""


# ------------------------------------------------------------------------------------- the tree
def _is_node(x: Any) -> bool:
    """Containers the tree descends into: mappings, and lists/tuples that hold a tensor or a
    container (a list of ints, like an optimizer's ``params``, is one leaf)."""
    if isinstance(x, Mapping):
        return True
    if type(x) in (list, tuple):
        return any(
            isinstance(v, torch.Tensor) or isinstance(v, Mapping) or type(v) in (list, tuple) for v in x
        )
    return False


def flatten(state: Any) -> tuple[dict[str, Any], Any]:
    """``(flat, skeleton)``: every leaf by its DCP name, and a JSON tree that rebuilds ``state``
    from ``flat`` (`unflatten`). Keys must be str or int."""
    flat: dict[str, Any] = {}

    def walk(x: Any, path: tuple[str, ...]) -> Any:
        if isinstance(x, Mapping):
            items = []
            for k, v in x.items():
                if type(k) not in (str, int):
                    raise TypeError(
                        f"a checkpointed state's keys are str or int, got {k!r} at {'.'.join(path)}"
                    )
                items.append([k, walk(v, (*path, str(k)))])
            return {"t": "dict", "items": items}
        if _is_node(x):
            return {"t": type(x).__name__, "items": [walk(v, (*path, str(i))) for i, v in enumerate(x)]}
        name = ".".join(path)
        if name in flat:
            raise ValueError(f"two entries of the state have the checkpoint name {name!r}")
        flat[name] = x
        return name

    skeleton = walk(state, ())
    return flat, skeleton


def unflatten(flat: Mapping[str, Any], skeleton: Any) -> Any:
    """The state `flatten` took apart, with ``flat``'s values at its leaves."""
    if isinstance(skeleton, str):
        return flat[skeleton]
    kind, items = skeleton["t"], skeleton["items"]
    if kind == "dict":
        return {k: unflatten(flat, v) for k, v in items}
    values = [unflatten(flat, v) for v in items]
    return tuple(values) if kind == "tuple" else values


# ------------------------------------------------------------------------------------- writing
@dataclass(frozen=True)
class Published:
    """A checkpoint this process published: where, which step, its size and how long it took."""

    path: Path
    step: int
    nbytes: int
    seconds: float


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(
    state: Any,
    directory: str | os.PathLike[str],
    step: int,
    *,
    process_group: dist.ProcessGroup | None = None,
    coordinator: bool = True,
    info: Mapping[str, Any] | None = None,
) -> Published | None:
    """Write ``state`` as the checkpoint of ``step`` under ``directory`` and publish it.

    Every rank of the writing group calls this with its own part (DTensors: its shards) and the
    group's ``process_group`` (None: a group of one). DCP writes the ranks' files and, on the
    coordinator, ``.metadata`` last; the coordinator (``coordinator``: group rank 0) then checks
    every file, writes the manifest and renames. Returns the coordinator's `Published` (None on
    the other ranks). Any failure (`OSError` such as ENOSPC included) raises
    `DurableCheckpointError`, after removing the coordinator's ``.tmp`` directory; a published
    checkpoint is never touched.
    """
    t0 = time.monotonic()
    root = Path(directory)
    tmp = root / durable_plan.dir_name(step, tmp=True)
    final = root / durable_plan.dir_name(step)
    try:
        flat, skeleton = flatten(state)
        if coordinator:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that died before
            tmp.mkdir()
        if process_group is not None:
            dist.barrier(group=process_group)  # the directory exists before anyone writes
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # DCP on one process
            dcp.save(
                flat,
                storage_writer=FileSystemWriter(tmp, sync_files=True),
                process_group=process_group,
                no_dist=process_group is None,
            )
        if not coordinator:
            return None
        files = sorted(p for p in tmp.iterdir() if p.is_file())
        if not any(p.name == ".metadata" for p in files):
            raise DurableCheckpointError(f"DCP wrote no .metadata into {tmp}")
        sums: dict[str, dict[str, Any]] = {
            p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size} for p in files
        }
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "time": time.time(),
            "files": sums,
            "tree": skeleton,
            **({"info": dict(info)} if info else {}),
        }
        data = json.dumps(manifest, separators=(",", ":")).encode()
        with open(tmp / MANIFEST, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (a resumed job never saves its own step)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException as e:
        why = _full_disk(root) or _brief(e)  # before the partial save is removed
        if coordinator:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (DurableCheckpointError, KeyboardInterrupt, SystemExit)):
            raise
        # DCP's own failure, CheckpointException, is a BaseException: wrapped as well.
        raise DurableCheckpointError(f"checkpoint of step {step} in {root} failed: {why}") from e
    nbytes = sum(int(v["bytes"]) for v in sums.values()) + len(data)
    return Published(final, step, nbytes, time.monotonic() - t0)


def _full_disk(root: Path) -> str | None:
    """ "no space left ..." when the file system of ``root`` is (nearly) full: torch's writer reports
    ENOSPC as an unrelated-looking ``RuntimeError`` ("unexpected pos ..."), which would hide why."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return None
    return f"no space left on the device ({free} bytes free)" if free < _CHUNK else None


def _brief(e: BaseException) -> str:
    """One line for an error DCP may wrap several times (its CheckpointException lists each rank's)."""
    inner: BaseException = e
    while inner.__cause__ is not None:
        inner = inner.__cause__
    failures = getattr(e, "failures", None)
    if isinstance(failures, Mapping) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, tuple):  # (exception, traceback) in some torch versions
            inner = inner[0]
    text = f"{type(inner).__name__}: {inner}"
    return text.splitlines()[0] if text else type(inner).__name__


def retain(directory: str | os.PathLike[str], keep_last: int, published: int) -> list[str]:
    """After ``published`` went live: remove older ``.tmp`` directories and all but the newest
    ``keep_last`` complete checkpoints. Returns what it removed (best effort: a removal that
    fails -- another writer got there first -- is skipped)."""
    root = Path(directory)
    try:
        listing = durable_plan.list_dir(os.listdir(root))
    except OSError:
        return []
    names = [durable_plan.dir_name(s, tmp=True) for s in durable_plan.stale(listing.tmp, published)]
    names += [durable_plan.dir_name(s) for s in durable_plan.to_delete(listing.complete, keep_last)]
    for name in names:
        shutil.rmtree(root / name, ignore_errors=True)
    return names


# ------------------------------------------------------------------------------------- reading
def _manifest(path: Path) -> dict[str, Any]:
    with open(path / MANIFEST, "rb") as f:
        manifest = json.loads(f.read())
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError("not an ftlaunch checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise ValueError(f"manifest version {manifest.get('version')!r}, this ftlaunch reads {VERSION}")
    return manifest


def verify(path: str | os.PathLike[str]) -> str | None:
    """None when the checkpoint at ``path`` is intact (its manifest reads, every file it lists is
    there with its size and SHA-256, ``.metadata`` among them); else why not, in a few words."""
    p = Path(path)
    try:
        manifest = _manifest(p)
        files = manifest["files"]
        if ".metadata" not in files:
            return "its manifest lists no .metadata"
        for name, want in files.items():
            f = p / name
            if not f.is_file():
                return f"{name} is missing"
            size = f.stat().st_size
            if size != want["bytes"]:
                return f"{name} has {size} bytes, {want['bytes']} were written (truncated?)"
            if _sha256(f) != want["sha256"]:
                return f"{name} does not match its checksum (damaged)"
    except FileNotFoundError:
        return "it has no manifest"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest does not read ({type(e).__name__}: {e})"
    return None


def newest(directory: str | os.PathLike[str]) -> tuple[int, float] | None:
    """``(step, published at)`` of the newest complete checkpoint, without verifying it; None when
    there is none (or the directory does not exist)."""
    root = Path(directory)
    try:
        listing = durable_plan.list_dir(os.listdir(root))
    except OSError:
        return None
    for step in reversed(listing.complete):
        try:
            return step, (root / durable_plan.dir_name(step) / MANIFEST).stat().st_mtime
        except OSError:
            continue
    return None


def read(
    path: str | os.PathLike[str],
    template: Mapping[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """The top-level entries ``template`` names, read from the checkpoint at ``path`` (entries the
    checkpoint lacks are left out of the result).

    ``template`` holds this rank's current state of each entry: a saved tensor whose counterpart
    there has the saved global shape and dtype is loaded *into* it (a DTensor: into its shards --
    how a sharded state reshards onto this group's mesh); any other saved tensor (an optimizer's
    state before its first step, say) into a new CPU tensor; other values are read as saved. Every
    rank of a group calls it with the same keys and the group's ``process_group`` (None: a group
    of one)."""
    p = Path(path)
    try:
        manifest = _manifest(p)
        metadata = FileSystemReader(p).read_metadata()
    except (OSError, ValueError) as e:
        raise DurableCheckpointError(f"checkpoint {p} does not read: {e}") from e
    tree = manifest["tree"]
    saved = {k: v for k, v in tree["items"]} if isinstance(tree, dict) and tree.get("t") == "dict" else {}
    keys = [k for k in template if k in saved]
    have, _ = flatten({k: template[k] for k in keys})
    target: dict[str, Any] = {}
    for name, meta in metadata.state_dict_metadata.items():
        if not any(name == k or name.startswith(f"{k}.") for k in keys):
            continue
        current = have.get(name)
        if isinstance(meta, TensorStorageMetadata):
            if (
                isinstance(current, torch.Tensor)
                and tuple(current.shape) == tuple(meta.size)
                and current.dtype == meta.properties.dtype
            ):
                target[name] = current
            else:
                target[name] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        else:
            target[name] = current
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # DCP on one process
        try:
            dcp.load(
                target,
                storage_reader=FileSystemReader(p),
                process_group=process_group,
                no_dist=process_group is None,
            )
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            raise DurableCheckpointError(f"checkpoint {p} does not load: {_brief(e)}") from e
    return {k: unflatten(target, saved[k]) for k in keys}
