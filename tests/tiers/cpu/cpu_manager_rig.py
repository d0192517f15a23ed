"""Keys and moves shared by the CPUOffloadingManager tests."""

from kvoffload.keys import make_offload_key

POLICIES = ["lru", "arc"]


def K(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), group)


def keys(*ids):
    return [K(i) for i in ids]


def store(m, ks, ctx=None):
    out = m.prepare_store(ks, ctx)
    assert out is not None
    m.complete_store(ks, ctx)
    return out


def snapshot(m):
    return (dict(m._slot_of), list(m._state), list(m._free), m._num_pinned, m._num_pending, len(m.policy))
