"""Which models we may offload (layout/models.py): Mamba/SSM and indexer
state are refused by the spec and the worker, by group kind or by layer."""

import pytest
import torch
from layout_ref import canonical_kv_caches, full_cache

from kvoffload.config import ConfigError, OffloadingConfig
from kvoffload.layout import (
    LayerLayout,
    ParallelLayout,
    UnsupportedModelError,
    check_layer,
    layer_mapping,
)
from kvoffload.tiers.cpu.spec import CPUOffloadingSpec
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker


def hybrid(kind="mamba", **extra):
    return OffloadingConfig.from_dict({
        "groups": [{"tokens_per_block": 16, "layer_names": ["model.layers.0.attn"]},
                   {"tokens_per_block": 16, "kind": kind, "layer_names": ["model.layers.1.mixer"]}],
        "tokens_per_hash": 16, "extra_config": {"num_cpu_chunks": 4, **extra}})


@pytest.mark.parametrize("kind, why", [("mamba", "recurrent state"), ("ssm", "recurrent state"),
                                       ("indexer", "indexer caches")])
def test_spec_refuses_models_with_state_we_cannot_offload(kind, why):
    with pytest.raises(UnsupportedModelError, match=rf"model.layers.1.mixer.*{kind!r}.*{why}.*refused"):
        CPUOffloadingSpec(hybrid(kind))
    assert issubclass(UnsupportedModelError, ConfigError)


def test_worker_refuses_them_too():
    layer = LayerLayout(16, 2, 32, torch.float16)
    kv = canonical_kv_caches([(full_cache(layer, 4), layer)] * 2, [[0], [1]], ParallelLayout())
    with pytest.raises(UnsupportedModelError, match="model.layers.1.mixer"):
        CPUOffloadingWorker(kv, hybrid("mamba"), 4)


def test_unknown_kind_is_a_config_error_listing_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown kind 'retnet'.*'mla'"):
        CPUOffloadingSpec(hybrid("retnet"))
    with pytest.raises(ConfigError, match=r"groups\[0\].kind must be a non-empty string"):
        OffloadingConfig.from_dict({"groups": [{"tokens_per_block": 16, "kind": 3}]})


def test_kinds_round_trip_through_the_config_dict():
    c = hybrid("mla")
    assert OffloadingConfig.from_dict(c.to_dict()) == c
    assert c.groups[1].kind == "mla" and c.groups[1].layer_names == ("model.layers.1.mixer",)
    CPUOffloadingSpec(c)  # MLA is offloadable


@pytest.mark.parametrize("kind", ["mamba", "ssm", "indexer", "linear_attention"])
def test_state_we_cannot_offload_is_refused(kind):
    bad = LayerLayout(16, 1, 64, torch.bfloat16, kind=kind, name="model.layers.3.mixer")
    ok = LayerLayout(16, 8, 64, torch.bfloat16)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.3\.mixer.*refused") as e:
        for layer in (ok, bad):
            check_layer(layer)
    assert isinstance(e.value, ConfigError)
    with pytest.raises(UnsupportedModelError):
        layer_mapping(bad, ParallelLayout(), 4096)  # never an opaque fallback either
