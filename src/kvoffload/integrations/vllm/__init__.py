"""kvoffload inside vLLM: an OffloadingSpec for vLLM's OffloadingConnector.

Set `"spec_name": "KVOffloadingSpec", "spec_module_path":
"kvoffload.integrations.vllm"` in kv_connector_extra_config. vLLM is imported
only when the spec is (so kvoffload itself never needs vLLM).
"""

__all__ = ["KVOffloadingSpec"]


def __getattr__(name: str):
    if name == "KVOffloadingSpec":
        from kvoffload.integrations.vllm.spec import KVOffloadingSpec

        return KVOffloadingSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
