"""Per-request hints (kvoffload.hints): valid values parsed as documented,
anything else ignored for that request alone, warned about and counted once;
never an exception, whatever a client sends."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.abstractions import Locality, Medium, ReqContext, TierFilter, TierMatcher
from kvoffload.hints import NO_HINTS, parse_hints, request_hints


@pytest.mark.parametrize(("value", "low"), [("low", True), ("normal", False), ("LOW", True),
                                            (" Normal\n", False), (None, False)])
def test_valid_retention_values(value, low):
    h = parse_hints({"kv_retention": value})
    assert (h.low_retention, h.bad) == (low, ())


def test_valid_load_tiers():
    h = parse_hints({"kv_load_tiers": [{"medium": "cpu"}, {"medium": " Storage ", "locality": "REMOTE"}, {}]})
    assert h.load_tiers == TierFilter((TierMatcher(Medium.CPU, None),
                                       TierMatcher(Medium.STORAGE, Locality.REMOTE), TierMatcher()))
    assert parse_hints({"kv_load_tiers": []}).load_tiers == TierFilter(())  # loads from no secondary tier
    assert parse_hints({}).load_tiers is None and parse_hints(None) is NO_HINTS


def test_other_keys_are_not_ours():
    h = parse_hints({"do_remote_prefill": True, "max_load_tokens": "x", "kv_retention": "low"})
    assert (h.low_retention, h.bad) == (True, ())


@pytest.mark.parametrize(("params", "key", "why"), [
    ({"kv_retention": "forever"}, "kv_retention", "must be 'low' or 'normal'"),
    ({"kv_retention": 1}, "kv_retention", "must be 'low' or 'normal'"),
    ({"kv_retention": ["low"]}, "kv_retention", "must be 'low' or 'normal'"),
    ({"kv_load_tiers": "cpu"}, "kv_load_tiers", "must be a list of {medium, locality} dicts"),
    ({"kv_load_tiers": ["nowhere"]}, "kv_load_tiers", "entry 0 must be a dict"),
    ({"kv_load_tiers": [{"medium": "tape"}]}, "kv_load_tiers",
     "entry 0: unknown medium 'tape' (one of cpu, storage)"),
    ({"kv_load_tiers": [{}, {"locality": 3}]}, "kv_load_tiers", "entry 1: locality must be a string"),
    ({"kv_load_tiers": [{"medum": "cpu"}]}, "kv_load_tiers", "entry 0: unknown key 'medum'"),
    ("low", "kv_transfer_params", "must be a dict"),
    ([("kv_retention", "low")], "kv_transfer_params", "must be a dict"),
])
def test_invalid_hint_is_ignored_and_named(params, key, why, caplog):
    with caplog.at_level(logging.WARNING, logger="kvoffload.hints"):
        h = parse_hints(params, "req-7")
    assert h.bad == (key,) and h.low_retention is False
    assert h.load_tiers in (None, TierFilter.ALL)  # an invalid filter: load from every tier
    (rec,) = caplog.records
    assert rec.getMessage().startswith(f"request 'req-7': ignoring {key}=")
    assert rec.getMessage().endswith(": " + why)


def test_one_bad_key_does_not_cancel_a_good_one():
    h = parse_hints({"kv_retention": "LOW", "kv_load_tiers": "cpu"})
    assert h.low_retention is True and h.load_tiers is TierFilter.ALL and h.bad == ("kv_load_tiers",)


def test_a_huge_value_is_logged_short(caplog):
    with caplog.at_level(logging.WARNING, logger="kvoffload.hints"):
        parse_hints({"kv_retention": "x" * 1_000_000, "kv_load_tiers": [[0] * 10**5] * 10**3}, "r" * 10**4)
    assert len(caplog.records) == 2 and all(len(r.getMessage()) < 400 for r in caplog.records)


def test_parsed_warned_and_counted_once_per_request(caplog):
    counted = []
    ctx = ReqContext("r", {"kv_retention": "forever", "kv_load_tiers": 5})
    with caplog.at_level(logging.WARNING, logger="kvoffload.hints"):
        for _ in range(3):
            h = request_hints(ctx, counted.append)
    assert counted == [2] and len(caplog.records) == 2 and ctx.get_state(type(h)) is h


class _Hostile(dict):
    def get(self, *a):
        raise RuntimeError("boom")

    def __repr__(self):
        raise RuntimeError("no repr either")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
hint_dicts = st.dictionaries(
    st.sampled_from(["kv_retention", "kv_load_tiers", "medium", "other"]),
    json_values | st.lists(st.dictionaries(st.sampled_from(["medium", "locality", "x"]), json_values)),
    max_size=3,
)


@settings(max_examples=200, deadline=None)
@given(json_values | hint_dicts)
def test_any_json_value_never_raises(params):
    h = parse_hints(params, "r")
    assert isinstance(h.low_retention, bool)
    assert h.load_tiers is None or isinstance(h.load_tiers, TierFilter)
    assert set(h.bad) <= {"kv_transfer_params", "kv_retention", "kv_load_tiers"}


def test_even_a_raising_mapping_is_only_ignored(caplog):
    with caplog.at_level(logging.WARNING, logger="kvoffload.hints"):
        h = parse_hints(_Hostile(kv_retention="low"), "r")
    assert h.bad == ("kv_transfer_params",) and h.low_retention is False
    (rec,) = caplog.records
    assert rec.getMessage().startswith("request 'r': ignoring kv_transfer_params=<_Hostile instance at ")
    assert rec.getMessage().endswith(": unreadable (RuntimeError)")


def test_bad_hints_become_a_declared_prometheus_counter():
    from kvoffload.metrics import PREFIX, PrometheusMetrics, build_metric_definitions
    from kvoffload.tiers.cpu.manager import CPUOffloadingManager

    assert PREFIX + "bad_request_hints" in build_metric_definitions()  # declared: vLLM exports only those
    m = CPUOffloadingManager(4)
    for i, params in enumerate([{"kv_retention": "forever"}, {"kv_retention": "low"}, "x", "", {}, None]):
        m.on_new_request(ReqContext(f"r{i}", params))
    prom = PrometheusMetrics()
    prom.record_stats(m.get_stats())
    assert 'kvoffload_bad_request_hints_total{locality="LOCAL",medium="CPU",tier="cpu"} 3.0' in prom.text()


HUGE = 10**5000  # repr() of it raises on Python 3.11+ (4300-digit limit)


@pytest.mark.parametrize("params, key", [
    ({"kv_retention": HUGE}, "kv_retention"),
    ({"kv_retention": [HUGE]}, "kv_retention"),
    ({"kv_load_tiers": HUGE}, "kv_load_tiers"),
    ({"kv_load_tiers": [{"medium": HUGE}]}, "kv_load_tiers"),
    ({"kv_load_tiers": [{HUGE: 1}]}, "kv_load_tiers"),
])
def test_a_huge_integer_is_ignored_and_counted_not_raised(params, key, caplog):
    from kvoffload.tiers.cpu.manager import CPUOffloadingManager

    m = CPUOffloadingManager(8)
    with caplog.at_level(logging.WARNING, logger="kvoffload.hints"):
        m.on_new_request(ReqContext("r", params))  # raised ValueError from the warning's repr
    assert m.get_stats().counters["bad_request_hints"] == 1
    (rec,) = caplog.records
    assert rec.getMessage().startswith(f"request 'r': ignoring {key}=")
    assert parse_hints(params, HUGE).bad == (key,)  # a huge request id too


def test_a_long_load_tiers_list_is_ignored_and_counted(caplog):
    from kvoffload.hints import MAX_LOAD_TIERS

    tiers = [{"medium": "cpu", "locality": "local"}] * (MAX_LOAD_TIERS + 1)
    with caplog.at_level(logging.WARNING, logger="kvoffload.hints"):
        h = parse_hints({"kv_load_tiers": tiers}, "r")
    assert h.bad == ("kv_load_tiers",) and h.load_tiers is TierFilter.ALL
    (rec,) = caplog.records
    assert rec.getMessage().endswith(f": has {MAX_LOAD_TIERS + 1} entries; at most {MAX_LOAD_TIERS}")
    # at the bound it is served, each matcher once (a lookup scans them all)
    h = parse_hints({"kv_load_tiers": tiers[:MAX_LOAD_TIERS]}, "r")
    assert h.bad == () and h.load_tiers == TierFilter((TierMatcher(Medium.CPU, Locality.LOCAL),))


def test_a_long_retention_string_is_ignored():
    assert parse_hints({"kv_retention": " " * 10**6 + "low"}).bad == ("kv_retention",)
