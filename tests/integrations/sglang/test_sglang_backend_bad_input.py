"""The SGLang backend refuses bad input with one clear error, before any
transfer: bad config, layouts and parallelism it cannot serve, host indices
of the wrong count, dtype, device or range."""

from __future__ import annotations

import os

import pytest

from sglang_pool import need_sglang

need_sglang()
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang_backend_rig import (  # noqa: E402
    PAGE,
    keys,
    make_backend,
    make_mla_backend,
    pages,
    settled,
    storage_config,
    storage_section,
    tier_section,
)

from kvoffload.config import ConfigError  # noqa: E402


@pytest.mark.parametrize("section, match", [
    ({"type": "nfs"}, "kvoffload.type must be one of"),
    ({"type": ["redis"]}, "kvoffload.type must be one of"),  # was TypeError: unhashable type: 'list'
    ({"type": "redis", "urll": "redis://x"}, "urll"),
    ({"type": "storage", "path": "/tmp/x", "capacity_bytes": "lots"}, "capacity_bytes"),
    ({"type": "redis", "staging_bytes": "-1"}, "staging_bytes"),
    ({"type": "redis", "job_bytes": 0}, "job_bytes"),
    ({"type": "redis", "model": ""}, "model"),
])
def test_bad_config_is_one_clear_line(section, match, tmp_path):
    with pytest.raises((ConfigError, ValueError), match=match) as e:
        make_backend(section)
    assert "\n" not in str(e.value)


def test_layer_first_is_refused_clearly(tmp_path):
    with pytest.raises(ConfigError, match="layer_first.*page_first"):
        make_backend({"type": "storage", "path": str(tmp_path), "capacity_bytes": "1MiB"}, layout="layer_first")


def test_mla_layout_sglang_has_no_ranges_for_is_refused_clearly(request, tmp_path, prefix):
    with pytest.raises(ConfigError, match="layer_first"):
        make_mla_backend(tier_section("redis", request, tmp_path, prefix), "layer_first")


def test_unsupported_parallelism_is_refused_clearly(tmp_path):
    import dataclasses

    extra = {"backend_name": "kvoffload", "module_path": "kvoffload.integrations.sglang.backend",
             "class_name": "KvoffloadHiCacheStorage", "kvoffload": {"type": "redis"}}
    cfg = storage_config(extra)
    for change, match in (({"should_split_heads": True}, "should_split_heads"),):
        with pytest.raises(ConfigError, match=match):
            StorageBackendFactory.create_backend("dynamic", dataclasses.replace(cfg, **change), None)
    mla_dcp = dataclasses.replace(cfg, is_mla_model=True, tp_size=2, tp_rank=1, dcp_size=2, dcp_rank=1,
                                  logical_page_size=2 * PAGE)
    with pytest.raises(ConfigError, match="dcp_size"):
        StorageBackendFactory.create_backend("dynamic", mla_dcp, None)


def test_wrong_number_of_host_indices_is_refused_before_any_transfer(request, tmp_path, prefix):
    backend, pool = make_backend(tier_section("redis", request, tmp_path, prefix))
    try:
        ks = keys(2, "bad-indices")
        with pytest.raises(ValueError, match="host indices"):
            backend.batch_set_v1(ks, pages(0)[:-1])
        with pytest.raises(ValueError, match="host indices"):
            backend.batch_get_v1(ks, pages(0, 1)[1:])
        assert backend.batch_exists(ks) == 0
        assert backend.batch_set_v1(ks, pages(0, 1)) == [True, True]  # nothing left half done
        assert backend.batch_get_v1(ks, pages(2, 3)) == [True, True]
    finally:
        backend.close()


def test_host_indices_of_a_wrong_dtype_or_device_are_refused_before_any_load(tmp_path):
    backend, pool = make_backend(storage_section(tmp_path))
    try:
        pool.fill_random(3)
        ks = keys(4, "dtype")
        assert backend.batch_set_v1(ks, pages(0, 1, 2, 3)) == [True] * 4
        for bad in (pages(4, 5, 6, 7).double(), pages(4, 5, 6, 7).to("meta"), pages(4, 5, 6, 7).bool()):
            with pytest.raises(TypeError, match="host_indices must be an integer CPU tensor"):
                backend.batch_get_v1(ks, bad)
            with pytest.raises(TypeError, match="host_indices must be an integer CPU tensor"):
                backend.batch_set_v1(keys(4, "dtype2"), bad)
        assert settled(backend)  # the double ones used to fail in the copy, after the loads: 3 pins left
        assert backend.batch_get_v1(ks, pages(4, 5, 6, 7)) == [True] * 4
    finally:
        backend.close()


OUT_OF_POOL = """
import sys, torch
sys.path.insert(0, {here!r})
from sglang_backend_rig import keys, make_backend, pages, storage_section
from pathlib import Path
backend, pool = make_backend(storage_section(Path({tmp!r})))
ks = keys(1, "edge")
assert backend.batch_set_v1(ks, pages(0)) == [True]
for idx in (torch.arange(10**6, 10**6 + 16), torch.arange(pool.size - 8, pool.size + 8), torch.arange(-16, 0)):
    for call in (backend.batch_get_v1, backend.batch_set_v1):
        try:
            call(ks if call == backend.batch_get_v1 else keys(1, "edge2"), idx)
        except ValueError as e:
            assert "outside the host pool" in str(e), e
        else:
            raise AssertionError("not refused")
assert backend.batch_get_v1(ks, pages(1)) == [True]
backend.close()
print("refused")
"""


def test_host_indices_outside_the_pool_are_refused_not_copied(tmp_path):
    """(in a process of its own: the copy to or from an address past the pool was a SIGSEGV)"""
    import subprocess
    import sys

    code = OUT_OF_POOL.format(here=os.path.dirname(__file__), tmp=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "refused" in out.stdout, (out.returncode, out.stderr[-3000:])
