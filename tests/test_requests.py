"""Per-request helpers: prefix order and the rest of a prefix, from the key
positions the scheduler records on a ReqContext."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvoffload.abstractions import ReqContext
from kvoffload.keys import make_offload_key
from kvoffload.requests import prefix_order, rest_of_prefix


def key(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), group)


def test_prefix_order_by_position_keys_without_one_last():
    ctx = ReqContext("r")
    for i in range(4):
        ctx.set_offload_key_position(key(i), 16 * (i + 1))
    assert prefix_order([key(2), key(0), key(3), key(1)], ctx) == [key(i) for i in range(4)]
    assert prefix_order([key(9), key(2), key(0)], ctx) == [key(0), key(2), key(9)]
    assert prefix_order([key(2), key(0)], None) == [key(2), key(0)]  # no context: as given
    assert prefix_order([key(2), key(0)], ReqContext("empty")) == [key(2), key(0)]


def test_rest_of_prefix_sees_keys_added_later():
    ctx = ReqContext("r")
    for i in range(3):
        ctx.set_offload_key_position(key(i), 16 * (i + 1))
    assert rest_of_prefix(key(0), ctx) == [key(1), key(2)]
    assert rest_of_prefix(key(2), ctx) == []
    assert rest_of_prefix(key(7), ctx) == []  # no position: nothing known after it
    ctx.set_offload_key_position(key(3), 64)  # the scheduler adds keys as the request grows
    assert rest_of_prefix(key(1), ctx) == [key(2), key(3)]


def test_shared_positions_are_live():
    engine_positions = {}
    ctx = ReqContext("r")
    ctx.share_offload_key_positions(engine_positions)
    engine_positions[key(0)] = 16
    engine_positions[key(1)] = 32
    assert ctx.get_offload_key_position(key(1)) == 32
    assert rest_of_prefix(key(0), ctx) == [key(1)]


@given(st.lists(st.integers(0, 50), unique=True, min_size=1, max_size=30), st.data())
def test_rest_of_prefix_is_the_keys_positioned_after(positions, data):
    ctx = ReqContext("r")
    for i, p in enumerate(positions):
        ctx.set_offload_key_position(key(i), p)
    i = data.draw(st.integers(0, len(positions) - 1))
    rest = rest_of_prefix(key(i), ctx)
    assert rest == sorted((key(j) for j, p in enumerate(positions) if p > positions[i]),
                          key=lambda k: positions[int.from_bytes(k[:8], "big")])
