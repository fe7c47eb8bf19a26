"""The header's ``tree``: how a nested state dict maps to JSON nodes, in both directions.

Why here, together: the sender's encoder, the receiver's validator, the rebuild and the
in-place matcher all walk the same node tags (see docs/checkpointing.md, "Tree nodes"); keeping
them side by side keeps the format's one definition in one place. Tensors are not in the tree:
a ``{"tensor": i}`` node refers to entry ``i`` of the header's tensor list.

Receivers run `validate` before anything else touches a received tree, so `build` and
`match_templates` may assume a well-formed one.
"""

from __future__ import annotations

import collections
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ftlaunch.checkpointing.serialization.spec import DTYPE_NAMES, DTYPES, MAX_DEPTH, invalid, is_int

__all__ = ["TreeEncoder", "build", "match_templates", "validate"]


# --------------------------------------------------------------------------------------------------
# floats (exact text both ways)


def float_text(x: float) -> str:
    """Exact text for a float: ``float.hex`` (covers inf and -0.0), NaN as ``nan:<64-bit pattern>``
    because ``float.hex`` drops a NaN's sign and payload."""
    if x != x:
        return "nan:" + struct.pack(">d", x).hex()
    return x.hex()


def float_value(text: str) -> float:
    """The float `float_text` wrote; ValueError (or OverflowError, struct.error) for anything else."""
    if text.startswith("nan:"):
        bits = text[4:]
        if len(bits) != 16:
            raise ValueError(text)
        x = struct.unpack(">d", bytes.fromhex(bits))[0]
        if x == x:
            raise ValueError(text)
        return x
    if "nan" in text.lower():
        raise ValueError(text)
    return float.fromhex(text)


# --------------------------------------------------------------------------------------------------
# encoding (sender)


class TreeEncoder:
    """Turns a state dict into tree nodes, collecting its tensors (each distinct tensor once).

    ``tensors[i]`` is contiguous, detached and on ``device`` (when given); for contiguous tensors
    already there it shares their storage (no copy). Unsupported values raise TypeError/ValueError
    naming their path (``state_dict.optim.state[3]...``): that is misuse on the sending side.
    """

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.tensors: list[torch.Tensor] = []
        self.requires_grad: list[bool] = []
        self.seen: dict[int, int] = {}  # id(tensor) -> index, so shared (tied) tensors travel once
        self.keepalive: list[torch.Tensor] = []  # keeps ids in `seen` unique during encoding
        self.active: set[int] = set()  # containers on the current path (cycle detection)

    def node(self, x: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"state dict nested deeper than {MAX_DEPTH} at {path}")
        if x is None or isinstance(x, (bool, str)) or type(x) is int:
            return x
        if type(x) is float:
            return {"float": float_text(x)}
        if isinstance(x, torch.Tensor):
            return {"tensor": self.tensor(x, path)}
        if isinstance(x, torch.Size):
            return {"size": list(x)}
        if isinstance(x, torch.dtype):
            if x not in DTYPE_NAMES:
                raise TypeError(f"dtype {x} at {path} is not supported")
            return {"dtype": DTYPE_NAMES[x]}
        if isinstance(x, torch.device):
            return {"device": str(x)}
        if type(x) in (dict, collections.OrderedDict, collections.defaultdict) or type(x) in (list, tuple):
            if id(x) in self.active:
                raise ValueError(f"state dict contains a reference cycle at {path}")
            self.active.add(id(x))
            try:
                if isinstance(x, dict):
                    pairs = []
                    for k, v in x.items():
                        if not isinstance(k, (str, int)):
                            raise TypeError(f"dict key {k!r} at {path} must be str or int")
                        pairs.append([k, self.node(v, f"{path}.{k}", depth + 1)])
                    return {"odict" if type(x) is collections.OrderedDict else "dict": pairs}
                tag = "list" if type(x) is list else "tuple"
                return {tag: [self.node(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(x)]}
            finally:
                self.active.discard(id(x))
        raise TypeError(
            f"cannot encode {type(x).__name__} at {path}: only tensors, dict/list/tuple, None, bool, "
            "int, float, str, torch.Size/dtype/device are supported"
        )

    def tensor(self, t: torch.Tensor, path: str) -> int:
        if id(t) in self.seen:
            return self.seen[id(t)]
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"tensor subclass {type(t).__name__} at {path} is not supported")
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise TypeError(
                f"tensor at {path} must be a dense, materialized tensor (got {t.layout}, {t.device})"
            )
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"dtype {t.dtype} of tensor at {path} is not supported")
        p = t.detach().resolve_conj().resolve_neg()
        if self.device is not None and p.device != self.device:
            p = p.to(self.device)
        p = p.contiguous()  # no copy when already contiguous
        self.seen[id(t)] = len(self.tensors)
        self.keepalive.append(t)
        self.tensors.append(p)
        self.requires_grad.append(bool(t.requires_grad))
        return len(self.tensors) - 1


