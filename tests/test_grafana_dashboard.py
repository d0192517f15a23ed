"""examples/grafana's dashboard against the series we really emit: every
PromQL expression's metric names (and the labels it groups or filters by)
are checked against a scrape of a real tiered replay's /metrics endpoint,
and against vLLM's own OffloadPromMetrics fed the same replay's stats (what
a vLLM engine running kvoffload exports)."""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.metrics import PrometheusMetrics
from kvoffload.replay.engine import EngineOptions, ReplayEngine
from kvoffload.replay.generator import generate_chat

DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "kvoffload-dashboard.json"
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset"}
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum"), "info": ("_info",)}


def expressions() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def references(expr: str) -> tuple[set[str], set[str], set[str]]:
    """(metric names, __name__ regexes, label names) an expression reads."""
    regexes = set(re.findall(r'\{__name__=~"([^"]*)"\}', expr))
    e = re.sub(r'\{__name__=~"[^"]*"\}', " ", expr)
    labels: set[str] = set()
    for m in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", e):
        labels |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    e = re.sub(r"\b(?:by|without)\s*\([^)]*\)", " ", e)
    for m in re.finditer(r"\{([^}]*)\}", e):
        labels |= {re.match(r"\s*(\w+)", x).group(1) for x in m.group(1).split(",") if x.strip()}
    e = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)\s*(\()?", e):
        if m.group(2) is None and m.group(1) not in _KEYWORDS:
            names.add(m.group(1))
    return names, regexes, labels


def emitted(text: str) -> dict[str, set[str] | None]:
    """Sample name -> the label names its samples carry (None: declared, no sample yet)."""
    out: dict[str, set[str] | None] = {}
    for fam in text_string_to_metric_families(text):
        for suffix in _SUFFIXES.get(fam.type, ("",)):
            out.setdefault(fam.name + suffix, None)
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[s.name] = (out.get(s.name) or set()) | set(s.labels)
    return out


def test_parser_reads_names_regexes_and_labels():
    names, regexes, labels = references(
        'sum by (tier) (rate(vllm:a_total{transfer_type="x"}[$__rate_interval])) / '
        'histogram_quantile(0.5, sum by (le) (rate({__name__=~"(vllm:)?b_bucket"}[5m])))')
    assert (names, regexes, labels) == ({"vllm:a_total"}, {"(vllm:)?b_bucket"}, {"tier", "transfer_type", "le"})


def test_dashboard_is_grafana_json_with_prometheus_targets():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and dash["schemaVersion"] >= 30
    assert {i["name"] for i in dash["__inputs"]} == {"DS_PROMETHEUS"}
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in panels:
        assert p["targets"] and p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory):
    """{mode: /metrics text} from one real tiered replay (CPU + storage)."""
    try:
        import vllm  # noqa: F401
        from prometheus_client import CollectorRegistry
        from vllm_prom import offload_prom_metrics, text

        from kvoffload.integrations.vllm import convert
        have_vllm = True
    except ImportError:
        if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") == "1":
            raise
        have_vllm = False
    ours = PrometheusMetrics()
    port = ours.serve(0)
    if have_vllm:
        registry = CollectorRegistry()
        vllm_side = offload_prom_metrics({}, registry)

    class Both:  # the replay's metrics sink, feeding vLLM's side the same stats
        def record_stats(self, st):
            ours.record_stats(st)
            if have_vllm and st is not None:
                vllm_side.observe(convert.connector_stats(st, True).data)

        def observe_transfer(self, *a, **kw):
            ours.observe_transfer(*a, **kw)

    trace = generate_chat(seed=7, sessions=8, block_size=64)
    extra = {"num_cpu_chunks": 40, "storage_dir": str(tmp_path_factory.mktemp("kv")), "storage_bytes": "8MiB"}
    engine = ReplayEngine(trace, EngineOptions(spec="tiered", extra_config=extra, progress=False,
                                               sync_tiers=True, metrics=Both()))
    try:
        result = engine.run()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=120) as r:  # generous: loaded CI
            out = {"replay": r.read().decode()}
    finally:
        engine.close()
        ours.close()
    assert result.tiers["storage"]["counters"].get("hits", 0) > 0  # the secondary tier really served
    if have_vllm:
        out["vllm"] = text(registry)
    return out


@pytest.mark.parametrize("mode", ["replay", "vllm"])
def test_every_dashboard_series_is_emitted(scrapes, mode):
    if mode not in scrapes:
        pytest.skip("vLLM not installed")
    series = emitted(scrapes[mode])
    for expr in expressions():
        names, regexes, labels = references(expr)
        assert names or regexes, expr
        matched = [n for n in names if n in series]
        assert len(matched) == len(names), f"{mode}: {sorted(set(names) - set(matched))} not emitted ({expr})"
        for rx in regexes:
            hits = [n for n in series if re.fullmatch(rx, n)]
            assert hits, f"{mode}: nothing emitted matches {rx!r} ({expr})"
            matched += hits
        carried = set().union(*(series[n] or set() for n in matched))
        if carried:  # series with samples: they carry every label the panel groups by
            assert labels <= carried, f"{mode}: {sorted(labels - carried)} not on {matched} ({expr})"


def test_tier_labels_of_vllm_names_follow_vllm(scrapes):
    tiers = set()
    for fam in text_string_to_metric_families(scrapes["replay"]):
        if fam.name == "vllm:kv_offload_tiering_chunk_queries":
            tiers |= {s.labels["tier"] for s in fam.samples if "tier" in s.labels}
    assert tiers == {"0:primary", "1:storage"}
