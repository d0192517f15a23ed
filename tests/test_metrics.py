"""Metrics read back through a real HTTP scrape and prometheus_client's parser."""

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.abstractions import Locality, Medium, OffloadingStats
from kvoffload.metrics import PrometheusMetrics, build_metric_definitions
from kvoffload.stats import format_table, parse_metrics


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=120) as r:  # generous: a loaded machine
        return r.read().decode()


def samples(text):
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def tier_stats():
    cpu = OffloadingStats("cpu", Medium.CPU, Locality.LOCAL,
                          counters={"hits": 3, "misses": 1, "evictions": 2},
                          gauges={"used_blocks": 10, "usage": 0.5})
    disk = OffloadingStats("storage", Medium.STORAGE, Locality.LOCAL,
                           counters={"hits": 1, "checksum_failures": 1}, gauges={"usage": 0.25})
    return OffloadingStats("tiered", counters={}, children=[cpu, disk])


def test_definitions_are_prefixed_and_typed():
    defs = build_metric_definitions({})
    assert all(name.startswith("kvoffload_") for name in defs)
    assert "kvoffload_hits" in defs and "kvoffload_transfer_seconds" in defs
    assert defs["kvoffload_hits"].labelnames == ("tier", "medium", "locality")


def test_http_scrape_round_trip():
    m = PrometheusMetrics(config_info={"policy": "lru", "cpu_bytes": 1 << 30})
    port = m.serve(0)
    try:
        m.record_stats(tier_stats())
        m.record_stats(tier_stats())  # counters accumulate deltas, gauges are set
        m.observe_transfer("cpu", "store", 1 << 20, 0.001, "CPU", "LOCAL")
        s = samples(scrape(port))
    finally:
        m.close()
    cpu = (("locality", "LOCAL"), ("medium", "CPU"), ("tier", "cpu"))
    assert s[("kvoffload_hits_total", cpu)] == 6
    assert s[("kvoffload_evictions_total", cpu)] == 4
    assert s[("kvoffload_used_blocks", cpu)] == 10
    disk = (("locality", "LOCAL"), ("medium", "STORAGE"), ("tier", "storage"))
    assert s[("kvoffload_checksum_failures_total", disk)] == 2
    store = (("direction", "store"),) + cpu
    assert s[("kvoffload_transfer_bytes_count", store)] == 1
    assert s[("kvoffload_transfer_bytes_sum", store)] == 1 << 20
    info = [k for k in s if k[0] == "kvoffload_config_info"]
    assert info and ("policy", "lru") in info[0][1]


def test_unknown_stat_is_still_exported():
    m = PrometheusMetrics()
    m.record_stats(OffloadingStats("cpu", Medium.CPU, Locality.LOCAL, counters={"weird_thing": 2}))
    assert "kvoffload_weird_thing_total" in m.text()


def test_stats_table_from_scrape():
    m = PrometheusMetrics()
    m.record_stats(tier_stats())
    tiers = parse_metrics(m.text())
    assert set(tiers) == {"cpu", "storage"}
    assert tiers["cpu"]["lookup_hit_rate"] == pytest.approx(0.75)  # hits / lookups (hits, misses)
    table = format_table(tiers)
    assert "cpu" in table.splitlines()[1] and "0.750" in table


def test_stats_cli_once(capsys):
    from kvoffload.cli import main

    m = PrometheusMetrics()
    port = m.serve(0)
    try:
        m.record_stats(tier_stats())
        assert main(["stats", f"127.0.0.1:{port}", "--once"]) == 0
    finally:
        m.close()
    out = capsys.readouterr().out
    assert "storage" in out and "lookup_hit_rate" in out


def test_stats_cli_unreachable(capsys):
    from kvoffload.cli import main

    assert main(["stats", "127.0.0.1:1", "--once"]) == 1
    assert "cannot scrape" in capsys.readouterr().err


