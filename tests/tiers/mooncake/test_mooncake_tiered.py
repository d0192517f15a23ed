"""The Mooncake tier under the tiering manager ('tiered' spec, type
"mooncake"), driven by the replay engine, which verifies every loaded
block against what was stored: a second engine with a cold CPU tier reuses
what the first computed; a master killed mid-replay costs misses, never a
hang or a wrong byte, and the store serves again once it is back."""

from __future__ import annotations

import time

import pytest

from kvoffload.config import ConfigError, OffloadingConfig
from kvoffload.replay.engine import EngineOptions, ReplayEngine, replay
from kvoffload.replay.generator import generate_chat
from kvoffload.replay.traces import Trace
from kvoffload.spec import build_spec
from mooncake_helpers import PATIENT
from replay_through_a_kill import replay_through_a_kill

pytestmark = pytest.mark.mooncake


def _opts(srv, prefix: str, **tier) -> EngineOptions:
    # a deep tier queue: no cascade is dropped by back-pressure, so what the first engine computed is there
    return EngineOptions(spec="tiered", progress=False, extra_config={
        "num_cpu_chunks": 96,  # promotions hold at most half: the first prompt's 43 blocks
        "secondary_tiers": [{"type": "mooncake", "key_prefix": prefix, "max_queue_depth": 1 << 16,
                             "segment_bytes": 0, **srv.tier_config(), **PATIENT, **tier}]})


def test_second_engine_hits_what_the_first_stored(mooncake, prefix):
    trace = generate_chat(seed=3, sessions=6, block_size=64)
    # the tiers finish their writes after every step (cascades past a quarter of CPU wait in a
    # queue, and on a loaded machine a slow tier's waiting blocks could leave CPU before written)
    writer = _opts(mooncake, prefix)
    writer.sync_tiers = True
    first = replay(trace, writer)
    assert first.tiers["mooncake"]["counters"]["stored_blocks"] > 0
    assert first.counters["verify_failures"] == 0
    # a fresh engine (cold CPU tier) replays the first request again: every
    # offload hit it gets is a block the first engine computed
    one = Trace(trace.name, trace.block_size, trace.requests[:1])
    # it waits on its lookups as long as the tier's 30 s deadline (PATIENT), not the engine's own
    # patience (1,000 idle steps of 0.2 ms): on a loaded machine the existence check outlasted that
    # and the first request got 24 of its 43 blocks
    patient = _opts(mooncake, prefix)
    patient.max_delay_steps = 10**9
    second = replay(one, patient)
    c, tc = second.counters, second.tiers["mooncake"]["counters"]
    full_blocks = trace.requests[0].prompt_tokens // trace.block_size
    assert c["offload_hit_blocks"] >= full_blocks > 0
    assert tc["promoted_blocks"] >= full_blocks
    assert c["verify_failures"] == 0 and c["verified_blocks"] >= c["offload_hit_blocks"]


def test_remote_url_shorthand_picks_mooncake(mooncake, prefix):
    cfg = OffloadingConfig.from_dict({"extra_config": {
        "kv_bytes_per_chunk": 4096, "num_cpu_chunks": 8,
        "remote_url": f"{mooncake.url}&key_prefix={prefix}&segment_bytes=0"}})
    spec = build_spec("tiered", cfg)
    try:
        (tier,) = spec.get_manager().tiers
        assert tier.name == "mooncake" and tier.backend.config.master_address == mooncake.master_address
        assert tier.backend.config.key_prefix == prefix
    finally:
        spec.get_manager().shutdown()


def test_unknown_key_in_tier_entry_names_it(mooncake):
    cfg = OffloadingConfig.from_dict({"extra_config": {
        "kv_bytes_per_chunk": 4096, "num_cpu_chunks": 8,
        "secondary_tiers": [{"type": "mooncake", **mooncake.tier_config(), "segmentbytes": 0}]}})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] \(mooncake\).*'segmentbytes'.*segment_bytes"):
        build_spec("tiered", cfg)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_replay_survives_master_kill_and_restart(fresh_mooncake, prefix):
    srv = fresh_mooncake.start()
    trace = generate_chat(seed=4, sessions=20, block_size=64)
    opts = _opts(srv, prefix, rpc_timeout_s=0.5, connect_timeout_s=0.5, lookup_deadline_s=0.3,
                 backoff_initial_s=0.02, backoff_max_s=0.2)
    replay_through_a_kill(ReplayEngine(trace, opts), len(trace.requests), srv.kill_master, "mooncake")

    srv.start_master()  # a new master (its metadata is gone); clients and the store node re-register
    one = Trace(trace.name, trace.block_size, trace.requests[:1])
    again = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the node's memory is mounted again, stores fail
        replay(one, _opts(srv, prefix))
        again = replay(one, _opts(srv, prefix))  # a fresh engine (cold CPU tier) hits them
        if again.tiers["mooncake"]["counters"].get("promoted_blocks", 0) > 0:
            break
    assert again.tiers["mooncake"]["counters"]["promoted_blocks"] > 0
    assert again.counters["offload_hit_blocks"] > 0 and again.counters["verify_failures"] == 0
