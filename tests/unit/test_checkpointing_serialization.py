"""Safe state-dict serialization: exact round trips, strict validation, corruption detection, no pickle."""

from __future__ import annotations

import collections
import json
import math
import os
import pickle
import random
import resource
import struct
import sys
import warnings
import zlib
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftlaunch.checkpointing.serialization.buffers import byte_view, prefault, tensor_bytes
from ftlaunch.checkpointing.serialization.checksum import (
    BLOCK_BYTES,
    IncrementalChecksum,
    checksum,
    checksum_reference,
)
from ftlaunch.checkpointing.serialization.encode import dumps, encode
from ftlaunch.checkpointing.serialization.header import FRAME_PREFIX_LEN, parse_frame_prefix, parse_header
from ftlaunch.checkpointing.serialization.receive import loads, plan_slots
from ftlaunch.checkpointing.serialization.spec import DTYPES, MAGIC, MAX_DEPTH, MAX_HEADER_BYTES
from ftlaunch.errors import CheckpointTransportError

# --------------------------------------------------------------------------------------------------
# shared helpers (also imported by the transport tests)


def random_tensor(g: torch.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (so NaN payloads, odd bools etc. are covered)."""
    n = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def make_state(seed: int = 0, big: int = 0) -> dict:
    """A nested state dict exercising every supported leaf; deterministic for a seed.

    ``big`` adds that many float32 elements in one extra tensor (to make transfers take a while).
    """
    g = torch.Generator().manual_seed(seed)
    base = random_tensor(g, torch.float32, (6, 10))
    cplx = random_tensor(g, torch.complex64, (3, 4))
    tied = torch.randn(5, generator=g)
    state: dict[Any, Any] = {
        "model": collections.OrderedDict(
            (f"t_{name}", random_tensor(g, dtype, (3, 5))) for name, dtype in sorted(DTYPES.items())
        ),
        "views": {
            "transposed": base.t(),  # non-contiguous
            "strided": base[::2, 1::3],  # non-contiguous, storage offset
            "offset": base[1],  # contiguous view at a 40-byte storage offset
            "conj": cplx.conj(),  # conjugate bit
            "neg": torch.randn(4, 2, dtype=torch.complex64, generator=g).conj().imag,
        },
        "empty": [torch.empty(0), torch.empty(3, 0, 2, dtype=torch.int64), torch.empty(0, dtype=torch.bool)],
        "scalars": (torch.tensor(3.5), torch.tensor(7, dtype=torch.int16), torch.tensor(True)),
        "odd": random_tensor(g, torch.uint8, (13,)),  # not a multiple of 8 bytes
        "tied_a": tied,
        "tied_b": tied,
        "param": torch.nn.Parameter(torch.randn(2, 3, generator=g)),
        "leaves": [
            None,
            True,
            False,
            0,
            -(2**70),
            3,
            2.5,
            -0.0,
            float("nan"),
            float("inf"),
            float("-inf"),
            "ünï",
        ],
        7: {"int key": 1, 3: "three"},
        "meta": {"size": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu")},
        "manager": {"step": 12, "batches_committed": 96},
    }
    if big:
        state["big"] = torch.randn(big, generator=g)
    return state


def _same_float(a: float, b: float) -> bool:
    return struct.pack("<d", a) == struct.pack("<d", b)


def assert_state_equal(got: Any, want: Any, path: str = "state") -> None:
    """Deep equality that is exact for tensors (bytes, dtype, shape) and floats (NaN, -0.0)."""
    assert type(got) is type(want) or (type(want) is torch.nn.Parameter and type(got) is torch.Tensor), (
        f"{path}: {type(got)} != {type(want)}"
    )
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{path}: {got.dtype}{got.shape}"
        w = want.detach().resolve_conj().resolve_neg().contiguous()
        assert torch.equal(tensor_bytes(got.contiguous()), tensor_bytes(w)), f"{path}: data differs"
    elif isinstance(want, dict):
        assert list(got.keys()) == list(want.keys()), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_state_equal(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_state_equal(a, b, f"{path}[{i}]")
    elif isinstance(want, float):
        assert _same_float(got, want), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def frame_json(doc: Any) -> bytes:
    """Frame an arbitrary JSON document with a *valid* crc, to test validation beyond the crc."""
    raw = json.dumps(doc).encode()
    return MAGIC + struct.pack("<QI", len(raw), zlib.crc32(raw)) + raw


def split_payload(data: bytes) -> tuple[dict, bytes]:
    length = parse_frame_prefix(data)
    return json.loads(data[FRAME_PREFIX_LEN : FRAME_PREFIX_LEN + length]), data[FRAME_PREFIX_LEN + length :]


# --------------------------------------------------------------------------------------------------
# round trips


def test_round_trip_every_leaf_kind() -> None:
    state = make_state(1)
    out = loads(dumps(state, step=12), expected_step=12)
    assert_state_equal(out, state)
    assert type(out["model"]) is collections.OrderedDict and type(out["scalars"]) is tuple
    assert out["tied_a"] is out["tied_b"], "a tensor shared in the state is shared after decoding"
    assert out["param"].requires_grad and not out["model"]["t_float32"].requires_grad
    assert all(t.is_contiguous() for t in out["views"].values())


def test_dtype_whitelist_covers_common_dtypes() -> None:
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "complex64",
        "complex128",
        "int8",
        "int16",
        "int32",
    ):
        assert name in DTYPES
    for name in ("int64", "uint8", "bool"):
        assert name in DTYPES
    assert "qint8" not in DTYPES and "quint8" not in DTYPES


def test_shared_tensor_travels_once() -> None:
    t = torch.randn(1000)
    once = len(dumps({"a": t}))
    twice = len(dumps({"a": t, "b": t}))
    assert twice - once < 100, "a tied tensor must not be sent twice"


def test_template_receives_in_place() -> None:
    state = make_state(2)
    data = dumps(state, step=3)
    mine = make_state(99)  # same structure, other values
    keep = {k: (v, v.data_ptr()) for k, v in mine["model"].items()}
    wrong_shape = torch.zeros(7)
    mine["odd"] = wrong_shape
    out = loads(data, expected_step=3, template=mine)
    assert_state_equal(out, state)
    for k, (t, ptr) in keep.items():
        assert out["model"][k] is t and t.data_ptr() == ptr, f"{k} was not received in place"
    assert out["odd"] is not wrong_shape and wrong_shape.abs().sum() == 0, (
        "mismatched shapes are never written"
    )


def test_template_tensor_is_not_reused_for_two_sources() -> None:
    a, b = torch.randn(4), torch.randn(4)
    shared = torch.zeros(4)
    out = loads(dumps({"a": a, "b": b}), template={"a": shared, "b": shared})
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 65535, 65536, 65537, 3 * 65536 + 13, 11 * 65536])
def test_checksum_matches_reference(n: int) -> None:
    data = os.urandom(n)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    want = checksum_reference(data)
    assert checksum(t) == want
    inc = IncrementalChecksum(t)
    cuts = sorted(set(range(0, n, 2 * BLOCK_BYTES)) | {n})
    pieces = list(zip(cuts, cuts[1:], strict=False))
    random.Random(n).shuffle(pieces)  # any order, as parallel connections deliver them
    for lo, hi in pieces:
        inc.update(lo, hi)
    assert inc.digest() == want


def test_checksum_wraps_modulo_2_64() -> None:
    words = [2**64 - 1] * 70000 + [12345]
    data = b"".join(w.to_bytes(8, "little") for w in words)
    assert checksum(torch.frombuffer(bytearray(data), dtype=torch.uint8)) == checksum_reference(data)


def test_checksum_of_misaligned_view() -> None:
    base = torch.arange(100, dtype=torch.float32)
    view = base[1:]  # 4-byte storage offset: cannot be viewed as int64 in place
    assert checksum(view) == checksum_reference(bytes(byte_view(view.clone())))


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux only")
def test_prefault_backs_fresh_memory_without_changing_it() -> None:
    # 64 MiB: above glibc's largest mmap threshold, so the pages are new to the process.
    t = torch.empty(64 << 20, dtype=torch.uint8)
    if not prefault(t):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    before = _minor_faults()
    tensor_bytes(t)[::4096].fill_(7)  # one write per page
    assert _minor_faults() - before < 1000, "pages were not backed by prefault"  # 16384 pages otherwise
    # contents are never changed, and ranges, odd edges and empty tensors are fine
    u = torch.arange(300_000, dtype=torch.int64)
    want = u.clone()
    assert prefault(u, 12_345, 1_000_001) and prefault(u[1:]) and prefault(u, 5, 5)
    assert prefault(torch.empty(0)) and prefault(torch.empty(3, 0, dtype=torch.bool))
    assert torch.equal(u, want)
    assert not prefault(torch.empty(10, device="meta"))


def test_plan_slots_marks_fresh_allocations() -> None:
    state = {"a": torch.randn(4, 5), "b": torch.arange(6), "c": torch.zeros(3)}
    header = encode(state, 1, device=torch.device("cpu")).header
    fresh = plan_slots(header, torch.device("cpu"))
    assert all(s.fresh and s.landing is s.target for s in fresh)
    mine = {"a": torch.zeros(4, 5), "b": torch.zeros(7, dtype=torch.int64)}  # "b": wrong shape
    slots = plan_slots(header, torch.device("cpu"), template=mine)
    by_index = {s.entry.index: s for s in slots}
    assert not by_index[0].fresh and by_index[0].target is mine["a"]
    assert by_index[1].fresh and by_index[2].fresh


def test_fresh_tensors_are_independent() -> None:
    """Every received tensor owns its storage (not a view into a shared receive buffer): freeing,
    resizing or keeping one alone behaves as for any tensor the caller allocated."""
    state = make_state(5, big=70_000)
    out = loads(dumps(state, step=2), expected_step=2)
    seen = set()
    for t in [*out["model"].values(), out["big"], out["odd"], *out["scalars"]]:
        st_ = t.untyped_storage()
        assert st_.nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0
        assert st_.data_ptr() not in seen
        seen.add(st_.data_ptr())
    big = out["big"]
    big.resize_(big.numel() * 2)  # a storage of its own can grow
    assert torch.equal(big[:70_000], state["big"])


# --------------------------------------------------------------------------------------------------
# misuse on the sending side


@pytest.mark.parametrize(
    "bad",
    [
        {"x": object()},
        {"x": {1, 2}},
        {"x": b"bytes"},
        {(1, 2): 3},
        {"x": torch.zeros(2).to_sparse()},
        {"x": torch.zeros(2, device="meta")},
        "quantized",
    ],
)
def test_unsupported_values_are_rejected(bad: Any) -> None:
    if bad == "quantized":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensors are deprecated, but still exist
            bad = {"x": torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8)}
    with pytest.raises(TypeError):
        dumps(bad)


def test_cycles_are_rejected() -> None:
    a: list[Any] = [1]
    a.append(a)
    with pytest.raises(ValueError, match="cycle"):
        dumps({"a": a})


# --------------------------------------------------------------------------------------------------
# the receiving side: everything malformed is a CheckpointTransportError


def test_pickle_payload_is_rejected() -> None:
    evil = pickle.dumps({"w": torch.zeros(3)})
    with pytest.raises(CheckpointTransportError, match="magic"):
        loads(evil)
    with pytest.raises(CheckpointTransportError):
        parse_header(evil)


def test_wrong_step_is_rejected() -> None:
    with pytest.raises(CheckpointTransportError, match="step 4, expected step 5"):
        loads(dumps({"a": torch.zeros(1)}, step=4), expected_step=5)


def test_every_header_byte_flip_is_detected() -> None:
    data = dumps({"w": torch.randn(3, 3), "lr": 0.1, "name": "x"}, step=1)
    length = parse_frame_prefix(data)
    for i in range(FRAME_PREFIX_LEN + length):
        bad = bytearray(data)
        bad[i] ^= 0x20
        with pytest.raises(CheckpointTransportError):
            loads(bytes(bad))


def test_body_corruption_is_detected() -> None:
    state = {"w": torch.randn(100_000), "b": torch.arange(10)}
    data = dumps(state)
    _doc, body = split_payload(data)
    start = len(data) - len(body)
    rng = random.Random(0)
    for _ in range(50):
        bad = bytearray(data)
        bad[start + rng.randrange(len(body) - 80)] ^= 1 << rng.randrange(8)  # skip the trailing tensor's pad
        with pytest.raises(CheckpointTransportError, match="checksum mismatch"):
            loads(bytes(bad))


def test_truncation_and_extension_are_detected() -> None:
    data = dumps(make_state(3))
    for cut in (0, 5, FRAME_PREFIX_LEN, FRAME_PREFIX_LEN + 10, len(data) // 2, len(data) - 1):
        with pytest.raises(CheckpointTransportError):
            loads(data[:cut])
    with pytest.raises(CheckpointTransportError, match="body"):
        loads(data + b"\0")


def _valid_doc() -> tuple[dict, bytes]:
    return split_payload(dumps({"a": torch.arange(4, dtype=torch.int32), "b": [1.5, torch.ones(2)]}, step=2))


def _mutations() -> list[tuple[str, Any]]:
    def set_(path: list[Any], value: Any) -> Any:
        def apply(doc: dict) -> dict:
            node = doc
            for p in path[:-1]:
                node = node[p]
            node[path[-1]] = value
            return doc

        return apply

    def drop(key: str) -> Any:
        def apply(doc: dict) -> dict:
            del doc[key]
            return doc

        return apply

    return [
        ("not an object", lambda d: [d]),
        ("missing key", drop("tree")),
        ("extra key", set_(["extra"], 1)),
        ("format", set_(["format"], "torch.save")),
        ("version", set_(["version"], 2)),
        ("byte order", set_(["byteorder"], "big" if os.sys.byteorder == "little" else "little")),
        ("checksum kind", set_(["checksum"], "none")),
        ("step type", set_(["step"], "2")),
        ("negative body", set_(["body_nbytes"], -1)),
        ("dtype not allowed", set_(["tensors", 0, "dtype"], "object")),
        ("quantized dtype", set_(["tensors", 0, "dtype"], "qint8")),
        ("negative shape", set_(["tensors", 0, "shape"], [-4])),
        ("float shape", set_(["tensors", 0, "shape"], [4.0])),
        ("nbytes mismatch", set_(["tensors", 0, "nbytes"], 12)),
        ("offset out of bounds", set_(["tensors", 1, "offset"], 10**9)),
        ("overlap", set_(["tensors", 1, "offset"], 8)),
        ("bool offset", set_(["tensors", 0, "offset"], True)),
        ("bad sum", set_(["tensors", 0, "sum"], "zz")),
        ("requires_grad type", set_(["tensors", 0, "requires_grad"], 1)),
        ("entry keys", set_(["tensors", 0, "pickle"], "x")),
        ("unreferenced tensor", set_(["tree"], {"dict": [["a", {"tensor": 0}]]})),
        ("tensor ref out of range", set_(["tree"], {"list": [{"tensor": 0}, {"tensor": 1}, {"tensor": 2}]})),
        ("unknown tag", set_(["tree"], {"pickle": "gASV"})),
        ("two tags", set_(["tree"], {"list": [], "tuple": []})),
        ("bad float", set_(["tree"], {"list": [{"tensor": 0}, {"tensor": 1}, {"float": "1.5q"}]})),
        ("bad dict key", set_(["tree"], {"dict": [[[1], {"tensor": 0}], ["b", {"tensor": 1}]]})),
        ("bare float", set_(["tree"], {"list": [{"tensor": 0}, {"tensor": 1}, 1.5]})),
        ("bad device", set_(["tree"], {"list": [{"tensor": 0}, {"tensor": 1}, {"device": "floppy:3"}]})),
        ("bad dtype leaf", set_(["tree"], {"list": [{"tensor": 0}, {"tensor": 1}, {"dtype": "object"}]})),
        ("too deep", set_(["tree"], _deep({"list": [{"tensor": 0}, {"tensor": 1}]}, MAX_DEPTH + 5))),
    ]


def _deep(node: Any, depth: int) -> Any:
    for _ in range(depth):
        node = {"list": [node]}
    return node


@pytest.mark.parametrize("name,mutate", _mutations(), ids=[m[0] for m in _mutations()])
def test_schema_violations_are_rejected(name: str, mutate: Any) -> None:
    doc, body = _valid_doc()
    bad = frame_json(mutate(doc)) + body
    with pytest.raises(CheckpointTransportError, match="invalid checkpoint payload"):
        loads(bad)


def test_valid_crafted_header_is_accepted() -> None:
    """The crafted-header helper itself produces acceptable frames (so the rejections above are real)."""
    doc, body = _valid_doc()
    out = loads(frame_json(doc) + body, expected_step=2)
    assert torch.equal(out["a"], torch.arange(4, dtype=torch.int32)) and out["b"][0] == 1.5


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xfe not utf-8",
        b'{"a": NaN}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"step": ' + b"9" * 10_000 + b"}",
        b"",
    ],
    ids=["not utf-8", "NaN", "deep json", "huge int", "empty"],
)
def test_hostile_json_is_rejected(raw: bytes) -> None:
    frame = MAGIC + struct.pack("<QI", len(raw), zlib.crc32(raw)) + raw
    with pytest.raises(CheckpointTransportError):
        loads(frame)


def test_oversized_header_length_is_rejected_before_reading() -> None:
    with pytest.raises(CheckpointTransportError, match="exceeds"):
        parse_frame_prefix(MAGIC + struct.pack("<QI", MAX_HEADER_BYTES + 1, 0))


# --------------------------------------------------------------------------------------------------
# property tests

_DTYPE_LIST = sorted(DTYPES.items())


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    _name, dtype = draw(st.sampled_from(_DTYPE_LIST))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    n = math.prod(shape) * dtype.itemsize
    raw = draw(st.binary(min_size=n, max_size=n))
    t = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
        if n
        else torch.empty(shape, dtype=dtype)
    )
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)
    return t


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    tensors(),
    st.builds(torch.Size, st.lists(st.integers(0, 9), max_size=3)),
    st.sampled_from([d for _, d in _DTYPE_LIST]),
    st.sampled_from([torch.device("cpu"), torch.device("cuda:1"), torch.device("meta")]),
)
trees = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), kids, max_size=4),
        st.dictionaries(st.text(max_size=5), kids, max_size=4).map(collections.OrderedDict),
    ),
    max_leaves=20,
)

_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(tree=trees, step=st.integers(-(2**63), 2**63 - 1))
def test_property_round_trip(tree: Any, step: int) -> None:
    assert_state_equal(loads(dumps(tree, step=step), expected_step=step), tree)


@_SETTINGS
@given(tree=trees, data=st.data())
def test_property_corruption_never_escapes(tree: Any, data: st.DataObject) -> None:
    """Random byte flips, truncations and extensions: either detected or harmless (padding)."""
    payload = bytearray(dumps(tree, step=1))
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(payload) - 1))
            payload[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        del payload[data.draw(st.integers(0, len(payload) - 1)) :]
    else:
        payload += data.draw(st.binary(min_size=1, max_size=16))
    try:
        out = loads(bytes(payload), expected_step=1)
    except CheckpointTransportError:
        return
    assert kind == "flip"
    assert_state_equal(out, tree)  # only flips in padding may pass, and then nothing changed


@_SETTINGS
@given(raw=st.binary(max_size=200))
def test_property_garbage_is_rejected(raw: bytes) -> None:
    for candidate in (raw, MAGIC + raw, MAGIC + struct.pack("<QI", len(raw), zlib.crc32(raw)) + raw):
        with pytest.raises(CheckpointTransportError):
            loads(candidate)


def test_checksums_may_follow_the_body_in_a_sums_frame() -> None:
    """A streaming sender's header has pending sums; the sums frame fills them in, protected by its
    own crc32, and a receiver takes pending sums only where it asked for them."""
    from ftlaunch.checkpointing.serialization.checksum import checksums
    from ftlaunch.checkpointing.serialization.header import (
        PENDING_SUM,
        frame_sums,
        parse_header,
        parse_sums,
        sums_frame_nbytes,
        with_sums,
    )

    state = {"w": torch.randn(3000), "b": torch.arange(5), "empty": torch.zeros(0)}
    enc = encode(state, 4, torch.device("cpu"), sums=False)
    header = parse_header(enc.frame, 4, sums_follow=True)
    assert all(e.sum == PENDING_SUM for e in header.tensors)
    with pytest.raises(CheckpointTransportError, match="bad checksum"):
        parse_header(enc.frame, 4)
    with pytest.raises(CheckpointTransportError, match="where the sums frame was to carry it"):
        parse_header(encode(state, 4, torch.device("cpu")).frame, 4, sums_follow=True)
    frame = frame_sums(checksums(enc.tensors))
    assert len(frame) == sums_frame_nbytes(len(enc.tensors))
    filled = with_sums(header, parse_sums(frame, len(enc.tensors)))
    assert filled == parse_header(encode(state, 4, torch.device("cpu")).frame, 4)
    bad = bytearray(frame)
    bad[-1] ^= 1
    with pytest.raises(CheckpointTransportError, match="sums frame checksum mismatch"):
        parse_sums(bytes(bad), len(enc.tensors))
    with pytest.raises(CheckpointTransportError, match="expected"):
        parse_sums(frame, len(enc.tensors) + 1)
