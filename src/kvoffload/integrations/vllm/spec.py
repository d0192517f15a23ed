"""The OffloadingSpec vLLM's OffloadingConnector loads:

  --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"spec_name": "KVOffloadingSpec",
      "spec_module_path": "kvoffload.integrations.vllm",
      "kvoffload_spec": "cpu", "cpu_bytes_to_use": "8GiB"}}'

It builds the kvoffload spec named by `kvoffload_spec` (default "cpu"; a
registered name or "module:Class") from vLLM's config, and wraps its manager
and worker in vLLM's interfaces.

vLLM makes one connector (and spec) for the scheduler and one for the worker.
When both live in one process (the "uni" executor) they share one kvoffload
spec, so the manager and the worker are built as a pair, which tiers below
CPU need: their workers read the CPU worker's host pool.

Tensor parallelism (vLLM's mp executor: the scheduler and each TP rank
are processes): the ranks share one host pool, a file on /dev/shm
(SharedHostPool; extra_config shared_pool_path to choose it). TP rank 0
creates it, the others open it, each rank stores its part of every
canonical page and loads its part back, and the scheduler's manager reads
the chunk geometry from the file, then removes it (all ranks have it
mapped by then). vLLM counts a job done when every rank reports it. Pages
are canonical, so they are those TP=1 would store. Secondary tiers run
in the scheduler's process on the same pool (mapped there too), so a
chunk persisted at TP=2 serves a TP=1 engine. At TP=1, vLLM's multi-process
executor (`vllm serve`'s default on CPU) puts the one worker in a process of
its own: with secondary tiers it takes the same path (one rank).

Model kinds: the worker's process builds its spec while vLLM loads the
model, so it reads each layer's KVCacheSpec (convert.model_layer_specs) and
refuses Mamba/SSM and indexer state by layer name; vLLM's scheduler picks
a sliding-window group's blocks itself (group_sizes, block_indices).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kvoffload import metrics_vllm
from kvoffload.abstractions import OffloadingSpec
from kvoffload.config import ConfigError, check_known_keys
from kvoffload.integrations.vllm import convert, prime_metrics
from kvoffload.integrations.vllm._compat import vbase
from kvoffload.integrations.vllm.manager import VLLMOffloadingManager
from kvoffload.integrations.vllm.worker import VLLMOffloadingWorker
from kvoffload.layout import check_config_offloadable
from kvoffload.metrics import build_metric_definitions
from kvoffload.spec import get_spec_class
from kvoffload.tiers.host_pool import SharedHostPool
from kvoffload.tiers.cpu.spec import CPUOffloadingSpec

# (engine id, our spec name, our config) -> the kvoffload spec of this process
# and which of get_manager / get_worker it still waits for; dropped once it
# has both, so a process that makes engine after engine does not keep pools.
_SHARED: dict[tuple[str, str, str], tuple[OffloadingSpec, set[str]]] = {}


def _shared_spec(engine_id: str, spec_name: str, config: Any) -> tuple[tuple, OffloadingSpec]:
    # Only the worker's process knows the layers' kinds and windows: leave
    # them out, so the scheduler's spec still finds the worker's.
    d = config.to_dict()
    d["groups"] = [g["tokens_per_block"] for g in d["groups"]]
    key = (engine_id, spec_name, json.dumps(d, sort_keys=True, default=str))
    if key not in _SHARED:
        _SHARED[key] = (get_spec_class(spec_name)(config), {"manager", "worker"})
    return key, _SHARED[key][0]


def _done(key: tuple | None, role: str) -> None:
    entry = _SHARED.get(key) if key is not None else None
    if entry is not None:
        entry[1].discard(role)
        if not entry[1]:
            del _SHARED[key]


class KVOffloadingSpec(vbase.OffloadingSpec):
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        vllm_names = metrics_vllm.enabled(extra_config)
        if vllm_names:
            # vLLM fills its deprecated vllm:kv_offload_total_bytes/_total_time/_size
            # {transfer_type} from our workers' results only for a CPUOffloadingSpec
            # (an issubclass check, its one use): say we are one. Irreversible for
            # the process, hence here, only when the option is on.
            from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as VLLMCPUOffloadingSpec

            VLLMCPUOffloadingSpec.register(cls)
        prime_metrics.install(dict(extra_config), vllm_names)  # our series at 0 from start-up
        return convert.metric_definitions(build_metric_definitions(dict(extra_config)), vllm_names)

    def __init__(self, config: Any):
        super().__init__(config)
        par = config.parallel
        self.tensor_parallel = par.world_size > 1
        if self.tensor_parallel and (par.world_size != par.tp_size or par.pp_size != 1
                                     or par.pcp_size != 1 or par.dcp_size != 1):
            raise ConfigError(
                f"kvoffload's vLLM plugin supports tensor parallelism only; world_size={par.world_size} "
                f"(tp={par.tp_size}, pp={par.pp_size}, pcp={par.pcp_size}, dcp={par.dcp_size}) is not supported"
            )
        self.spec_name = str(config.extra_config.get(convert.SPEC_KEY, "cpu"))
        self.vllm_metric_names = metrics_vllm.enabled(config.extra_config)
        spec_cls = get_spec_class(self.spec_name)
        accepted = _accepted_keys(spec_cls)
        if self.tensor_parallel and "shared_pool_path" not in accepted:
            raise ConfigError(f"kvoffload spec {self.spec_name!r} cannot share a host pool between TP ranks "
                              f"(no shared_pool_path key): tp={par.tp_size} needs one (e.g. \"cpu\")")
        layer_names = tuple(n for g in config.groups for n in g.layer_names)
        # Secondary tiers run beside the scheduler on the workers' host pool:
        # shared through a file when the worker is another process (TP, or
        # vLLM's multi-process executor at TP=1, the default of `vllm serve` on CPU).
        # Where the worker is not known (a scheduler's spec, under no vLLM
        # config, with no worker's here), the first of get_worker / get_manager says.
        layer_specs = convert.model_layer_specs(layer_names)
        where = "same"
        if not self.tensor_parallel and "shared_pool_path" in accepted \
                and _names_secondary_tiers(spec_cls, config.extra_config):
            where = _worker_process(config, self.spec_name)
        self.split = self.tensor_parallel or where != "same"
        self._pair_config = (convert.offloading_config(config, tuple(accepted), layer_specs)
                             if where == "unknown" else None)
        self.kvoffload_config = convert.offloading_config(
            config, tuple(accepted), layer_specs, shared_pool=self.split)
        check_config_offloadable(self.kvoffload_config)  # Mamba, indexers: refused here, by name
        # Our path, not the user's: the scheduler removes it once every rank has it open.
        self._own_pool_path = self.split and "shared_pool_path" not in config.extra_config
        self._spec_cls = spec_cls
        self._engine_id = config.engine_id
        self._scheduler_pool = None
        if self.split:
            # TP ranks (or the one worker) are processes of their own (vLLM's mp
            # executor): nothing to pair with; they share the host pool through
            # its file instead. A worker runs the CPU tier's worker alone; the
            # spec asked for (its secondary tiers) is built where the manager is
            # (get_manager).
            self._key = None
            extra = self.kvoffload_config.extra_config
            check_known_keys(extra, accepted, f"{spec_cls.__name__} extra_config")  # typos: refused here too
            self.inner = CPUOffloadingSpec(dataclasses.replace(self.kvoffload_config, extra_config={
                k: v for k, v in extra.items() if k in CPUOffloadingSpec.EXTRA_KEYS}))
            self.inner.pool_trailer_bytes = _pool_trailer_bytes(spec_cls, extra)  # as the scheduler maps it
        else:
            self._key, self.inner = _shared_spec(config.engine_id, self.spec_name, self.kvoffload_config)
        # vLLM's base class read these with bool() ("false" is true, null false); vLLM's
        # scheduler reads them here: take our spec's, which checked them strictly
        self.offload_prompt_only = self.inner.offload_prompt_only
        self.kv_events_config = dataclasses.replace(
            self.kv_events_config,
            self_describing_kv_events=self.inner.kv_events_config.self_describing_kv_events)
        self._manager: VLLMOffloadingManager | None = None

    def get_manager(self) -> VLLMOffloadingManager:
        self._pair_config = None  # the manager first: the worker is another process's
        if self._manager is None and self.split:
            self._manager = VLLMOffloadingManager(self._tp_manager(), self.vllm_metric_names)
        if self._manager is None:
            if _has_secondary_tiers(self.inner) and self.inner.worker is None:
                raise ConfigError(
                    "kvoffload secondary tiers (storage, remote) need vLLM's scheduler and worker "
                    "in one process, and the worker started first: run with the 'uni' executor "
                    "(on CPU: VLLM_ENABLE_V1_MULTIPROCESSING=0)"
                )
            self._manager = VLLMOffloadingManager(self.inner.get_manager(), self.vllm_metric_names)
            _done(self._key, "manager")
        return self._manager

    def _tp_manager(self) -> Any:
        """The scheduler's side under TP. vLLM sets up every rank's KV caches
        (each has made or mapped the pool file) before its scheduler: the
        manager takes the chunk geometry from the file, secondary tiers copy
        between the pool (mapped here too) and their media, then our own
        file can go. The pool holds whole canonical pages (the ranks refuse
        others), so persisted chunks are any TP layout's ("agnostic")."""
        extra = dict(self.kvoffload_config.extra_config)
        if "namespace" in extra:
            ns = dict(extra["namespace"])
            if ns.setdefault("parallel_layout", "agnostic") != "agnostic":
                raise ConfigError(f"namespace.parallel_layout={ns['parallel_layout']!r}, but TP ranks store "
                                  "canonical pages: 'agnostic' (leave it out)")
            extra["namespace"] = ns
        if not self.tensor_parallel and not Path(self.inner.shared_pool_path).exists():
            # at TP=1 the worker made its pool before this scheduler was built, or never will
            raise ConfigError(
                "kvoffload secondary tiers (storage, remote) need the host pool of vLLM's worker, and none "
                f"is at {self.inner.shared_pool_path}: run the worker first, or scheduler and worker in one "
                "process (the 'uni' executor; on CPU: VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        if self._spec_cls is not CPUOffloadingSpec or any(k in extra for k in CPUOffloadingSpec.OWN_KEYS):
            self.inner = self._spec_cls(dataclasses.replace(self.kvoffload_config, extra_config=extra))
        self.inner.take_pool_geometry()
        manager = self.inner.get_manager()
        if _has_secondary_tiers(self.inner):
            self._scheduler_pool = SharedHostPool.open(
                self.inner.shared_pool_path, self.inner.num_chunks, self.inner.kv_bytes_per_chunk,
                trailer_bytes=getattr(getattr(self.inner, "cpu", None), "pool_trailer_bytes", 0))
            self.inner.attach_tier_workers(self._scheduler_pool)
        if self._own_pool_path:
            Path(self.inner.shared_pool_path).unlink(missing_ok=True)
        return manager

    def get_worker(self, kv_caches: Any) -> VLLMOffloadingWorker:
        if self._pair_config is not None:  # the worker is here after all: one spec for both
            self.split = self._own_pool_path = False
            self.kvoffload_config, self._pair_config = self._pair_config, None
            self._key, self.inner = _shared_spec(self._engine_id, self.spec_name,
                                                 self.kvoffload_config)
        inner = self.inner.get_worker(convert.kv_caches(kv_caches))
        worker = VLLMOffloadingWorker(inner, getattr(self.inner, "shared_pool", None))
        _done(self._key, "worker")
        return worker


def _accepted_keys(spec_cls: type) -> set[str]:
    """extra_config keys a kvoffload spec class accepts (EXTRA_KEYS along its MRO)."""
    keys: set[str] = set(getattr(spec_cls, "OWN_KEYS", ()))  # the class's own (CPU: store_threshold)
    for c in spec_cls.__mro__:
        keys.update(c.__dict__.get("EXTRA_KEYS", ()))
    return keys


def _names_secondary_tiers(spec_cls: type, extra: Any) -> bool:
    """Whether the config asks the tiered spec for tiers below the CPU one."""
    from kvoffload.tiering.spec import TieredOffloadingSpec, _tier_configs

    if not issubclass(spec_cls, TieredOffloadingSpec):
        return False
    try:
        return bool(_tier_configs(dict(extra)))
    except ConfigError:
        return False  # the spec itself refuses it, with this message


def _pool_trailer_bytes(spec_cls: type, extra: Any) -> int:
    """Room after each pool chunk the secondary tiers ask for (the tiered spec's rule)."""
    from kvoffload.tiering.spec import TieredOffloadingSpec, _tier_configs
    from kvoffload.tiering.tier import get_tier_class

    if not issubclass(spec_cls, TieredOffloadingSpec):
        return 0
    return max((getattr(get_tier_class(c["type"]), "POOL_TRAILER_BYTES", 0) for c in _tier_configs(dict(extra))),
               default=0)


def _worker_process(config: Any, spec_name: str) -> str:
    """At TP=1, where vLLM's worker runs against its scheduler: "same",
    "other" or "unknown". A worker's spec is built under vLLM's current
    config, whose executor says it ("uni" shares the scheduler's process).
    The scheduler's is built after its workers set up their KV caches: with
    the "uni" executor its worker's spec is already here, waiting (_SHARED);
    else the worker is elsewhere, or this spec serves both (no vLLM)."""
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is not None:
        backend = vllm_config.parallel_config.distributed_executor_backend
        return "same" if backend in (None, "uni", "external_launcher") else "other"
    waiting = any(key[0] == config.engine_id and key[1] == spec_name and "manager" in roles
                  for key, (_, roles) in _SHARED.items())
    return "same" if waiting else "unknown"


def _has_secondary_tiers(spec: OffloadingSpec) -> bool:
    return bool(getattr(spec, "tier_configs", None))  # the tiered spec's; other specs have none
