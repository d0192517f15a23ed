"""OffloadingConfig: dict / file / kwargs loading, and clear errors naming the key."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.config import (
    ConfigError,
    OffloadingConfig,
    check_fits_in_memory,
    check_known_keys,
    memory_available,
    parse_bytes,
)


def test_defaults():
    c = OffloadingConfig.from_dict({})
    assert [g.tokens_per_block for g in c.groups] == [16]
    assert c.cache.tokens_per_hash == 16 and c.cache.blocks_per_chunk == 1
    assert c.extra_config == {} and c.enable_kv_cache_events is False


def test_groups_and_chunks():
    c = OffloadingConfig.from_dict(
        {"groups": [16, {"tokens_per_block": 32, "sliding_window": 128}], "tokens_per_hash": 16,
         "blocks_per_chunk": 4, "extra_config": {"a": 1}, "enable_kv_cache_events": True}
    )
    assert c.tokens_per_chunk == 64
    assert c.gpu_blocks_per_chunk(0) == 4 and c.gpu_blocks_per_chunk(1) == 2
    assert c.groups[1].sliding_window == 128
    assert c.extra_config == {"a": 1} and c.enable_kv_cache_events
    assert OffloadingConfig.from_dict(c.to_dict()) == c


def test_gpu_block_larger_than_chunk_counts_as_one():
    c = OffloadingConfig.from_dict({"groups": [64], "tokens_per_hash": 16})
    assert c.gpu_blocks_per_chunk(0) == 1


def test_from_kwargs_equals_from_dict():
    assert OffloadingConfig.from_kwargs(groups=[32], tokens_per_hash=32) == OffloadingConfig.from_dict(
        {"groups": [32], "tokens_per_hash": 32}
    )


def test_from_json_and_yaml_files(tmp_path):
    d = {"groups": [16], "blocks_per_chunk": 2, "extra_config": {"cpu_bytes_to_use": "1GiB"}}
    (tmp_path / "c.json").write_text(json.dumps(d))
    (tmp_path / "c.yaml").write_text("groups: [16]\nblocks_per_chunk: 2\nextra_config:\n  cpu_bytes_to_use: 1GiB\n")
    assert OffloadingConfig.from_file(tmp_path / "c.json") == OffloadingConfig.from_file(tmp_path / "c.yaml")
    assert OffloadingConfig.from_file(tmp_path / "c.json").cache.blocks_per_chunk == 2


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        OffloadingConfig.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON at line 1"):
        OffloadingConfig.from_file(tmp_path / "bad.json")
    (tmp_path / "bad.yaml").write_text("a: [1,")
    with pytest.raises(ConfigError, match="invalid YAML"):
        OffloadingConfig.from_file(tmp_path / "bad.yaml")


@pytest.mark.parametrize(
    "d, match",
    [
        ({"grups": [16]}, r"unknown key 'grups' \(did you mean 'groups'\?\)"),
        ({"groups": []}, "at least one KV group"),
        ({"groups": "16"}, "groups must be a list"),
        ({"groups": [{"tokens_per_blok": 16}]}, r"groups\[0\]: unknown key 'tokens_per_blok'"),
        ({"groups": [{}]}, r"groups\[0\].tokens_per_block is required"),
        ({"groups": [0]}, r"groups\[0\].tokens_per_block must be a positive integer"),
        ({"groups": [16, -16]}, r"groups\[1\].tokens_per_block"),
        ({"groups": [True]}, r"groups\[0\].tokens_per_block"),
        ({"groups": [{"tokens_per_block": 16, "sliding_window": 0}]}, r"groups\[0\].sliding_window"),
        ({"groups": ["x"]}, r"groups\[0\] must be a mapping"),
        ({"tokens_per_hash": 0}, "tokens_per_hash must be a positive integer"),
        ({"blocks_per_chunk": 1.5}, "blocks_per_chunk must be a positive integer"),
        ({"groups": [24], "tokens_per_hash": 16}, r"groups\[0\].tokens_per_block=24 must divide"),
        ({"extra_config": [1]}, "extra_config must be a dict"),
        ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events must be true or false"),
    ],
)
def test_bad_values_name_the_key(d, match):
    with pytest.raises(ConfigError, match=match):
        OffloadingConfig.from_dict(d)


def test_not_a_mapping():
    with pytest.raises(ConfigError, match="mapping"):
        OffloadingConfig.from_dict([("groups", [16])])


@pytest.mark.parametrize(
    "value, expected",
    [(4096, 4096), ("4096", 4096), ("4KiB", 4096), ("4 KiB", 4096), ("1.5G", 3 * 2**29),
     ("512MB", 512 * 10**6), ("2gib", 2 * 2**30), ("10B", 10), (8.0, 8)],
)
def test_parse_bytes(value, expected):
    assert parse_bytes(value, "size") == expected


@pytest.mark.parametrize("value", ["", "lots", "GiB", "-1", 0, -4, 1.5, True, None, "0KiB", "nanGiB"])
def test_parse_bytes_rejects(value):
    with pytest.raises(ConfigError, match="size"):
        parse_bytes(value, "size")


@pytest.mark.parametrize("value", ["1e400GiB", "infGiB", "-infKiB", "1e400B"])
def test_parse_bytes_refuses_infinite_sizes(value):
    with pytest.raises(ConfigError) as e:
        parse_bytes(value, "cpu_bytes_to_use")
    assert str(e.value) == f"cpu_bytes_to_use: {value!r} is not a finite size"


def test_deep_or_undecodable_config_files_are_one_error(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 200_000)
    with pytest.raises(ConfigError, match=r"deep.json: invalid JSON: nested too deeply$"):
        OffloadingConfig.from_file(tmp_path / "deep.json")
    (tmp_path / "latin1.json").write_bytes(b'{"extra_config": {"name": "caf\xe9"}}')
    with pytest.raises(ConfigError, match=r"latin1.json: not UTF-8 text \(byte 30\)$"):
        OffloadingConfig.from_file(tmp_path / "latin1.json")


def test_memory_check_names_the_size_and_what_is_available():
    avail = memory_available()
    assert avail is not None and avail > 0  # Linux: /proc/meminfo
    check_fits_in_memory(1, "one byte")
    with pytest.raises(ConfigError) as e:
        check_fits_in_memory(avail * 4, "a pool")
    assert str(e.value).startswith(f"a pool needs {avail * 4} bytes (")
    assert "but this machine has " in str(e.value) and str(e.value).endswith(" of memory available")


@settings(deadline=None)  # no timing on a loaded machine
@given(st.integers(1, 2**50))
def test_parse_bytes_int_round_trip(n):
    assert parse_bytes(n, "k") == n == parse_bytes(str(n), "k")


def test_check_known_keys():
    check_known_keys(["a"], ["a", "b"], "where")
    with pytest.raises(ConfigError, match=r"where: unknown key 'c'; known keys: \['a', 'b'\]"):
        check_known_keys(["a", "c"], ["b", "a"], "where")


@pytest.mark.parametrize("text, message", [
    ("groups: [16]\n1: 2\n", "config: unknown key 1; known keys: "),
    ("groups:\n  - {tokens_per_block: 16, null: 3}\n", "groups[0]: unknown key None; known keys: "),
    ("groups: [16]\n2020-01-01: x\n", "config: unknown key datetime.date(2020, 1, 1); known keys: "),
])
def test_yaml_keys_that_are_not_strings_are_named(tmp_path, text, message):
    # YAML reads `1:`, `~:` and dates as keys of other types (difflib raised TypeError on them)
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError) as e:
        OffloadingConfig.from_file(tmp_path / "c.yaml")
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("spec, extra, message", [
    ("cpu", {5: "x"}, "CPUOffloadingSpec extra_config: unknown key 5; known keys: "),
    ("tiered", {5: "x"}, "TieredOffloadingSpec extra_config: unknown key 5; known keys: "),
    ("tiered", {"namespace": {1: "x"}}, "namespace: unknown key 1; known keys: "),
])
def test_spec_keys_that_are_not_strings_are_named(spec, extra, message):
    from kvoffload.spec import build_spec

    with pytest.raises(ConfigError) as e:
        build_spec(spec, OffloadingConfig.from_dict({"groups": [16], "extra_config": {"num_cpu_chunks": 4, **extra}}))
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("key, default", [("offload_prompt_only", True), ("self_describing_kv_events", False)])
def test_boolean_extra_keys_are_true_or_false_only(key, default):
    from kvoffload.spec import build_spec

    def spec(value):
        return build_spec("cpu", OffloadingConfig.from_dict(
            {"groups": [16], "extra_config": {"num_cpu_chunks": 4, key: value}}))

    def read(s):
        return s.offload_prompt_only if key == "offload_prompt_only" else s.kv_events_config.self_describing_kv_events

    for value in ("false", "true", 0, 1, [], "maybe"):  # bool("false") was True
        with pytest.raises(ConfigError) as e:
            spec(value)
        assert str(e.value) == f"{key} must be true or false, got {value!r}"
    assert read(spec(None)) is default  # null: the default (was bool(None), False)
    assert read(spec(not default)) is (not default)


def test_invalid_yaml_is_one_line_naming_file_and_line(tmp_path):
    (tmp_path / "open.yaml").write_text("groups: [16\n")
    with pytest.raises(ConfigError) as e:
        OffloadingConfig.from_file(tmp_path / "open.yaml")
    assert str(e.value) == f"{tmp_path / 'open.yaml'}: invalid YAML at line 2: expected ',' or ']', but got '<stream end>'"
    (tmp_path / "tag.yaml").write_text("groups: !!python/object:os.system {}\n")
    with pytest.raises(ConfigError) as e:
        OffloadingConfig.from_file(tmp_path / "tag.yaml")
    assert str(e.value) == (f"{tmp_path / 'tag.yaml'}: invalid YAML at line 1: could not determine a constructor "
                            "for the tag 'tag:yaml.org,2002:python/object:os.system'")


@pytest.mark.parametrize("name", ["big.json", "big.yaml"])
def test_config_file_with_a_huge_integer_names_the_file(tmp_path, name):
    (tmp_path / name).write_text('{"tokens_per_hash": ' + "1" * 5000 + "}")
    with pytest.raises(ConfigError) as e:
        OffloadingConfig.from_file(tmp_path / name)
    assert str(e.value).startswith(f"{tmp_path / name}: invalid ")
    assert "Exceeds the limit (4300 digits)" in str(e.value)
