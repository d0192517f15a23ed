"""kvoffload's storage, Redis and Mooncake tiers as an SGLang HiCache L3
storage backend. See README "SGLang HiCache backend".

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvoffload", "module_path": "kvoffload.integrations.sglang.backend",
      "class_name": "KvoffloadHiCacheStorage", "interface_v1": 1,
      "kvoffload": {"type": "redis", "url": "redis://cache:6379/0"}}'

The backend classes import SGLang, so they are loaded on first use.
"""

_BACKENDS = ("KvoffloadHiCacheStorage", "KvoffloadStorageHiCache", "KvoffloadRedisHiCache",
             "KvoffloadMooncakeHiCache")
__all__ = list(_BACKENDS)


def __getattr__(name: str):
    if name in _BACKENDS:
        from kvoffload.integrations.sglang import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
