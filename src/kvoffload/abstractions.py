"""The offloading contracts: what a scheduler-side manager and a worker-side
mover promise each other. Modelled on vLLM v1's kv_offload abstractions so a
tier written against them plugs into vLLM unchanged.

Scheduler side: an OffloadingManager is pure bookkeeping (which keys a tier
holds, where, and whether they may be read or evicted).
Worker side: an OffloadingWorker moves bytes asynchronously and reports each
job as a TransferResult; those contracts live in kvoffload.worker_contracts
and are re-exported here, so every contract imports from this module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

from kvoffload.config import true_or_false
from kvoffload.keys import check_key
from kvoffload.keys import (  # re-exported: the keys are part of the contract
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from kvoffload.worker_contracts import (  # re-exported: the worker side of the contract
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    CanonicalKVCacheRef,
    CanonicalKVCacheTensor,
    CanonicalPageMapping,
    CopyRun,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

if TYPE_CHECKING:
    from kvoffload.config import OffloadingConfig

__all__ = [
    "OffloadKey", "make_offload_key", "get_offload_block_hash", "get_offload_group_idx",
    "Medium", "Locality", "TierMatcher", "TierFilter", "ReqContext", "LookupResult",
    "OffloadPolicy", "RequestOffloadingContext", "ScheduleEndContext", "LoadStoreSpec",
    "PrepareStoreOutput", "OffloadingEvent", "OffloadingMetricMetadata",
    "OffloadingCounterMetadata", "OffloadingGaugeMetadata", "OffloadingHistogramMetadata",
    "OffloadingKVEventsConfig", "OffloadingStats", "OffloadingManager",
    "BlockIDsLoadStoreSpec", "GPULoadStoreSpec", "CPULoadStoreSpec",
    "CanonicalKVCacheTensor", "CopyRun", "CanonicalPageMapping", "CanonicalKVCacheRef",
    "CanonicalKVCaches", "TransferResult", "OffloadingWorker", "OffloadingSpec",
]

_T = TypeVar("_T")


class Medium(Enum):
    """What a tier stores its bytes on."""

    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(Enum):
    """Whether a tier's bytes live on this instance or are shared remotely."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


class TierMatcher(NamedTuple):
    """Matches tiers by medium and locality; None on either side is a wildcard."""

    medium: Medium | None = None
    locality: Locality | None = None

    def matches(self, medium: Medium | None, locality: Locality | None) -> bool:
        return (self.medium is None or medium is None or self.medium == medium) and (
            self.locality is None or locality is None or self.locality == locality
        )


@dataclass(frozen=True)
class TierFilter:
    """Which tiers a request may load from. An empty filter allows none."""

    matchers: tuple[TierMatcher, ...] = ()

    ALL: ClassVar[TierFilter]

    def allows(self, medium: Medium | None, locality: Locality | None) -> bool:
        if self is TierFilter.ALL:
            return True
        return any(m.matches(medium, locality) for m in self.matchers)

    @classmethod
    def from_params(cls, tiers: Iterable[dict[str, str]]) -> TierFilter:
        """Build a filter from `kv_load_tiers`: a list of {medium, locality} dicts."""
        matchers = []
        for i, t in enumerate(tiers):
            if not isinstance(t, dict):
                raise ValueError(f"kv_load_tiers[{i}] must be a dict, got {t!r}")
            unknown = set(t) - {"medium", "locality"}
            if unknown:
                raise ValueError(f"kv_load_tiers[{i}]: unknown key(s) {sorted(unknown)}")
            try:
                medium = Medium(t["medium"].upper()) if t.get("medium") else None
                locality = Locality(t["locality"].upper()) if t.get("locality") else None
            except ValueError as e:
                raise ValueError(f"kv_load_tiers[{i}]: {e}") from None
            matchers.append(TierMatcher(medium, locality))
        return cls(tuple(matchers))


TierFilter.ALL = TierFilter(matchers=(TierMatcher(),))


