"""Remote shared tier on Mooncake Store: KV computed by one engine is
reused by every engine pointed at the same mooncake_master. Values carry
the Redis tier's header (tiers/remote/value.py). See README "Mooncake"."""

from kvoffload.tiers.mooncake.config import MooncakeConfig
from kvoffload.tiers.mooncake.tier import MooncakeTier

__all__ = ["MooncakeConfig", "MooncakeTier"]
