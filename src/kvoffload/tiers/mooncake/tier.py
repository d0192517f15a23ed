"""The Mooncake Store tier as a SecondaryTier: one Mooncake Store
(mooncake_master plus the memory its clients lend) shared by every engine
pointed at the same master.

    tier = MooncakeTier(MooncakeConfig(master_address="10.0.0.5:50051",
                                       metadata_server="http://10.0.0.5:8080/metadata"), namespace)
    manager = tier.get_manager()        # scheduler side
    worker = tier.get_worker(host_pool) # moves host-pool chunks

Construction sets the client up: a master or metadata server that cannot
be reached is a ConfigError now (one line). Later outages are misses with
back-off until the master is back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvoffload.abstractions import Locality, Medium
from kvoffload.config import ConfigError
from kvoffload.tiers.base import Namespace, SecondaryTier, align_up
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.mooncake.client import open_store
from kvoffload.tiers.mooncake.config import MooncakeConfig
from kvoffload.tiers.mooncake.keys import MooncakeKeySpace
from kvoffload.tiers.mooncake.manager import MooncakeOffloadingManager
from kvoffload.tiers.mooncake.worker import MooncakeTierWorker
from kvoffload.tiers.remote.state import SharedState
from kvoffload.tiers.remote.value import HEADER_BYTES, ValueCodec


class MooncakeTier(SecondaryTier):
    medium = Medium.CPU
    locality = Locality.REMOTE
    # each value's header goes after its chunk in the slot: chunk + header move as one buffer
    POOL_TRAILER_BYTES = HEADER_BYTES

    def __init__(self, config: MooncakeConfig | Mapping[str, Any] | None, namespace: Namespace,
                 name: str = "mooncake", enable_events: bool = False):
        self.config = config if isinstance(config, MooncakeConfig) else MooncakeConfig.from_dict(config)
        self.namespace = namespace
        self.name = name
        self.enable_events = enable_events
        self.keyspace = MooncakeKeySpace(self.config.key_prefix, namespace)
        self.codec = ValueCodec(self.config.load_mac_key(), self.config.mac_algorithm)  # before connecting
        self.state = SharedState(self.config, separate_transfers=True)  # lookups ask the master, transfers the nodes
        self.client = open_store(self.config)
        self._manager: MooncakeOffloadingManager | None = None
        self._worker: MooncakeTierWorker | None = None

    @classmethod
    def from_config(cls, conf: dict[str, Any], ctx) -> MooncakeTier:
        """Build from one `secondary_tiers` entry (type "mooncake")."""
        try:
            cfg = MooncakeConfig.from_dict(conf)
        except ConfigError as e:
            raise ConfigError(f"secondary_tiers[{ctx.index}] (mooncake): {e}") from None
        return cls(cfg, ctx.namespace, name=ctx.name, enable_events=ctx.enable_events)

    def get_manager(self) -> MooncakeOffloadingManager:
        if self._manager is None:
            self._manager = MooncakeOffloadingManager(self.client, self.keyspace, self.config, self.state,
                                                      name=self.name, enable_events=self.enable_events)
        return self._manager

    def get_worker(self, pool: HostPool) -> MooncakeTierWorker:
        if self._worker is None:
            ns_bytes = self.namespace.chunk_bytes
            if ns_bytes and align_up(ns_bytes) != align_up(pool.used_chunk_bytes):
                raise ValueError(f"mooncake tier: namespace says {ns_bytes}-byte chunks, "
                                 f"host pool holds {pool.used_chunk_bytes}")
            self._worker = MooncakeTierWorker(pool, self.client, self.config, self.state, self.codec)
        return self._worker

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._manager is not None:
            self._manager.shutdown()  # closes the client
        else:
            self.client.close()
