"""The offload configurations the serving benchmarks compare, and the real
stores behind them (a redis-server, a mooncake_master with a store node, a
storage directory), started once and shared by every server that names them.

A configuration is a name and the --kv-transfer-config it gives vLLM (None:
no offloading). Servers that share a store must also share the namespace
(model, dtype, layout), which they do when they serve the same model.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

# vllm-all: no offloading, vLLM's own cache big enough for every shared prefix: the
# most any offloading could give (every reuse served from the engine's memory, nothing moved)
CONFIG_NAMES = ("none", "vllm-all", "cpu", "cpu-lru", "cpu+storage", "cpu+redis", "cpu+mooncake",
                "shared-redis", "shared-mooncake")
# run only when named: store_threshold 2 (a chunk stored on its second offer: vLLM's
# key on the CPU tier; on a remote tier, written down once stored and reused)
OPTIONAL_CONFIGS = ("cpu-t2", "cpu+redis-t2", "cpu+mooncake-t2")
STORE_THRESHOLD = {"cpu-t2": 2, "cpu+redis-t2": 2, "cpu+mooncake-t2": 2}  # offers a block needs (else 1)
# the two-server configurations: server A is the named single-server one
SHARED_WITH = {"shared-redis": "cpu+redis", "shared-mooncake": "cpu+mooncake"}


def connector(extra: dict) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "KVOffloadingSpec",
                                          "spec_module_path": "kvoffload.integrations.vllm", **extra}}


class Stores:
    """Redis / Mooncake / a storage directory, each started on first use."""

    def __init__(self, work_dir: Path, redis_bytes: str = "3gb", mooncake_bytes: int = 2 << 30,
                 storage_bytes: str = "4GiB", storage_dir: str | None = None):
        self.work_dir = Path(work_dir)
        self.redis_bytes, self.mooncake_bytes, self.storage_bytes = redis_bytes, mooncake_bytes, storage_bytes
        self._storage_dir = storage_dir
        self.redis = None
        self.mooncake = None

    def redis_url(self) -> str:
        if self.redis is None:
            from kvoffload.tiers.redis.server import LocalServer

            self.redis = LocalServer(maxmemory=self.redis_bytes).start()
        return self.redis.url

    def mooncake_url(self) -> str:
        if self.mooncake is None:
            from kvoffload.tiers.mooncake.server import LocalMooncake

            self.mooncake = LocalMooncake(store_bytes=self.mooncake_bytes).start()
        # segment_bytes=0: the engines lend no memory, the store node holds the values (they outlive server A)
        return self.mooncake.url + "&segment_bytes=0"

    def storage_dir(self) -> str:
        if self._storage_dir is None:
            self._storage_dir = tempfile.mkdtemp(prefix="storage-", dir=self.work_dir)
        return self._storage_dir

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
        if self.mooncake is not None:
            self.mooncake.close()
        if self._storage_dir is not None:
            shutil.rmtree(self._storage_dir, ignore_errors=True)


def kv_config(name: str, stores: Stores, cpu_bytes: str, tier_cpu_bytes: str) -> dict | None:
    """The --kv-transfer-config of a configuration. Tiered ones get a smaller
    CPU tier (tier_cpu_bytes) so the secondary tier serves part of the load."""
    name = SHARED_WITH.get(name, name)
    if name in ("none", "vllm-all"):
        return None
    if name == "cpu":
        return connector({"kvoffload_spec": "cpu", "cpu_bytes_to_use": cpu_bytes})
    if name == "cpu-t2":
        return connector({"kvoffload_spec": "cpu", "cpu_bytes_to_use": cpu_bytes,
                          "store_threshold": STORE_THRESHOLD[name]})
    if name == "cpu-lru":
        return connector({"kvoffload_spec": "cpu", "cpu_bytes_to_use": cpu_bytes, "eviction_policy": "lru"})
    tiered = {"kvoffload_spec": "tiered", "cpu_bytes_to_use": tier_cpu_bytes}
    if name == "cpu+storage":
        return connector({**tiered, "storage_dir": stores.storage_dir(), "storage_bytes": stores.storage_bytes})
    if name == "cpu+redis":
        return connector({**tiered, "remote_url": stores.redis_url()})
    if name == "cpu+mooncake":
        return connector({**tiered, "remote_url": stores.mooncake_url()})
    if name in ("cpu+redis-t2", "cpu+mooncake-t2"):
        kind = name.partition("+")[2].partition("-")[0]
        url = stores.redis_url() if kind == "redis" else stores.mooncake_url()
        # keys of their own: the store may still hold what the cpu+redis / cpu+mooncake run stored
        return connector({**tiered, "secondary_tiers": [{"type": kind, "url": url, "key_prefix": "kvoffload-t2",
                                                         "store_threshold": STORE_THRESHOLD[name]}]})
    raise ValueError(f"unknown configuration {name!r}; known: {', '.join(CONFIG_NAMES)}")


def describe(name: str, cpu_bytes: str, tier_cpu_bytes: str) -> str:
    base = SHARED_WITH.get(name)
    if base:
        return f"server B (fresh, CPU {tier_cpu_bytes}) over the store server A ({base}) filled"
    fixed = {"none": "no offloading", "vllm-all": "no offloading, vLLM's own cache holds every shared prefix",
             "cpu": f"CPU tier {cpu_bytes}, default policy",
             "cpu-lru": f"CPU tier {cpu_bytes}, lru", "cpu-t2": f"CPU tier {cpu_bytes}, store_threshold 2"}
    if name in STORE_THRESHOLD and "+" in name:
        return f"CPU {tier_cpu_bytes} + {name.partition('+')[2].partition('-')[0]}, store_threshold 2 on it"
    return fixed.get(name) or f"CPU {tier_cpu_bytes} + {name.partition('+')[2]}"
