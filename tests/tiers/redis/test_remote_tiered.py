"""The remote tier under the tiering manager ('tiered' spec, type "redis"),
driven by the replay engine: a second engine with a cold CPU tier reuses
what the first one stored, bytes verified on load."""

from __future__ import annotations

import pytest

from kvoffload.config import ConfigError, OffloadingConfig
from kvoffload.replay.engine import EngineOptions, replay
from kvoffload.replay.generator import generate_chat
from kvoffload.replay.traces import Trace
from kvoffload.spec import build_spec

pytestmark = pytest.mark.redis


def _opts(url: str, prefix: str) -> EngineOptions:
    # a deep tier queue: no cascade is dropped by back-pressure, so what the first engine computed is there;
    # patient timeouts: on a loaded machine the defaults (0.5 s lookup deadline) can turn a HIT into a MISS
    return EngineOptions(spec="tiered", progress=False, extra_config={
        "num_cpu_chunks": 96,  # promotions hold at most half: the first prompt's 43 blocks
        "secondary_tiers": [{"type": "redis", "url": url, "key_prefix": prefix, "max_queue_depth": 1 << 16,
                             "connect_timeout_s": 30.0, "socket_timeout_s": 30.0, "lookup_deadline_s": 30.0}]})


def test_second_engine_hits_what_the_first_stored(redis_server, prefix):
    trace = generate_chat(seed=3, sessions=6, block_size=64)
    # the tiers finish their writes after every step (cascades past a quarter of CPU wait in a
    # queue, and on a loaded machine a slow tier's waiting blocks could leave CPU before written)
    writer = _opts(redis_server.url, prefix)
    writer.sync_tiers = True
    first = replay(trace, writer)
    assert first.tiers["redis"]["counters"]["stored_blocks"] > 0
    # a fresh engine (cold CPU tier) replays the first request again: every
    # offload hit it gets is a block the first engine computed
    one = Trace(trace.name, trace.block_size, trace.requests[:1])
    # and it waits on its lookups as long as the tier's 30 s deadline: CI once saw its first lookup outlast
    # the engine's own patience (1,000 idle steps of 0.2 ms) on a loaded machine, and the run had 0 hits
    patient = _opts(redis_server.url, prefix)
    patient.max_delay_steps = 10**9
    second = replay(one, patient)
    c, rc = second.counters, second.tiers["redis"]["counters"]
    full_blocks = trace.requests[0].prompt_tokens // trace.block_size
    assert c["offload_hit_blocks"] >= full_blocks > 0
    assert rc["promoted_blocks"] >= full_blocks
    assert c["verify_failures"] == 0 and c["verified_blocks"] >= c["offload_hit_blocks"]


def test_unknown_key_in_tier_entry_names_it(redis_server):
    cfg = OffloadingConfig.from_dict({"extra_config": {
        "kv_bytes_per_chunk": 4096, "num_cpu_chunks": 8,
        "secondary_tiers": [{"type": "redis", "url": redis_server.url, "urll": "x"}]}})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] \(redis\).*'urll'"):
        build_spec("tiered", cfg)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_replay_survives_server_kill_and_resumes(fresh_server, prefix):
    """Kill the server mid-replay: the replay finishes (misses, dropped
    stores, no wrong bytes); restart it and a second replay hits again."""
    from kvoffload.replay.engine import ReplayEngine
    from replay_through_a_kill import replay_through_a_kill

    srv = fresh_server.start()
    trace = generate_chat(seed=4, sessions=20, block_size=64)
    opts = _opts(srv.url, prefix)
    opts.extra_config["secondary_tiers"][0].update(
        connect_timeout_s=0.3, socket_timeout_s=0.3, lookup_deadline_s=0.3, backoff_initial_s=0.02, backoff_max_s=0.2)
    replay_through_a_kill(ReplayEngine(trace, opts), len(trace.requests), srv.kill, "redis")

    srv.start()  # empty again
    one = Trace(trace.name, trace.block_size, trace.requests[:1])
    replay(one, _opts(srv.url, prefix))  # stores into the new server
    again = replay(one, _opts(srv.url, prefix))  # a fresh engine (cold CPU tier) hits them
    assert again.tiers["redis"]["counters"]["promoted_blocks"] > 0
    assert again.counters["offload_hit_blocks"] > 0 and again.counters["verify_failures"] == 0