# --------------------------------------------------------------------------------------------------
# validation (receiver, before anything else)


def validate(node: Any, ntensors: int, refs: set[int], depth: int = 0) -> None:
    """Check a received tree node by node; tensor references found are added to ``refs``."""
    if depth > MAX_DEPTH:
        raise invalid(f"tree nested deeper than {MAX_DEPTH}")
    if node is None or isinstance(node, (bool, int, str)):
        return
    if not isinstance(node, dict) or len(node) != 1:
        raise invalid(f"bad tree node of type {type(node).__name__}")
    ((tag, val),) = node.items()
    if tag in ("list", "tuple"):
        if not isinstance(val, list):
            raise invalid(f"{tag} node needs a list")
        for child in val:
            validate(child, ntensors, refs, depth + 1)
    elif tag in ("dict", "odict"):
        if not isinstance(val, list):
            raise invalid(f"{tag} node needs a list of pairs")
        for pair in val:
            if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], (str, int)):
                raise invalid(f"{tag} entries must be [key, value] with a string or integer key")
            validate(pair[1], ntensors, refs, depth + 1)
    elif tag == "tensor":
        if not is_int(val) or not 0 <= val < ntensors:
            raise invalid(f"tensor reference {val!r} out of range")
        refs.add(val)
    elif tag == "float":
        if not isinstance(val, str):
            raise invalid("float node needs a hex string")
        try:
            float_value(val)
        except (ValueError, OverflowError, struct.error):
            raise invalid(f"bad float {val!r}") from None
    elif tag == "size":
        if not isinstance(val, list) or not all(is_int(s) and s >= 0 for s in val):
            raise invalid("size node needs a list of non-negative integers")
    elif tag == "dtype":
        if val not in DTYPES:
            raise invalid(f"dtype {val!r} is not allowed")
    elif tag == "device":
        try:
            torch.device(val)
        except (RuntimeError, TypeError, ValueError):
            raise invalid(f"bad device {val!r}") from None
    else:
        raise invalid(f"unknown tree node tag {tag!r}")


# --------------------------------------------------------------------------------------------------
# rebuilding (receiver, after validation)


def build(node: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The Python value of a validated node; ``{"tensor": i}`` becomes ``tensors[i]``."""
    if node is None or isinstance(node, (bool, int, str)):
        return node
    ((tag, val),) = node.items()
    if tag == "tensor":
        return tensors[val]
    if tag == "list":
        return [build(v, tensors) for v in val]
    if tag == "tuple":
        return tuple(build(v, tensors) for v in val)
    if tag == "dict":
        return {k: build(v, tensors) for k, v in val}
    if tag == "odict":
        return collections.OrderedDict((k, build(v, tensors)) for k, v in val)
    if tag == "float":
        return float_value(val)
    if tag == "size":
        return torch.Size(val)
    if tag == "dtype":
        return DTYPES[val]
    if tag == "device":
        return torch.device(val)
    raise invalid(f"unknown tree node tag {tag!r}")  # unreachable after validation


def match_templates(node: Any, template: Any, found: dict[int, torch.Tensor], depth: int = 0) -> None:
    """Walk a validated tree beside the caller's current state (``template``) and record, by tensor
    index, the caller's tensor at the same path: a candidate to receive into in place."""
    if depth > MAX_DEPTH or not isinstance(node, dict):
        return
    ((tag, val),) = node.items()
    if tag == "tensor":
        if isinstance(template, torch.Tensor) and val not in found:
            found[val] = template
    elif tag in ("dict", "odict") and isinstance(template, Mapping):
        for k, v in val:
            if k in template:
                match_templates(v, template[k], found, depth + 1)
    elif tag in ("list", "tuple") and isinstance(template, (list, tuple)) and len(template) == len(val):
        for v, t in zip(val, template, strict=True):
            match_templates(v, t, found, depth + 1)
