"""The contracts in keys.py, abstractions.py and spec.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.abstractions import (
    CanonicalPageMapping,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingManager,
    OffloadingSpec,
    OffloadingStats,
    OffloadingWorker,
    ReqContext,
    TierFilter,
    TierMatcher,
)
from kvoffload.config import ConfigError, OffloadingConfig
from kvoffload.keys import check_key, get_offload_block_hash, get_offload_group_idx, make_offload_key
from kvoffload.spec import build_spec, get_spec_class, register_spec, spec_names

# ---- keys --------------------------------------------------------------------


@settings(deadline=None)  # no timing on a loaded machine
@given(st.binary(min_size=1, max_size=64), st.integers(0, 2**32 - 1))
def test_key_round_trip(block_hash, group):
    key = make_offload_key(block_hash, group)
    assert type(key) is bytes and len(key) == len(block_hash) + 4
    assert get_offload_block_hash(key) == block_hash
    assert get_offload_group_idx(key) == group
    check_key(key)


def test_key_group_is_big_endian():
    assert make_offload_key(b"h", 1) == b"h\x00\x00\x00\x01"
    assert make_offload_key(bytearray(b"h"), 0) == b"h\x00\x00\x00\x00"


def test_key_errors():
    with pytest.raises(TypeError, match="block_hash must be bytes"):
        make_offload_key("abc", 0)
    with pytest.raises(ValueError, match="group_idx"):
        make_offload_key(b"h", -1)
    with pytest.raises(ValueError, match="group_idx"):
        make_offload_key(b"h", 2**32)
    with pytest.raises(TypeError, match="offload keys are bytes, got str"):
        check_key("abcdefgh")
    with pytest.raises(TypeError, match="got tuple"):
        check_key((b"h", 0))
    with pytest.raises(ValueError, match="too short"):
        check_key(b"\x00\x00\x00\x01")


# ---- tier matching -----------------------------------------------------------


def test_tier_matcher_wildcards():
    assert TierMatcher().matches(Medium.CPU, Locality.LOCAL)
    assert TierMatcher(Medium.CPU).matches(Medium.CPU, Locality.REMOTE)
    assert not TierMatcher(Medium.CPU).matches(Medium.STORAGE, Locality.LOCAL)
    assert TierMatcher(locality=Locality.REMOTE).matches(None, Locality.REMOTE)
    assert not TierMatcher(Medium.CPU, Locality.LOCAL).matches(Medium.CPU, Locality.REMOTE)
    assert TierMatcher(Medium.CPU, Locality.LOCAL).matches(None, None)


def test_tier_filter():
    assert TierFilter.ALL.allows(Medium.STORAGE, Locality.REMOTE)
    assert not TierFilter().allows(Medium.CPU, Locality.LOCAL)  # empty: none
    f = TierFilter((TierMatcher(Medium.CPU), TierMatcher(Medium.STORAGE, Locality.LOCAL)))
    assert f.allows(Medium.CPU, Locality.REMOTE)
    assert f.allows(Medium.STORAGE, Locality.LOCAL)
    assert not f.allows(Medium.STORAGE, Locality.REMOTE)


def test_tier_filter_from_params():
    f = TierFilter.from_params([{"medium": "cpu"}, {"medium": "STORAGE", "locality": "remote"}])
    assert f.matchers == (TierMatcher(Medium.CPU, None), TierMatcher(Medium.STORAGE, Locality.REMOTE))
    assert TierFilter.from_params([]).matchers == ()
    assert TierFilter.from_params([{}]).allows(Medium.CPU, Locality.LOCAL)


@pytest.mark.parametrize(
    "params, match",
    [
        (["cpu"], r"kv_load_tiers\[0\] must be a dict"),
        ([{"medium": "cpu"}, {"medum": "cpu"}], r"kv_load_tiers\[1\]: unknown key\(s\) \['medum'\]"),
        ([{"medium": "tape"}], r"kv_load_tiers\[0\]: 'TAPE' is not a valid Medium"),
        ([{"locality": "moon"}], r"kv_load_tiers\[0\]: 'MOON' is not a valid Locality"),
    ],
)
def test_tier_filter_from_params_errors(params, match):
    with pytest.raises(ValueError, match=match):
        TierFilter.from_params(params)


# ---- request context ---------------------------------------------------------


def test_req_context_state_is_typed_and_per_request():
    class Mine:
        def __init__(self, v):
            self.v = v

    class Other:
        pass

    a, b = ReqContext("a"), ReqContext("b")
    assert a.get_state(Mine) is None
    a.set_state(Mine(1))
    a.set_state(Other())
    a.set_state(Mine(2))  # replaces the earlier Mine
    assert a.get_state(Mine).v == 2 and isinstance(a.get_state(Other), Other)
    assert b.get_state(Mine) is None
    assert a.load_tier_filter is TierFilter.ALL and a.kv_transfer_params is None


def test_req_context_positions():
    ctx = ReqContext("r")
    k1, k2 = make_offload_key(b"1", 0), make_offload_key(b"2", 0)
    assert ctx.get_offload_key_position(k1) is None
    ctx.set_offload_key_position(k1, 32)
    ctx.set_offload_key_position(k2, 16)
    ctx.set_offload_key_position(k1, 48)
    assert ctx.get_offload_key_position(k1) == 48 and ctx.get_offload_key_position(k2) == 16
    assert ReqContext("other").get_offload_key_position(k1) is None


def test_lookup_results_distinct():
    assert len({LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY}) == 4


# ---- load/store specs --------------------------------------------------------


def test_gpu_spec_defaults_and_groups():
    s = GPULoadStoreSpec([3, 1, 2])
    assert s.block_ids.dtype == np.int64 and s.block_ids.tolist() == [3, 1, 2]
    assert s.group_sizes == (3,) and s.block_indices == (0,)
    s = GPULoadStoreSpec(np.array([1, 2, 3, 4]), group_sizes=[1, 3], block_indices=[5, 0])
    assert s.group_sizes == (1, 3) and s.block_indices == (5, 0)
    assert GPULoadStoreSpec([], group_sizes=[0, 0]).block_indices == (0, 0)
    assert "GPULoadStoreSpec([3, 1])" == repr(GPULoadStoreSpec([3, 1]))


def test_gpu_spec_validation():
    with pytest.raises(ValueError, match=r"group_sizes \[1, 1\] sum to 2, but there are 3 block ids"):
        GPULoadStoreSpec([1, 2, 3], group_sizes=[1, 1])
    with pytest.raises(ValueError, match="block_indices has 1 entries for 2 groups"):
        GPULoadStoreSpec([1, 2], group_sizes=[1, 1], block_indices=[0])


def test_cpu_spec_holds_slots():
    s = CPULoadStoreSpec([7, 0])
    assert s.block_ids.tolist() == [7, 0] and repr(s) == "CPULoadStoreSpec([7, 0])"


# ---- canonical layout --------------------------------------------------------


@settings(deadline=None)  # no timing on a loaded machine
@given(st.integers(1, 8), st.data())
def test_writer_rotation_covers_each_block_once(num_writers, data):
    mappings = [CanonicalPageMapping(1024, 512, (), num_writers, i, True) for i in range(num_writers)]
    for block in data.draw(st.lists(st.integers(0, 10**6), max_size=20)):
        assert sum(m.is_writer(block) for m in mappings) == 1
        assert mappings[block % num_writers].is_writer(block)


def test_single_writer_writes_everything():
    m = CanonicalPageMapping(1024, 1024, (), 1, 0, False)
    assert all(m.is_writer(b) for b in range(50))


# ---- stats and ABCs ----------------------------------------------------------


def test_stats_walk():
    leaf = OffloadingStats("disk", Medium.STORAGE)
    root = OffloadingStats("all", children=[OffloadingStats("cpu", Medium.CPU, children=[leaf])])
    assert [s.tier for s in root.walk()] == ["all", "cpu", "disk"]


def test_abstract_classes_refuse_instantiation():
    for cls in (OffloadingManager, OffloadingWorker, OffloadingSpec):
        with pytest.raises(TypeError):
            cls() if cls is not OffloadingSpec else cls(OffloadingConfig.from_dict({}))


# ---- spec registry -----------------------------------------------------------


class _ToySpec(OffloadingSpec):
    def get_manager(self):
        raise NotImplementedError

    def get_worker(self, kv_caches):
        raise NotImplementedError


def test_spec_registry_by_name_and_path():
    assert "cpu" in spec_names()
    register_spec("toy-test", _ToySpec)
    assert get_spec_class("toy-test") is _ToySpec
    assert get_spec_class(f"{__name__}:_ToySpec") is _ToySpec
    assert get_spec_class(f"{__name__}._ToySpec") is _ToySpec
    spec = build_spec("toy-test", OffloadingConfig.from_dict({"extra_config": {"offload_prompt_only": False}}))
    assert isinstance(spec, _ToySpec) and spec.offload_prompt_only is False
    assert spec.tokens_per_block == (16,) and spec.blocks_per_chunk == 1


def test_spec_registry_errors():
    with pytest.raises(ConfigError, match=r"unknown spec 'nope'; known specs: \[.*'cpu'"):
        get_spec_class("nope")
    with pytest.raises(ConfigError, match="cannot load spec 'no_such_module:X'"):
        get_spec_class("no_such_module:X")
    with pytest.raises(ConfigError, match="cannot load spec"):
        get_spec_class("kvoffload.spec:Missing")
    with pytest.raises(ConfigError, match="not an OffloadingSpec"):
        get_spec_class("kvoffload.config:OffloadingConfig")
