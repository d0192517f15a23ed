"""kvoffload: KV-cache offloading for LLM inference."""

from kvoffload.config import ConfigError, OffloadingConfig

__version__ = "0.1.0"
__all__ = ["ConfigError", "OffloadingConfig", "__version__"]
