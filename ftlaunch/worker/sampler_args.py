"""What both data samplers (`ftlaunch.worker.data.DistributedSampler`, the fixed shards, and
`ftlaunch.worker.exactly_once.ExactlyOnceSampler`) share: argument checks that name the argument
(or the environment variable it came from), and each epoch's order of the dataset, which both derive
the same way from ``seed + epoch`` so a state saved by one reads the same samples in the other.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ftlaunch import env
from ftlaunch.errors import ConfigurationError

#: ``torch.Generator.manual_seed`` takes at most 64 bits; ``seed + epoch`` must stay below this.
MAX_SEED = 2**64

LAUNCH_HINT_GROUPS = (
    f"launch with `ftlaunch --replicas N train.py` (it sets {env.REPLICA_GROUP_ID} and "
    f"{env.NUM_REPLICA_GROUPS}) or pass replica_group_id= and num_replica_groups="
)
LAUNCH_HINT_RANKS = (
    f"launch with `ftlaunch` or torchrun (they set {env.RANK} and {env.WORLD_SIZE}: the worker's rank "
    "and the number of workers inside its replica group) or pass rank= and num_replicas="
)


class StateRegistrar(Protocol):
    """What a sampler's ``register`` needs from a manager (``ftlaunch.Manager`` has it)."""

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None: ...


def as_int(value: object, name: str) -> int:
    """``value`` as an int; bools and floats are rejected (``True`` as a rank is always a bug)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def as_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def as_seed(value: object) -> int:
    seed = as_int(value, "seed")
    if not 0 <= seed < MAX_SEED:
        raise ValueError(f"seed must be in 0..2**64-1, got {seed}")
    return seed


def check_epoch(epoch: object, seed: int) -> int:
    e = as_int(epoch, "epoch")
    if e < 0:
        raise ValueError(f"epoch must be >= 0, got {e}")
    if seed + e >= MAX_SEED:
        raise ValueError(f"seed + epoch must be below 2**64 (torch seeds are 64-bit), got {seed + e}")
    return e


def dataset_length(dataset: Any, who: str) -> int:
    try:
        return len(dataset)
    except TypeError:
        raise TypeError(
            f"{who} needs a sized (map-style) dataset, got {type(dataset).__name__} "
            "without __len__ (an IterableDataset shards itself; it cannot use a sampler)"
        ) from None


def epoch_order(length: int, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """Epoch ``epoch``'s order of the dataset: a permutation seeded with ``seed + epoch``, or
    ``0..length-1`` -- the same on every worker of every group."""
    if not shuffle:
        return torch.arange(length)
    gen = torch.Generator()
    gen.manual_seed(seed + epoch)
    return torch.randperm(length, generator=gen)


def _from_env(value: object, name: str, env_name: str) -> tuple[int | None, str]:
    """The argument if given, else the environment variable; plus where it came from (for errors)."""
    if value is not None:
        return as_int(value, name), f"{name}={value!r}"
    from_env = env.count(env_name)  # malformed value: ConfigurationError naming the variable
    return from_env, f"{env_name}={from_env}"


def resolve_pair(
    index: object,
    count: object,
    names: tuple[str, str],
    env_names: tuple[str, str],
    hint: str,
    who: str,
    default: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """Resolve and validate an (index, count) pair such as (replica_group_id, num_replica_groups):
    the arguments, else the environment, else ``default``; `ConfigurationError` naming what is
    missing or out of range (``who`` says what cannot be told without them)."""
    (index_name, count_name), (index_env, count_env) = names, env_names
    idx, idx_src = _from_env(index, index_name, index_env)
    cnt, cnt_src = _from_env(count, count_name, count_env)
    if idx is None and cnt is None and default is not None:
        return default
    missing = [
        f"{arg} (no {arg}= given and {var} is not set)"
        for arg, var, got in ((index_name, index_env, idx), (count_name, count_env, cnt))
        if got is None
    ]
    if missing:
        raise ConfigurationError(f"{who}: missing {' and '.join(missing)}; {hint}")
    assert idx is not None and cnt is not None
    if cnt < 1:
        raise ConfigurationError(f"{count_name} must be >= 1, got {cnt_src}")
    if not 0 <= idx < cnt:
        raise ConfigurationError(f"{index_name} must be in 0..{cnt - 1}, got {idx_src} with {cnt_src}")
    return idx, cnt


def alias(value: int | None, other: int | None, name: str, other_name: str) -> int | None:
    """One of two names for the same argument (ours and torchft's); both only if they agree."""
    if other is None:
        return value
    if value is not None and value != other:
        raise TypeError(f"{name}={value!r} and {other_name}={other!r} name the same argument")
    return other
