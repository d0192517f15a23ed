"""A small replay publishing KV events over real ZMQ and metrics over real HTTP."""

import time
import urllib.request

import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.abstractions import LookupResult, ReqContext
from kvoffload.events import EventEncoder, ZmqEventPublisher, decode_batch
from kvoffload.keys import make_offload_key
from kvoffload.metrics import PrometheusMetrics
from kvoffload.replay.engine import EngineOptions, ReplayEngine
from kvoffload.replay.generator import generate_chat


def _subscribe(pub):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(pub.endpoint)
    deadline = time.monotonic() + 120  # generous: a loaded machine delays ZMQ's I/O threads
    while time.monotonic() < deadline:  # PUB drops until the subscription arrives
        pub.publish_cleared()
        if sub.poll(50):
            sub.recv_multipart()
            return sub
    raise AssertionError("subscription never propagated")


def test_replay_events_cover_every_store_and_eviction():
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", encoder=EventEncoder(int_hashes=False))  # bytes: probed below
    sub = _subscribe(pub)
    trace = generate_chat(seed=5, sessions=12, block_size=64)
    engine = ReplayEngine(trace, EngineOptions(extra_config={"num_cpu_chunks": 160}, progress=False, events=pub))
    try:
        result = engine.run()
        cpu = result.tiers["cpu"]["counters"]
        held: set[bytes] = set()
        stored = removed = 0
        # Read until every announced store and eviction has arrived (a loaded machine delays
        # ZMQ's I/O thread: a quiet gap is not the end), then whatever else comes.
        deadline = time.monotonic() + 120
        while sub.poll(200) or ((stored, removed) != (cpu["stored_blocks"], cpu["evictions"])
                                and time.monotonic() < deadline):
            if not sub.poll(0):
                continue
            _topic, _seq, payload = sub.recv_multipart()
            for ev in decode_batch(payload)[1]:
                hashes = ev["block_hashes"]
                if ev["type"] == "BlockStored":
                    assert ev["medium"] == "CPU" and ev["block_size"] == 64 and ev["group_idx"] == 0
                    assert not held.intersection(hashes), "a block announced twice without removal"
                    held.update(hashes)
                    stored += len(hashes)
                elif ev["type"] == "BlockRemoved":
                    assert held.issuperset(hashes), "removal of a block never announced"
                    held.difference_update(hashes)
                    removed += len(hashes)
        assert removed == cpu["evictions"] > 0
        assert stored == cpu["stored_blocks"]
        # What the events say is held is exactly what the manager holds.
        ctx = ReqContext("probe")
        assert held and all(engine.manager.lookup(make_offload_key(h, 0), ctx) is LookupResult.HIT
                            for h in held)
        assert len(held) == result.tiers["cpu"]["gauges"]["used_blocks"]
    finally:
        engine.close()
        sub.close()
        pub.close()


def test_replay_metrics_scraped_over_http():
    metrics = PrometheusMetrics()
    port = metrics.serve(0)
    trace = generate_chat(seed=6, sessions=8, block_size=64)
    engine = ReplayEngine(trace, EngineOptions(extra_config={"num_cpu_chunks": 400}, progress=False,
                                               metrics=metrics))
    try:
        result = engine.run()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=120) as r:
            text = r.read().decode()
    finally:
        engine.close()
        metrics.close()
    values = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("tier") == "cpu":
                values[(s.name, s.labels.get("direction"))] = s.value
    cpu = result.tiers["cpu"]["counters"]
    assert values[("kvoffload_hits_total", None)] == cpu["hits"] > 0
    assert values[("kvoffload_stored_blocks_total", None)] == cpu["stored_blocks"]
    assert values[("kvoffload_transfer_bytes_count", "load")] == result.counters["load_jobs"]
    assert values[("kvoffload_transfer_bytes_sum", "store")] == result.counters["bytes_stored"]
    # `kvoffload stats` and the replay report name the same lookup hit rate
    # and agree on it; the replay's prefix hit rate is a different, lower figure
    from kvoffload.replay.report import summary
    from kvoffload.stats import parse_metrics

    tier = summary(result)["tiers"]["cpu"]
    assert parse_metrics(text)["cpu"]["lookup_hit_rate"] == tier["lookup_hit_rate"] == cpu["hits"] / cpu["lookups"]
    assert tier["prefix_hit_rate"] < tier["lookup_hit_rate"]


def test_bad_event_endpoint_is_a_clear_cli_error(capsys):
    from kvoffload.cli import main

    assert main(["replay", "--no-progress", "--events-endpoint", "nonsense://x"]) == 2
    assert "cannot bind KV event endpoint 'nonsense://x'" in capsys.readouterr().err
