"""How the PG transport groups a state's tensors into messages (`pg_transport.messages`): every
message is one process-group op, so small tensors travel packed, large ones alone, empty ones not
at all -- and both sides derive the same messages from the header's sizes alone."""

from __future__ import annotations

from ftlaunch.checkpointing.pg_transport import PACK_BELOW, PACK_BYTES, messages


def test_small_tensors_travel_packed_and_large_ones_alone() -> None:
    small, big = 4096, PACK_BELOW
    assert messages([small, small, big, small, 0, small]) == [[2], [0, 1, 3, 5]]


def test_every_non_empty_tensor_is_in_exactly_one_message_in_order() -> None:
    sizes = [(i * 7919) % (3 * PACK_BELOW) for i in range(500)]
    msgs = messages(sizes)
    flat = [i for m in msgs for i in m]
    assert sorted(flat) == [i for i, n in enumerate(sizes) if n]
    for m in msgs:
        assert m == sorted(m)
        if len(m) > 1:
            assert all(sizes[i] < PACK_BELOW for i in m) and sum(sizes[i] for i in m) <= PACK_BYTES


def test_a_pack_is_cut_at_its_byte_limit() -> None:
    n = PACK_BELOW - 1
    per_pack = PACK_BYTES // n
    msgs = messages([n] * (per_pack + 1))
    assert [len(m) for m in msgs] == [per_pack, 1]


def test_a_state_of_hundreds_of_small_tensors_is_a_few_ops() -> None:
    assert len(messages([80_000] * 212)) == 2  # the 2 x 2 HSDP shards on the GPU check: 212 ops before
    assert messages([]) == [] and messages([0, 0]) == []


def test_unpacked_every_tensor_travels_alone() -> None:
    """The CPU default: no copy into a pack, each tensor lands in place."""
    assert messages([4096, 0, PACK_BELOW, 7], packed=False) == [[0], [2], [3]]
