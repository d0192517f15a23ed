"""OffloadingConfig: the one config a spec is built from.

Loads from a dict, a JSON or YAML file, or keyword arguments. Every bad value
raises ConfigError naming the key, and unknown keys are refused (with the
closest known name) so a typo never silently falls back to a default.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config key is unknown or has a bad value. The message names the key."""


def check_known_keys(given: Iterable[str], known: Iterable[str], where: str) -> None:
    """Refuse keys that are not in `known`, suggesting the closest match."""
    known = list(known)
    for key in given:
        if key not in known:
            # YAML makes keys of other types (`16:`, `~:`): difflib needs a string
            close = difflib.get_close_matches(key, known, n=1) if isinstance(key, str) else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown key {key!r}{hint}; known keys: {sorted(known)}")


def positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


MAX_IO_THREADS = 256  # per tier: more only exhausts the process's thread limit (10,000 were started)


def thread_count(value: Any, key: str) -> int:
    """A tier's IO thread count: 1 .. MAX_IO_THREADS."""
    positive_int(value, key)
    if value > MAX_IO_THREADS:
        raise ConfigError(f"{key} must be at most {MAX_IO_THREADS}, got {value!r}")
    return value


def true_or_false(value: Any, key: str, default: bool) -> bool:
    """A boolean key: true or false only (bool("false") is True); null is the default."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def positive_number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{key} must be a positive number, got {value!r}")
    return value


MIN_TIMEOUT_S = 0.001  # the kernel takes socket timeouts in whole microseconds: 0 there means "none"
MAX_SECONDS = 3600.0  # any longer is a mistake; an infinite one overflows the timeouts it becomes


def seconds(value: Any, key: str, minimum: float = 0.0) -> float:
    """A positive duration, at least minimum and at most MAX_SECONDS."""
    positive_number(value, key)
    if value < minimum:
        raise ConfigError(f"{key} must be at least {minimum:g} s, got {value!r}")
    if not value <= MAX_SECONDS:
        raise ConfigError(f"{key} must be at most {MAX_SECONDS:g} s, got {value!r}")
    return value


def parse_bytes(value: Any, key: str) -> int:
    """An int of bytes, or a string such as '4GiB', '512MB', '1.5G'."""
    if isinstance(value, str):
        s = value.strip().upper().replace(" ", "")
        units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10,
                 "TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3,
                 "T": 2**40, "G": 2**30, "M": 2**20, "K": 2**10, "B": 1}
        for unit, mult in units.items():
            if s.endswith(unit):
                try:
                    number = float(s[: -len(unit)]) * mult
                except ValueError:
                    raise ConfigError(f"{key}: cannot parse {value!r} as a size") from None
                if not math.isfinite(number):  # "inf", "nan", "1e400": int() would raise OverflowError
                    raise ConfigError(f"{key}: {value!r} is not a finite size")
                value = int(number)
                break
        else:
            try:
                value = int(s)
            except ValueError:
                raise ConfigError(f"{key}: cannot parse {value!r} as a size") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return positive_int(value, key)


def memory_available() -> int | None:
    """Bytes of memory this machine can still give (MemAvailable), or None
    where that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def format_bytes(n: float) -> str:
    for unit, mult in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= mult:
            return f"{n / mult:.1f} {unit}"
    return f"{int(n)} B"


def check_fits_in_memory(nbytes: int, what: str) -> None:
    """Refuse, before allocating, a size the machine cannot hold: an
    oversized pool would otherwise fail deep in an allocator (or push the
    machine into swap and the OOM killer)."""
    available = memory_available()
    if available is not None and nbytes > available:
        raise ConfigError(f"{what} needs {nbytes} bytes ({format_bytes(nbytes)}), but this machine has "
                          f"{available} bytes ({format_bytes(available)}) of memory available")


@dataclass(frozen=True)
class KVGroupConfig:
    """One KV cache group (e.g. full attention, or a sliding window)."""

    tokens_per_block: int  # tokens per GPU block of this group
    sliding_window: int | None = None  # tokens; None = full attention
    # What state the group's layers keep: "attention", "mla", or one we refuse
    # to offload ("mamba", "indexer", ...; see kvoffload.layout.UNSUPPORTED_KINDS).
    kind: str = "attention"
    layer_names: tuple[str, ...] = ()  # for messages only


@dataclass(frozen=True)
class CacheConfig:
    tokens_per_hash: int  # tokens covered by one block hash
    blocks_per_chunk: int = 1  # hash blocks per offloaded chunk (one key each chunk)

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_hash * self.blocks_per_chunk


_TOP_KEYS = ("groups", "tokens_per_hash", "blocks_per_chunk", "extra_config", "enable_kv_cache_events")
_GROUP_KEYS = ("tokens_per_block", "sliding_window", "kind", "layer_names")


