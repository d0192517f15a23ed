"""store_threshold on the CPU spec, as vLLM's CPU spec reads it: a chunk is
stored on its Nth offer; until then vLLM is told "done" (no keys), and the
chunks it skipped count as dropped stores."""

from __future__ import annotations

import pytest

from kvoffload.abstractions import LookupResult, ReqContext
from kvoffload.config import ConfigError, OffloadingConfig
from kvoffload.keys import make_offload_key
from kvoffload.spec import build_spec


def cfg(extra):
    return OffloadingConfig.from_dict({"groups": [16], "tokens_per_hash": 16, "extra_config": {
        "num_cpu_chunks": 16, "kv_bytes_per_chunk": 8192, **extra}})


def K(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "little"), 0)


def _store(m, keys, name):
    ctx = ReqContext(name)
    out = m.prepare_store(keys, ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    return out.keys_to_store


def test_default_stores_on_the_first_offer():
    m = build_spec("cpu", cfg({})).get_manager()
    assert _store(m, [K(1), K(2)], "a") == [K(1), K(2)]


def test_a_chunk_is_stored_on_its_nth_offer():
    m = build_spec("cpu", cfg({"store_threshold": 3})).get_manager()
    prefix = [K(1), K(2)]
    assert _store(m, prefix + [K(10)], "a") == []  # seen once: vLLM hears "done", nothing copied
    assert _store(m, prefix + [K(20)], "b") == []
    assert m.lookup(K(1), ReqContext("c")) is LookupResult.MISS
    assert _store(m, prefix + [K(30)], "c") == prefix  # the shared prefix, on its third offer
    assert m.lookup(K(1), ReqContext("d")) is LookupResult.HIT
    assert m.get_stats().counters["dropped_stores"] == 3 + 3 + 1


def test_the_cut_is_prefix_closed_and_stored_chunks_stay():
    m = build_spec("cpu", cfg({"store_threshold": 2})).get_manager()
    _store(m, [K(1)], "a")
    _store(m, [K(2)], "b")  # K(1), K(2): one offer each
    assert _store(m, [K(1)], "c") == [K(1)]  # K(1): second offer, stored
    # K(3) is new (first offer) ahead of K(2) (second): K(2) is behind a refused chunk
    assert _store(m, [K(1), K(3), K(2)], "d") == []  # K(1) is already stored: nothing new
    assert m.lookup(K(2), ReqContext("x")) is LookupResult.MISS
    assert _store(m, [K(1), K(3), K(2)], "e") == [K(3), K(2)]
    assert m.lookup(K(1), ReqContext("y")) is LookupResult.HIT


@pytest.mark.parametrize("extra, message", [
    ({"store_threshold": 0}, "store_threshold"),
    ({"store_threshold": "2"}, "store_threshold"),
    ({"max_tracker_size": -1}, "max_tracker_size"),
])
def test_bad_values_are_refused(extra, message):
    with pytest.raises(ConfigError, match=message):
        build_spec("cpu", cfg(extra))


def test_the_tiered_spec_refuses_it_on_its_cpu_tier(tmp_path):
    """The tiered spec promotes into the CPU tier through prepare_store: a
    threshold there would refuse promotions (vLLM's tiering spec refuses it too)."""
    with pytest.raises(ConfigError, match="store_threshold"):
        build_spec("tiered", cfg({"store_threshold": 2, "secondary_tiers": [
            {"type": "storage", "path": str(tmp_path), "capacity_bytes": "1MiB"}]}))
