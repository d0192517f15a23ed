"""The remote tier under the tiering manager ('tiered' spec, type "redis"),
driven by the replay engine: a second engine with a cold CPU tier reuses
what the first one stored, bytes verified on load."""

from __future__ import annotations

import pytest

from kvoffload.config import ConfigError, OffloadingConfig
from kvoffload.replay.engine import EngineOptions, replay
from kvoffload.replay.generator import generate_chat
from kvoffload.spec import build_spec

pytestmark = pytest.mark.redis


def _opts(url: str, prefix: str) -> EngineOptions:
    return EngineOptions(spec="tiered", progress=False, extra_config={
        "num_cpu_chunks": 64,
        "secondary_tiers": [{"type": "redis", "url": url, "key_prefix": prefix}]})


def test_second_engine_hits_what_the_first_stored(redis_server, prefix):
    trace = generate_chat(seed=3, sessions=6, block_size=64)
    first = replay(trace, _opts(redis_server.url, prefix))
    assert first.tiers["redis"]["counters"]["stored_blocks"] > 0
    second = replay(trace, _opts(redis_server.url, prefix))
    c, rc = second.counters, second.tiers["redis"]["counters"]
    assert rc["promoted_blocks"] > 0 and c["offload_hit_blocks"] > first.counters["offload_hit_blocks"]
    assert c["verify_failures"] == 0 and c["verified_blocks"] >= c["offload_hit_blocks"]


def test_unknown_key_in_tier_entry_names_it(redis_server):
    cfg = OffloadingConfig.from_dict({"extra_config": {
        "kv_bytes_per_chunk": 4096, "num_cpu_chunks": 8,
        "secondary_tiers": [{"type": "redis", "url": redis_server.url, "urll": "x"}]}})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] \(redis\).*'urll'"):
        build_spec("tiered", cfg)