@dataclass(frozen=True)
class OffloadingConfig:
    groups: tuple[KVGroupConfig, ...]
    cache: CacheConfig
    extra_config: dict[str, Any] = field(default_factory=dict)
    enable_kv_cache_events: bool = False

    def __post_init__(self):
        if not self.groups:
            raise ConfigError("groups must name at least one KV group")
        for i, g in enumerate(self.groups):
            positive_int(g.tokens_per_block, f"groups[{i}].tokens_per_block")
            if g.sliding_window is not None:
                positive_int(g.sliding_window, f"groups[{i}].sliding_window")
            if not isinstance(g.kind, str) or not g.kind:
                raise ConfigError(f"groups[{i}].kind must be a non-empty string, got {g.kind!r}")
            if not isinstance(g.layer_names, tuple) or not all(isinstance(n, str) for n in g.layer_names):
                raise ConfigError(f"groups[{i}].layer_names must be a list of strings, got {g.layer_names!r}")
        positive_int(self.cache.tokens_per_hash, "tokens_per_hash")
        positive_int(self.cache.blocks_per_chunk, "blocks_per_chunk")
        chunk = self.cache.tokens_per_chunk
        for i, g in enumerate(self.groups):
            if chunk % g.tokens_per_block and g.tokens_per_block % chunk:
                raise ConfigError(
                    f"groups[{i}].tokens_per_block={g.tokens_per_block} must divide, or be a "
                    f"multiple of, the chunk size tokens_per_hash*blocks_per_chunk={chunk}"
                )
        if not isinstance(self.extra_config, dict):
            raise ConfigError(f"extra_config must be a dict, got {type(self.extra_config).__name__}")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError(f"enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}")

    @property
    def tokens_per_chunk(self) -> int:
        return self.cache.tokens_per_chunk

    def gpu_blocks_per_chunk(self, group_idx: int) -> int:
        """GPU blocks of a group that one offloaded chunk spans (at least 1)."""
        return max(1, self.cache.tokens_per_chunk // self.groups[group_idx].tokens_per_block)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OffloadingConfig:
        if not isinstance(d, Mapping):
            raise ConfigError(f"config must be a mapping, got {type(d).__name__}")
        check_known_keys(d, _TOP_KEYS, "config")
        raw_groups = d.get("groups", [{"tokens_per_block": 16}])
        if not isinstance(raw_groups, (list, tuple)):
            raise ConfigError(f"groups must be a list, got {raw_groups!r}")
        groups = []
        for i, g in enumerate(raw_groups):
            if isinstance(g, int):
                g = {"tokens_per_block": g}
            if not isinstance(g, Mapping):
                raise ConfigError(f"groups[{i}] must be a mapping, got {g!r}")
            check_known_keys(g, _GROUP_KEYS, f"groups[{i}]")
            if "tokens_per_block" not in g:
                raise ConfigError(f"groups[{i}].tokens_per_block is required")
            names = g.get("layer_names", ())
            groups.append(KVGroupConfig(g["tokens_per_block"], g.get("sliding_window"),
                                        g.get("kind", "attention"),
                                        tuple(names) if isinstance(names, (list, tuple)) else names))
        tokens_per_hash = d.get("tokens_per_hash", groups[0].tokens_per_block if groups else 16)
        cache = CacheConfig(tokens_per_hash, d.get("blocks_per_chunk", 1))
        extra = d.get("extra_config") or {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"extra_config must be a dict, got {type(extra).__name__}")
        return cls(tuple(groups), cache, dict(extra),
                   d.get("enable_kv_cache_events", False))

    @classmethod
    def from_file(cls, path: str | Path) -> OffloadingConfig:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
        if path.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ConfigError("YAML configs need PyYAML: pip install kvoffload[yaml]") from None
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:  # one line: PyYAML's own message spans several, with a snippet
                mark = getattr(e, "problem_mark", None)
                where = f" at line {mark.line + 1}" if mark is not None else ""
                why = " ".join(str(getattr(e, "problem", None) or e).split())
                raise ConfigError(f"{path}: invalid YAML{where}: {why}") from None
            except RecursionError:
                raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
            except ValueError as e:  # an integer of more than 4300 digits
                raise ConfigError(f"{path}: invalid YAML: {e}") from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
            except RecursionError:
                raise ConfigError(f"{path}: invalid JSON: nested too deeply") from None
            except ValueError as e:  # an integer of more than 4300 digits
                raise ConfigError(f"{path}: invalid JSON: {e}") from None
        return cls.from_dict(data or {})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> OffloadingConfig:
        return cls.from_dict(kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "groups": [{"tokens_per_block": g.tokens_per_block, "sliding_window": g.sliding_window,
                        "kind": g.kind, "layer_names": list(g.layer_names)} for g in self.groups],
            "tokens_per_hash": self.cache.tokens_per_hash,
            "blocks_per_chunk": self.cache.blocks_per_chunk,
            "extra_config": dict(self.extra_config),
            "enable_kv_cache_events": self.enable_kv_cache_events,
        }