def test_vllm_names_alongside_ours():
    m = PrometheusMetrics()
    cpu = OffloadingStats("cpu", Medium.CPU, Locality.LOCAL,
                          counters={"hits": 3, "misses": 1, "allocation_failures": 2},
                          gauges={"capacity_blocks": 10, "pinned_blocks": 1, "pending_blocks": 4})
    disk = OffloadingStats("storage", Medium.STORAGE, Locality.LOCAL,
                           counters={"hits": 1, "loaded_bytes": 4096, "stored_bytes": 8192})
    m.record_stats(OffloadingStats("tiered", children=[cpu, disk]))
    m.observe_transfer("cpu", "load", 1000, 0.25)
    m.observe_transfer("cpu", "store", 3000, 0.5)
    s = samples(m.text())
    assert s[("vllm:kv_offload_tiering_chunk_queries_total", (("tier", "0:primary"),))] == 4
    assert s[("vllm:kv_offload_tiering_chunk_hits_total", (("tier", "0:primary"),))] == 3
    assert s[("vllm:kv_offload_tiering_read_bytes_total", (("tier", "1:storage"),))] == 4096
    assert s[("vllm:kv_offload_tiering_write_bytes_total", (("tier", "1:storage"),))] == 8192
    assert s[("vllm:kv_offload_cpu_cache_usage_perc", ())] == 0.5
    assert s[("vllm:kv_offload_cpu_cache_write_usage_perc", ())] == 0.4
    assert s[("vllm:kv_offload_allocation_failure_total", ())] == 2
    assert s[("vllm:kv_offload_load_bytes_total", ())] == 1000
    assert s[("vllm:kv_offload_store_time_total", ())] == 0.5
    assert s[("vllm:kv_offload_store_size_count", ())] == 1
    assert s[("vllm:kv_offload_total_bytes_total", (("transfer_type", "CPU_to_GPU"),))] == 1000
    assert s[("vllm:kv_offload_total_bytes_total", (("transfer_type", "GPU_to_CPU"),))] == 3000
    assert s[("vllm:kv_offload_total_time_total", (("transfer_type", "GPU_to_CPU"),))] == 0.5


def test_vllm_names_off_and_counters_exported_from_zero():
    m = PrometheusMetrics(vllm_names=False)
    m.record_stats(OffloadingStats("cpu", Medium.CPU, Locality.LOCAL, counters={"bad_request_hints": 0}))
    m.observe_transfer("cpu", "load", 1000, 0.25)
    s = samples(m.text())
    assert not [k for k in s if k[0].startswith("vllm:")]
    # a counter a tier reports is a series from its first report, 0 included (rate() needs it)
    assert s[("kvoffload_bad_request_hints_total", (("locality", "LOCAL"), ("medium", "CPU"), ("tier", "cpu")))] == 0


@pytest.mark.parametrize("argv, message", [
    (["127.0.0.1:abc", "--once"], "bad URL '127.0.0.1:abc': Port could not be cast to integer value as 'abc'"),
    (["http://[::1", "--once"], "bad URL 'http://[::1': Invalid IPv6 URL"),
    (["http://u:hunter2@127.0.0.1:99999", "--once"], "bad URL 'http://u:***@127.0.0.1:99999': Port out of range 0-65535"),
    (["", "--once"], "bad URL '': expected host:port or an http(s):// URL"),
    (["127.0.0.1:1", "--interval", "-1"], "--interval must be a number of seconds in (0, 31536000], got -1.0"),
    (["127.0.0.1:1", "--interval", "nan"], "--interval must be a number of seconds in (0, 31536000], got nan"),
    (["127.0.0.1:1", "--interval", "inf"], "--interval must be a number of seconds in (0, 31536000], got inf"),
])
def test_stats_bad_url_or_interval_is_one_line(capsys, argv, message):
    from kvoffload.cli import main

    assert main(["stats", *argv]) == 2  # refused before any scrape (or sleep)
    err = capsys.readouterr().err
    assert err.splitlines() == [f"kvoffload stats: {message}"]


def test_stats_appends_metrics_before_a_query():
    from kvoffload.stats import metrics_url

    assert metrics_url("h:1/?x=1") == "http://h:1/metrics?x=1"
    assert metrics_url("https://h:1/metrics/?x=1") == "https://h:1/metrics/?x=1"


@pytest.fixture
def serve_body():
    """serve_body(bytes) -> host:port of a server answering every GET with those bytes."""
    import http.server
    import threading

    servers = []

    def start(body: bytes) -> str:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("body, why", [
    (b"<!DOCTYPE HTML>\n<html></html>\n", "invalid metric name:<!DOCTYPE HTML>"),
    (b"kvoffload_hits_total{tier=\"caf\xe9\"} 1\n", "'utf-8' codec can't decode byte 0xe9"),
])
def test_stats_of_a_page_that_is_not_our_metrics_is_one_line(capsys, serve_body, body, why):
    from kvoffload.cli import main

    where = serve_body(body)
    assert main(["stats", where, "--once"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kvoffload stats: cannot scrape http://{where}/metrics: {why}")


def test_stats_shows_nan_and_infinite_gauges(capsys, serve_body):
    from kvoffload.cli import main

    body = (b"# TYPE kvoffload_used_blocks gauge\nkvoffload_used_blocks{tier=\"cpu\"} NaN\n"
            b"# TYPE kvoffload_usage gauge\nkvoffload_usage{tier=\"cpu\"} +Inf\n")
    assert main(["stats", serve_body(body), "--once"]) == 0
    row = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("cpu "))
    assert row.split()[-2:] == ["nan", "inf"]