@dataclass
class ReqContext:
    """Per-request context handed to every manager call."""

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    kv_hints: Any | None = None
    load_tier_filter: TierFilter = TierFilter.ALL
    # Typed scratch space: a tier parses the request's params once (in
    # on_new_request) and reads its own object back on later calls.
    _state: dict[type, Any] = field(default_factory=dict, repr=False, init=False)
    # End-token position of each key in this request, so a manager can
    # recover prefix order when stores arrive out of order.
    _offload_key_positions: dict[OffloadKey, int] = field(
        default_factory=dict, repr=False, init=False
    )

    def set_state(self, val: Any) -> None:
        self._state[type(val)] = val

    def get_state(self, cls: type[_T]) -> _T | None:
        return self._state.get(cls)

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        self._offload_key_positions[key] = end_token

    def set_offload_key_positions(self, keys: Iterable[OffloadKey], end_tokens: Iterable[int]) -> None:
        """set_offload_key_position of many keys at once (pairs in order)."""
        self._offload_key_positions.update(zip(keys, end_tokens))

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        return self._offload_key_positions.get(key)

    # ---- ours, beyond vLLM's ReqContext --------------------------------------

    def offload_key_positions(self) -> Mapping[OffloadKey, int]:
        """Every key's end-token position: the live mapping (read it, don't
        write it), so a manager can order a whole prefix without a copy."""
        return self._offload_key_positions

    def share_offload_key_positions(self, positions: dict[OffloadKey, int]) -> None:
        """Use `positions` as this request's key positions: the same dict, not
        a copy, so positions its owner (an engine) adds later are seen."""
        self._offload_key_positions = positions

    def get_owned(self, owner: object) -> Any:
        """Scratch state kept under `owner` itself (a manager instance):
        set_state/get_state key by type, but several managers of one type
        (a CPU tier and a storage tier reusing it) may share one context."""
        return self._state.get(owner)

    def set_owned(self, owner: object, val: Any) -> None:
        self._state[owner] = val

    def pop_owned(self, owner: object) -> Any:
        """Remove and return the state kept under `owner` (None if none)."""
        return self._state.pop(owner, None)


class LookupResult(Enum):
    MISS = auto()  # not held by any allowed tier
    HIT = auto()  # held and readable now
    HIT_PENDING = auto()  # held, but still being written or promoted
    RETRY = auto()  # unknown yet (e.g. a remote existence check in flight)


class OffloadPolicy(Enum):
    # Offload only newly computed chunks; prefix hits were offloaded before.
    CHUNK_LEVEL = "chunk_level"
    # Offload every chunk of the request, prefix hits included (for tiers
    # that need a request's whole KV context).
    REQUEST_LEVEL = "request_level"


@dataclass
class RequestOffloadingContext:
    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


class ScheduleEndContext(NamedTuple):
    """What the scheduler did this step, passed to on_schedule_end()."""

    new_req_ids: Collection[str]
    preempted_req_ids: Collection[str]


@dataclass
class PrepareStoreOutput:
    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass
class OffloadingEvent:
    keys: list[OffloadKey]
    medium: Medium
    removed: bool  # True: the keys left the tier; False: they became readable
    locality: Locality | None = None
    # Name of the secondary tier that owns these keys; None for the primary.
    ownership: str | None = None
    removal_expected: bool = False
    # A failed store's cleanup (removed=True): the keys were never readable,
    # so nothing is announced; vLLM 0.33's event tracker drops their payload.
    metadata_only: bool = False


@dataclass(frozen=True)
class OffloadingMetricMetadata:
    documentation: str
    labelnames: tuple[str, ...] = ()


@dataclass(frozen=True)
class OffloadingCounterMetadata(OffloadingMetricMetadata):
    pass


@dataclass(frozen=True)
class OffloadingGaugeMetadata(OffloadingMetricMetadata):
    pass


@dataclass(frozen=True)
class OffloadingHistogramMetadata(OffloadingMetricMetadata):
    buckets: tuple[float, ...] | None = None


@dataclass(frozen=True)
class OffloadingKVEventsConfig:
    # Global switch: when False nobody drains take_events(), so managers
    # must not accumulate events at all.
    enable_kv_cache_events: bool
    # Opt-in: BlockStored events carry hashes, parent, tokens and block size.
    self_describing_kv_events: bool


