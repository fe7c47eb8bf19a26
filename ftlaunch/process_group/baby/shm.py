"""Shared-memory tensor exchange between a Baby process group and its child process.

Protocol (parent -> child, over the parent's private socketpair with the child):

* A CPU tensor travels as a `TensorDesc`: the key of its *storage* plus offset/shape/stride/dtype.
  Nothing is pickled but that small tuple.
* The first time a storage is used, the parent moves it into shared memory **in place**
  (``UntypedStorage._share_fd_cpu_``: the caller's tensors keep working, now backed by a shm
  file) and sends the child a ``("reg", key, nbytes)`` message followed by the file descriptor
  (SCM_RIGHTS). The child maps it once and keeps it. Later operations on the same tensors are
  zero-copy: the child runs the collective directly on the caller's memory.
* The key is the (device, inode) of the shm file. An inode cannot be reused while the child
  still maps the file, and the parent tells the child to unmap (``("unreg", keys)``) only after
  the parent's storage died (a weakref finalizer), so a key never names two different buffers.
* Storages that cannot be moved (not resizable — e.g. ``torch.from_numpy`` or mmap'd files, whose
  aliasing moving would silently break) go through a pool of reusable shared staging buffers
  (copy in before the op, copy out after it).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import NamedTuple, cast

import torch

logger = logging.getLogger(__name__)

StorageKey = tuple[int, int]

_DTYPE_NAMES: dict[torch.dtype, str] = {
    getattr(torch, n): n
    for n in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "bool",
        "complex64",
        "complex128",
    )
}
_DTYPES: dict[str, torch.dtype] = {v: k for k, v in _DTYPE_NAMES.items()}

_MIN_POOL_BYTES = 4096
_MAX_FREE_PER_SIZE = 4
#: Views the child keeps for reuse (`ChildStorages.tensor`); past it, it starts over.
_MAX_VIEWS = 1024


class TensorDesc(NamedTuple):
    """A CPU tensor as the child rebuilds it: a view into a registered shared storage."""

    key: StorageKey | None  # None for tensors with no bytes
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


class Staged(NamedTuple):
    """A caller tensor that travels through a pooled staging buffer."""

    tensor: torch.Tensor
    staged: torch.Tensor
    buffer: torch.Tensor
    copy_out: bool


class SharedTensors:
    """Parent side: turns tensors into `TensorDesc`s, registering storages with the child.

    `encode` must be called with the caller's send lock held, so a storage's registration
    message always precedes the first operation that uses it.
    """

    def __init__(
        self, send_reg: Callable[[StorageKey, int, int], None], send_unreg: Callable[[list[StorageKey]], None]
    ) -> None:
        self._send_reg = send_reg
        self._send_unreg = send_unreg
        self._known: dict[StorageKey, int] = {}
        # The key of each storage already registered, on the storage itself (weakly): a DDP bucket is
        # the same storage every step, and asking for its fd and fstat-ing it each op cost more than
        # the rest of encoding it.
        self._keys: weakref.WeakKeyDictionary[torch.UntypedStorage, StorageKey] = weakref.WeakKeyDictionary()
        self._dead: deque[StorageKey] = deque()  # appended by finalizers (any thread), drained under lock
        self._pool: dict[int, list[torch.Tensor]] = {}
        self._pool_lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Forget everything (the child is gone); finalizers firing later become no-ops."""
        self._closed = True
        self._known.clear()
        self._keys.clear()
        self._dead.clear()
        with self._pool_lock:
            self._pool.clear()

    def _forget(self, key: StorageKey) -> None:
        if not self._closed:
            self._dead.append(key)

    def flush_dead(self) -> None:
        """Tell the child to unmap storages the parent no longer has (call under the send lock)."""
        if not self._dead:
            return
        keys = []
        while self._dead:
            key = self._dead.popleft()
            if self._known.pop(key, None) is not None:
                keys.append(key)
        if keys:
            self._send_unreg(keys)

    def _register(self, storage: torch.UntypedStorage) -> StorageKey:
        key = self._keys.get(storage)
        if key is not None and key in self._known:
            return key
        fd, nbytes = storage._share_fd_cpu_()
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        if key not in self._known:
            self._send_reg(key, nbytes, fd)
            self._known[key] = nbytes
            weakref.finalize(storage, self._forget, key)
        self._keys[storage] = key
        return key

    def encode(self, tensor: torch.Tensor, staged: list[Staged], mutable: bool) -> TensorDesc:
        """Describe `tensor` for the child; stage it through the pool if it cannot be shared."""
        dtype = _DTYPE_NAMES.get(tensor.dtype)
        if dtype is None:
            raise ValueError(f"Baby process groups do not support dtype {tensor.dtype}")
        if tensor.device.type != "cpu":
            raise ValueError(f"expected a CPU tensor, got one on {tensor.device}")
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return TensorDesc(None, 0, tuple(tensor.shape), tuple(tensor.stride()), dtype)
        if storage.is_shared() or storage.resizable():
            try:
                key = self._register(storage)
            except RuntimeError as e:  # e.g. shared by file name, not by descriptor
                logger.debug("ftlaunch.process_group: staging tensor (cannot share storage: %s)", e)
            else:
                # A real (not traced) tensor's offset is an int; the stub's SymInt is for tracing.
                offset = cast(int, tensor.storage_offset())
                return TensorDesc(key, offset, tuple(tensor.shape), tuple(tensor.stride()), dtype)
        return self._stage(tensor, staged, mutable, dtype)

    def _stage(self, tensor: torch.Tensor, staged: list[Staged], mutable: bool, dtype: str) -> TensorDesc:
        nbytes = tensor.numel() * tensor.element_size()
        buffer = self._acquire(nbytes)
        view = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        staged.append(Staged(tensor, view, buffer, mutable))
        key = self._register(buffer.untyped_storage())
        offset = cast(int, view.storage_offset())  # a real tensor: an int, not the stub's SymInt
        return TensorDesc(key, offset, tuple(view.shape), tuple(view.stride()), dtype)

    def _acquire(self, nbytes: int) -> torch.Tensor:
        size = max(_MIN_POOL_BYTES, 1 << (nbytes - 1).bit_length())
        with self._pool_lock:
            free = self._pool.get(size)
            if free:
                return free.pop()
        buffer = torch.empty(size, dtype=torch.uint8)
        buffer.untyped_storage()._share_fd_cpu_()  # by descriptor, whatever torch's sharing strategy
        return buffer

    def release(self, staged: list[Staged], copy_back: bool) -> None:
        """After an op: copy staged outputs back to the caller's tensors, recycle the buffers."""
        for item in staged:
            if copy_back and item.copy_out:
                item.tensor.copy_(item.staged)
        with self._pool_lock:
            if self._closed:
                return
            for item in staged:
                free = self._pool.setdefault(item.buffer.numel(), [])
                if len(free) < _MAX_FREE_PER_SIZE:
                    free.append(item.buffer)


