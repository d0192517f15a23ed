"""The `kvoffload` section of SGLang's --hicache-storage-backend-extra-config,
checked when SGLang builds the backend (one-line ConfigError naming the key),
and the tier it describes, built once the host pool says how big a page is.

    {"backend_name": "kvoffload", "module_path": "kvoffload.integrations.sglang",
     "class_name": "KvoffloadHiCacheStorage", "interface_v1": 1,
     "kvoffload": {"type": "redis", "url": "redis://cache:6379/0"}}

`type` is a secondary tier type (storage, redis, mooncake); every other key
but `staging_bytes`, `job_bytes` and `model` is that tier's own config,
checked by it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from kvoffload.config import ConfigError, parse_bytes
from kvoffload.tiers.base import Namespace, SecondaryTier

TIER_CLASSES = {
    "storage": "kvoffload.tiers.storage.tier:StorageTier",
    "redis": "kvoffload.tiers.redis.tier:RemoteTier",
    "mooncake": "kvoffload.tiers.mooncake.tier:MooncakeTier",
}
SECTION = "kvoffload"
DEFAULT_STAGING_BYTES = 64 << 20
# pages of one call go to the tier in jobs of about this size, so copying one job's pages between
# SGLang's pool and the staging slots overlaps the transfer of the others
DEFAULT_JOB_BYTES = 8 << 20


@dataclass(frozen=True)
class TierContext:
    """What a tier's from_config reads besides its entry (as kvoffload.tiering's)."""

    index: int
    name: str
    namespace: Namespace
    chunk_bytes: int
    enable_events: bool = False


@dataclass(frozen=True)
class BackendConfig:
    tier_type: str
    tier_config: dict[str, Any] = field(default_factory=dict)
    staging_bytes: int = DEFAULT_STAGING_BYTES
    job_bytes: int = DEFAULT_JOB_BYTES
    model: str | None = None  # overrides SGLang's model_name in the namespace

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None, default_type: str | None = None) -> BackendConfig:
        section = (extra or {}).get(SECTION)
        if section is None:
            section = {}
        if not isinstance(section, dict):
            raise ConfigError(f"extra_config.{SECTION} must be an object, got {type(section).__name__}")
        conf = dict(section)
        tier_type = conf.pop("type", default_type)
        if not isinstance(tier_type, str) or tier_type not in TIER_CLASSES:  # a list is unhashable
            raise ConfigError(f"extra_config.{SECTION}.type must be one of {sorted(TIER_CLASSES)}, "
                              f"got {tier_type!r}")
        staging = parse_bytes(conf.pop("staging_bytes", DEFAULT_STAGING_BYTES), f"{SECTION}.staging_bytes")
        job = parse_bytes(conf.pop("job_bytes", DEFAULT_JOB_BYTES), f"{SECTION}.job_bytes")
        model = conf.pop("model", None)
        if model is not None and (not isinstance(model, str) or not model):
            raise ConfigError(f"{SECTION}.model must be a non-empty string, got {model!r}")
        return cls(tier_type, conf, staging, job, model)

    def tier_class(self) -> type:
        module, _, name = TIER_CLASSES[self.tier_type].partition(":")
        return getattr(importlib.import_module(module), name)

    @property
    def pool_trailer_bytes(self) -> int:
        """Room the tier keeps after each staging chunk (Mooncake: its value header)."""
        return getattr(self.tier_class(), "POOL_TRAILER_BYTES", 0)

    def build_tier(self, namespace: Namespace, chunk_bytes: int) -> SecondaryTier:
        tier_class = self.tier_class()
        ctx = TierContext(0, f"sglang-{self.tier_type}", namespace, chunk_bytes)
        return tier_class.from_config(dict(self.tier_config), ctx)


def parallel_layout(storage_config, tier_type: str) -> str:
    """Which shard of a page this process holds. MLA latents are the same on
    every TP rank, so remote tiers share them across ranks; the storage
    tier's directory belongs to one process, so it is per rank."""
    c = storage_config
    parts = []
    if c.is_mla_model and tier_type != "storage":
        parts.append("mla-replicated")
    else:
        parts.append(f"tp{c.tp_size}-rank{c.tp_rank}")
    if c.pp_size > 1:
        parts.append(f"pp{c.pp_size}-rank{c.pp_rank}")
    if c.attn_cp_size > 1:
        parts.append(f"cp{c.attn_cp_size}-rank{c.attn_cp_rank}")
    if getattr(c, "dcp_size", 1) > 1:
        parts.append(f"dcp{c.dcp_size}-rank{c.dcp_rank}-page{c.logical_page_size}")
    return "sglang-" + "-".join(parts)
