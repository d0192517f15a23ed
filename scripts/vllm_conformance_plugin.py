"""pytest plugin: run vLLM's own offloading tests with kvoffload in place of
vLLM's CPU tier (scripts/vllm_conformance.sh loads it with -p).

Before vLLM's test modules are collected (they import these names), it
rebinds
  vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager -> KVCPUManager: our
      CPU manager behind our vLLM adapter (what vLLM's scheduler calls);
  vllm.v1.kv_offload.cpu.spec.CPUOffloadingSpec and the spec factory's
      "CPUOffloadingSpec" -> KVCPUSpec: our vLLM spec with kvoffload_spec "cpu".
vLLM's tiering manager and spec (subclasses of vLLM's CPU ones) stay vLLM's.
Only types are translated (our CPU LoadStoreSpec is returned as vLLM's, with
the same slots); every answer is our manager's. Nothing of vLLM's is copied.
"""

from __future__ import annotations

from typing import Any

import pytest

KVCPUManager: type | None = None
KVCPUSpec: type | None = None


def _install() -> None:
    # Built here, not at import: kvoffload's vLLM adapter imports vLLM.
    global KVCPUManager, KVCPUSpec
    if KVCPUManager is not None:
        return
    KVCPUManager, KVCPUSpec = _manager_class(), _spec_class()
    # vLLM's tiering subclasses its CPU manager and spec (its primary tier):
    # imported first, it keeps vLLM's, so its own tests stay about vLLM.
    import vllm.v1.kv_offload.tiering.manager  # noqa: F401
    import vllm.v1.kv_offload.tiering.spec  # noqa: F401
    import vllm.v1.kv_offload.cpu.manager as vmanager
    import vllm.v1.kv_offload.cpu.spec as vspec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    vmanager.CPUOffloadingManager = KVCPUManager
    vspec.CPUOffloadingSpec = KVCPUSpec
    OffloadingSpecFactory._registry["CPUOffloadingSpec"] = lambda: KVCPUSpec


def pytest_configure(config: pytest.Config) -> None:
    _install()


def pytest_report_header(config: pytest.Config) -> str:
    import kvoffload

    return f"kvoffload conformance: vLLM's CPU manager and spec replaced by kvoffload ({kvoffload.__file__})"


def _vllm_cpu_spec(spec: Any) -> Any:
    """Our CPU LoadStoreSpec as vLLM's (same slots); others unchanged."""
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VCPUSpec

    from kvoffload.abstractions import CPULoadStoreSpec

    if type(spec) is CPULoadStoreSpec:
        return VCPUSpec(spec.block_ids.tolist())
    return spec


def _manager_class():
    from kvoffload.integrations.vllm.manager import VLLMOffloadingManager

    class KVCPUManager(VLLMOffloadingManager):
        """vLLM's CPUOffloadingManager signature; kvoffload's CPU manager inside."""

        def __init__(self, num_chunks: int, cache_policy: str = "lru",
                     cache_policy_module_path: str | None = None, enable_events: bool = False,
                     store_threshold: int = 1, max_tracker_size: int = 64_000, info: Any = None):
            from kvoffload.tiers.cpu.manager import CPUOffloadingManager

            if cache_policy_module_path is not None or store_threshold > 1:
                # not in our CPU tier: a custom policy module is ours to name
                # (kvoffload.policies), admission thresholds live in tiering
                raise NotImplementedError(
                    f"kvoffload's CPU manager has no cache_policy_module_path / store_threshold>1 "
                    f"(got {cache_policy_module_path!r}, {store_threshold})")
            super().__init__(CPUOffloadingManager(num_chunks, policy=cache_policy, enable_events=enable_events))

        def prepare_load(self, keys, req_context):
            return _vllm_cpu_spec(super().prepare_load(keys, req_context))

        def prepare_store(self, keys, req_context):
            out = super().prepare_store(keys, req_context)
            if out is not None:
                out.store_spec = _vllm_cpu_spec(out.store_spec)
            return out

    return KVCPUManager


def _spec_class():
    from kvoffload.integrations.vllm.spec import KVOffloadingSpec

    class KVCPUSpec(KVOffloadingSpec):
        """vLLM's CPU spec name; kvoffload's "cpu" spec inside."""

        def __init__(self, config: Any):
            extra = dict(config.extra_config)
            extra.setdefault("kvoffload_spec", "cpu")
            try:
                config.extra_config = extra
            except Exception:  # a frozen config: rebuild it with our key
                import dataclasses

                config = dataclasses.replace(config, extra_config=extra)
            super().__init__(config)

    return KVCPUSpec

