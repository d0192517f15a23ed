"""Remote shared tier on Redis/Valkey (standalone or Redis Cluster): KV
computed by one engine is reused by every engine pointed at the same
server. Built on what every remote tier shares (tiers/remote). See
docs/REMOTE.md."""

from kvoffload.tiers.redis.tier import RemoteTier
from kvoffload.tiers.remote.config import RemoteConfig

__all__ = ["RemoteConfig", "RemoteTier"]