class ChildStorages:
    """Child side: the mapped storages, by key."""

    def __init__(self) -> None:
        self._storages: dict[StorageKey, torch.UntypedStorage] = {}
        # The tensor each descriptor last named: DDP reduces the same bucket views every step, and a
        # view built once is reused (dropped with its storage's key).
        self._views: dict[TensorDesc, torch.Tensor] = {}

    def add(self, key: StorageKey, nbytes: int, fd: int) -> None:
        self.drop([key])  # a key named again is a new mapping: no view of an old one survives
        try:
            # Private torch API (what torch.multiprocessing uses to map a storage shared by fd),
            # absent from the stubs.
            self._storages[key] = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # type: ignore[attr-defined]
        finally:
            os.close(fd)

    def drop(self, keys: list[StorageKey]) -> None:
        for key in keys:
            self._storages.pop(key, None)
        dropped = set(keys)
        for desc in [d for d in self._views if d.key in dropped]:
            del self._views[desc]

    def __len__(self) -> int:
        return len(self._storages)

    def tensor(self, desc: TensorDesc) -> torch.Tensor:
        dtype = _DTYPES[desc.dtype]
        if desc.key is None:
            return torch.empty_strided(desc.shape, desc.stride, dtype=dtype)
        view = self._views.get(desc)
        if view is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            storage = self._storages[desc.key]
            view = torch.empty(0, dtype=dtype).set_(storage, desc.offset, desc.shape, desc.stride)
            self._views[desc] = view
        return view
