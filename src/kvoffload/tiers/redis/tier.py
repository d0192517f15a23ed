"""The remote tier as a SecondaryTier: one Redis/Valkey deployment (or
cluster) shared by every engine that points at it.

    tier = RemoteTier(RemoteConfig(url="redis://cache:6379/0"), namespace)
    manager = tier.get_manager()        # scheduler side
    worker = tier.get_worker(host_pool) # moves host-pool chunks

Construction PINGs the server once: wrong credentials raise ConfigError
now; an unreachable server only logs a warning (the tier serves misses
until it comes back).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvoffload.abstractions import Locality, Medium
from kvoffload.config import ConfigError
from kvoffload.tiers.base import Namespace, SecondaryTier, align_up
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.remote.config import RemoteConfig
from kvoffload.tiers.redis.connection import build_client, check_server
from kvoffload.tiers.remote.manager import RemoteOffloadingManager
from kvoffload.tiers.remote.state import SharedState
from kvoffload.tiers.remote.value import KeySpace, ValueCodec
from kvoffload.tiers.redis.worker import RedisTierWorker


class RemoteTier(SecondaryTier):
    medium = Medium.CPU
    locality = Locality.REMOTE

    def __init__(self, config: RemoteConfig | Mapping[str, Any] | None, namespace: Namespace,
                 name: str = "remote", enable_events: bool = False):
        self.config = config if isinstance(config, RemoteConfig) else RemoteConfig.from_dict(config)
        self.namespace = namespace
        self.name = name
        self.enable_events = enable_events
        self.keyspace = KeySpace(self.config.key_prefix, namespace)
        # before connecting: a bad key file opens nothing
        self.codec = ValueCodec(self.config.load_mac_key(), self.config.mac_algorithm)
        self.state = SharedState(self.config)
        self.client = build_client(self.config)
        try:
            self.reachable_at_start = check_server(self.client, self.config)
        except BaseException:  # e.g. a bad password: close what we opened
            self.client.close()
            raise
        self._manager: RemoteOffloadingManager | None = None
        self._worker: RedisTierWorker | None = None

    @classmethod
    def from_config(cls, conf: dict[str, Any], ctx) -> RemoteTier:
        """Build from one `secondary_tiers` entry (type "redis"; tier-level
        keys already removed); ctx is kvoffload.tiering.TierContext."""
        try:
            cfg = RemoteConfig.from_dict(conf)
        except ConfigError as e:
            raise ConfigError(f"secondary_tiers[{ctx.index}] (redis): {e}") from None
        return cls(cfg, ctx.namespace, name=ctx.name, enable_events=ctx.enable_events)

    def get_manager(self) -> RemoteOffloadingManager:
        if self._manager is None:
            self._manager = RemoteOffloadingManager(self.client, self.keyspace, self.config, self.state,
                                                    name=self.name, enable_events=self.enable_events)
        return self._manager

    def get_worker(self, pool: HostPool) -> RedisTierWorker:
        if self._worker is None:
            ns_bytes = self.namespace.chunk_bytes
            if ns_bytes and align_up(ns_bytes) != align_up(pool.used_chunk_bytes):  # slots may keep trailer room
                raise ValueError(f"remote tier: namespace says {ns_bytes}-byte chunks, "
                                 f"host pool holds {pool.used_chunk_bytes}")
            self._worker = RedisTierWorker(pool, self.client, self.config, self.state, self.codec)
        return self._worker

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._manager is not None:
            self._manager.shutdown()
        else:
            self.client.close()