@dataclass
class OffloadingStats:
    """A tier's stats. Counters are deltas since the previous get_stats();
    gauges are current values. A composing manager nests its tiers' stats."""

    tier: str
    medium: Medium | None = None
    locality: Locality | None = None
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    children: list[OffloadingStats] = field(default_factory=list)

    def walk(self) -> Iterable[OffloadingStats]:
        yield self
        for c in self.children:
            yield from c.walk()


class OffloadingManager(ABC):
    """Scheduler-side bookkeeping of one tier (or a composition of tiers).

    lookup()        is one block held and readable?
    prepare_load()  pin blocks for reading; returns where they are
    touch()         mark blocks recently used (also GPU-cached ones)
    complete_load() unpin blocks after the read finished
    prepare_store() reserve room for blocks (evicting if needed)
    complete_store() make stored blocks readable, or drop failed ones
    """

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT if held and readable, HIT_PENDING if held but not readable yet,
        MISS if not held, RETRY if the answer is not known yet."""

    def lookup_prefix(
        self, keys: Sequence[OffloadKey], req_context: ReqContext
    ) -> tuple[int, LookupResult | None]:
        """lookup() of keys in order up to the first answer that is not HIT:
        (how many leading keys are HITs, the answer that ended the run or None
        if every key hit). Same answers and counters as the calls one by one;
        a tier may answer it in one pass (the CPU tier does). A key that is
        not bytes raises before anything is looked up or counted."""
        for k in keys:
            if type(k) is not bytes:
                check_key(k)
        n = 0
        for k in keys:
            r = self.lookup(k, req_context)
            if r is not LookupResult.HIT:
                return n, r
            n += 1
        return n, None

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin the given (held, readable) blocks until complete_load and return
        a spec a worker reads them from."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark blocks recently used. Keys are given in prefix order."""
        return

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Unpin blocks pinned by prepare_load."""
        return

    @abstractmethod
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve room for the keys not already held, evicting if needed.
        Returns which keys to write, where, and what was evicted; None (with
        no state changed) if there is no room."""

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Make the blocks of a prepared store readable; on failure, drop the
        ones that were not already stored."""
        return

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """First sight of a request: parse its params, say how to offload it."""

    def on_request_finished(self, req_context: ReqContext) -> None:
        """No more prepare_* calls will come for this request; completions of
        transfers already submitted may. Implies nothing is persisted yet."""
        return

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events since the last call, only for state this manager owns (a
        composing manager forwards its children's, never invents them)."""
        return ()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """End of a scheduler step: flush deferred work (batched promotions)."""
        return

    def has_pending_work(self) -> bool:
        """True while the engine must keep stepping for this manager."""
        return False

    def reset_cache(self) -> None:
        """Drop every block that is not pinned and reset state."""
        return

    def get_stats(self) -> OffloadingStats | None:
        """Stats since the last call, or None if stats are off."""
        return None

    def shutdown(self) -> None:
        return


class OffloadingSpec(ABC):
    """Builds a manager and a worker from one OffloadingConfig."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """Prometheus metrics this spec emits, by name."""
        return {}

    def __init__(self, config: OffloadingConfig):
        self.config = config
        self.extra_config = config.extra_config
        self.kv_events_config = OffloadingKVEventsConfig(
            enable_kv_cache_events=config.enable_kv_cache_events,
            self_describing_kv_events=true_or_false(self.extra_config.get("self_describing_kv_events"),
                                                    "self_describing_kv_events", False),
        )
        # Offload only prompt blocks; decode blocks are often dropped before
        # the next turn (e.g. reasoning models strip their thinking).
        self.offload_prompt_only: bool = true_or_false(self.extra_config.get("offload_prompt_only"),
                                                        "offload_prompt_only", True)
        self.tokens_per_block = tuple(g.tokens_per_block for g in config.groups)
        self.tokens_per_hash = config.cache.tokens_per_hash
        self.blocks_per_chunk = config.cache.blocks_per_chunk

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """The scheduler-side manager (one per spec)."""

    @abstractmethod
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """The worker-side mover for the given engine KV caches."""
