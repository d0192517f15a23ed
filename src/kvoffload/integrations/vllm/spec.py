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

Model kinds: the worker's process builds its spec while vLLM loads the
model, so it reads each layer's KVCacheSpec (convert.model_layer_specs) and
refuses Mamba/SSM and indexer state by layer name; vLLM's scheduler picks
a sliding-window group's blocks itself (group_sizes, block_indices).
"""

from __future__ import annotations

import json
from typing import Any

from kvoffload.abstractions import OffloadingSpec
from kvoffload.config import ConfigError
from kvoffload.integrations.vllm import convert
from kvoffload.integrations.vllm._compat import vbase
from kvoffload.integrations.vllm.manager import VLLMOffloadingManager
from kvoffload.integrations.vllm.worker import VLLMOffloadingWorker
from kvoffload.layout import check_config_offloadable
from kvoffload.metrics import build_metric_definitions
from kvoffload.spec import get_spec_class

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


def _done(key: tuple, role: str) -> None:
    entry = _SHARED.get(key)
    if entry is not None:
        entry[1].discard(role)
        if not entry[1]:
            del _SHARED[key]


class KVOffloadingSpec(vbase.OffloadingSpec):
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return convert.metric_definitions(build_metric_definitions(dict(extra_config)))

    def __init__(self, config: Any):
        super().__init__(config)
        if config.parallel.world_size > 1:
            # Each rank would keep its own host pool under one scheduler-side
            # manager, and secondary tiers would see every rank write one slot.
            raise ConfigError(
                f"kvoffload's vLLM plugin runs one worker per engine for now; "
                f"world_size={config.parallel.world_size} (tp={config.parallel.tp_size}, "
                f"pp={config.parallel.pp_size}) is not supported"
            )
        self.spec_name = str(config.extra_config.get(convert.SPEC_KEY, "cpu"))
        spec_cls = get_spec_class(self.spec_name)
        layer_names = tuple(n for g in config.groups for n in g.layer_names)
        self.kvoffload_config = convert.offloading_config(
            config, tuple(_accepted_keys(spec_cls)), convert.model_layer_specs(layer_names))
        check_config_offloadable(self.kvoffload_config)  # Mamba, indexers: refused here, by name
        self._key, self.inner = _shared_spec(config.engine_id, self.spec_name, self.kvoffload_config)
        self._manager: VLLMOffloadingManager | None = None

    def get_manager(self) -> VLLMOffloadingManager:
        if self._manager is None:
            if _has_secondary_tiers(self.inner) and getattr(self.inner, "_worker", None) is None:
                raise ConfigError(
                    "kvoffload secondary tiers (storage, remote) need vLLM's scheduler and worker "
                    "in one process, and the worker started first: run with the 'uni' executor "
                    "(on CPU: VLLM_ENABLE_V1_MULTIPROCESSING=0)"
                )
            self._manager = VLLMOffloadingManager(self.inner.get_manager())
            _done(self._key, "manager")
        return self._manager

    def get_worker(self, kv_caches: Any) -> VLLMOffloadingWorker:
        worker = VLLMOffloadingWorker(self.inner.get_worker(convert.kv_caches(kv_caches)))
        _done(self._key, "worker")
        return worker


def _accepted_keys(spec_cls: type) -> set[str]:
    """extra_config keys a kvoffload spec class accepts (EXTRA_KEYS along its MRO)."""
    keys: set[str] = set()
    for c in spec_cls.__mro__:
        keys.update(c.__dict__.get("EXTRA_KEYS", ()))
    return keys


def _has_secondary_tiers(spec: OffloadingSpec) -> bool:
    return bool(getattr(spec, "_tier_confs", None))
