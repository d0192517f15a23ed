"""Secondary tier types by name, and the Tier: one secondary tier (its
manager, its worker once the host pool exists, its admission filter and
back-pressure limit) as the tiering manager drives it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvoffload.abstractions import OffloadingManager
from kvoffload.tiering.admission import AdmissionFilter, StoreCountAdmission
from kvoffload.registry import Registry
from kvoffload.tiers.base import Namespace, SecondaryTier, TierWorker

# type name -> a SecondaryTier with a classmethod from_config(conf: dict, ctx: TierContext)
TIER_TYPES = Registry(SecondaryTier, "secondary tier type", "types", {
    "storage": "kvoffload.tiers.storage.tier:StorageTier",
    "redis": "kvoffload.tiers.redis.tier:RemoteTier",
    "mooncake": "kvoffload.tiers.mooncake.tier:MooncakeTier",
})
register_tier_type = TIER_TYPES.register
tier_type_names = TIER_TYPES.names
get_tier_class = TIER_TYPES.get

# keys of a secondary_tiers entry that the tiering manager reads itself
TIER_KEYS = ("type", "name", "store_threshold", "max_queue_depth", "admission")
DEFAULT_STORE_THRESHOLD = 1  # every chunk stored in CPU is written down
DEFAULT_MAX_QUEUE_DEPTH = 256  # chunks in flight per tier (all tiers together: a quarter of CPU, cascade.py)


@dataclass(frozen=True)
class TierContext:
    """What a tier type is built with besides its own config entry."""

    index: int  # position in secondary_tiers (for error messages)
    name: str  # unique name; also the `ownership` of its events
    namespace: Namespace
    chunk_bytes: int  # a chunk's bytes rounded up to 4 KiB, one chunk per key (a pool slot may be longer)
    enable_events: bool


@dataclass
class Tier:
    """One secondary tier as the tiering manager drives it.

    admission: which chunks are worth writing down (None: all of them);
    store_threshold > 1 without one means a StoreCountAdmission of that
    threshold (the config's shorthand)."""

    backend: SecondaryTier
    store_threshold: int = DEFAULT_STORE_THRESHOLD
    max_queue_depth: int = DEFAULT_MAX_QUEUE_DEPTH
    admission: AdmissionFilter | None = None
    worker: TierWorker | None = None  # attached once the host pool exists
    in_flight: int = 0  # chunks of store jobs not finished yet
    # keys waiting to be written down, oldest first (cascade.py: back-pressure defers, never drops)
    waiting: OrderedDict = field(default_factory=OrderedDict)
    counters: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        self.name = self.backend.name
        self.medium = self.backend.medium
        self.locality = self.backend.locality
        self.manager: OffloadingManager = self.backend.get_manager()
        if self.admission is None and self.store_threshold > 1:
            self.admission = StoreCountAdmission(self.store_threshold, prefix_closed=False)

    def count(self, name: str, n: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n
