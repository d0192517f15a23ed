"""Remote shared tier on Redis/Valkey (standalone or Redis Cluster): KV
computed by one engine is reused by every engine pointed at the same
server. See docs/REMOTE.md."""

from kvoffload.tiers.remote.config import RemoteConfig
from kvoffload.tiers.remote.tier import RemoteTier

__all__ = ["RemoteConfig", "RemoteTier"]
