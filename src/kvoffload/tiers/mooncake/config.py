"""Settings of the Mooncake Store tier, checked once at start-up.

Every bad value raises ConfigError naming the key (mooncake.<key>). The
MAC key never appears in messages, logs or reprs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar
from urllib.parse import parse_qsl, urlsplit

from kvoffload.config import (MIN_TIMEOUT_S, ConfigError, check_known_keys, parse_bytes, positive_int, seconds,
                              thread_count)
from kvoffload.tiers.remote.config import RemoteConfig

# what the installed client has metadata plugins for: any other scheme aborts the process in set-up
METADATA_SCHEMES = ("http://", "https://", "etcd://")
MAX_REPLICAS = 64  # copies of a value; the master allocates per copy (2**40 failed every put, 2**64 raised)
DEFAULT_METADATA_PORT = 8080  # mooncake_master -http_metadata_server_port default
URL_KEYS = ("metadata_server", "segment_bytes", "local_buffer_bytes", "key_prefix", "protocol", "local_hostname")


def split_host_port(value: Any, key: str) -> tuple[str, int]:
    if not isinstance(value, str) or value.count(":") != 1:
        raise ConfigError(f"{key} must be 'host:port', got {value!r}")
    host, port = value.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key} must be 'host:port' with a port in 1..65535, got {value!r}")
    return host, int(port)


@dataclass(frozen=True)
class MooncakeConfig:
    master_address: str = "127.0.0.1:50051"  # mooncake_master -rpc_port
    metadata_server: str = f"http://127.0.0.1:{DEFAULT_METADATA_PORT}/metadata"  # or etcd://, P2PHANDSHAKE
    local_hostname: str = "127.0.0.1"  # address other clients reach this one's segment at
    protocol: str = "tcp"  # or rdma
    device_names: str = ""  # RDMA devices (rdma only)
    # Memory this process lends to the shared store (0: only a client; then
    # store nodes, e.g. `mooncake_client -global_segment_size=...`, hold the data).
    # Data in it goes when this process exits.
    segment_bytes: int = 1 << 30
    local_buffer_bytes: int = 16 << 20  # the client's own staging buffer (our transfers bypass it)
    replicas: int = 1  # copies of each value in the store
    key_prefix: str = "kvoffload"  # keys: <prefix>:<namespace digest>:<hex key>
    connect_timeout_s: float = 1.0  # start-up reachability check; MC_RPC_CONNECT_TIMEOUT_MS
    rpc_timeout_s: float = 2.0  # MC_RPC_TIMEOUT_MS: bounds every wait on a paused master
    # MC_TCP_PROGRESS_TIMEOUT_SEC / MC_TCP_STATUS_TIMEOUT_SEC (whole seconds, rounded up): a transfer
    # to a paused or dead store node that makes no progress this long fails (the client's default: 60 s)
    transfer_timeout_s: float = 2.0
    lookup_cache_s: float = 2.0  # how long a "present" answer is trusted
    miss_cache_s: float = 0.25  # how long an "absent" answer is trusted
    lookup_coalesce_s: float = 0.002  # wait this long to batch lookups before a check
    lookup_deadline_s: float = 0.5  # a lookup unanswered this long after its first RETRY is a MISS
    # transfer threads: the client's calls release the GIL and small values are latency-bound, so one
    # thread would queue promotions behind cascaded stores (CPU slots stay pinned, requests wait)
    io_threads: int = 4
    batch_bytes: int = 32 << 20  # bytes per batched put/get call
    max_queue_bytes: int = 1 << 30  # stores queued beyond this are dropped (back-pressure)
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 5.0
    mac_key_file: str | None = None  # shared secret for a keyed MAC (see tiers/remote/value.py)
    mac_key_env: str | None = None
    mac_algorithm: str = "blake2b"
    section: ClassVar[str] = "mooncake"  # how messages name these keys
    cluster: ClassVar[bool] = False  # the Redis worker we build on asks; Mooncake shards by itself

    def __post_init__(self):
        split_host_port(self.master_address, "mooncake.master_address")
        ms = self.metadata_server
        if not isinstance(ms, str) or not (ms == "P2PHANDSHAKE" or ms.startswith(METADATA_SCHEMES)):
            raise ConfigError(f"mooncake.metadata_server must be an http://, https:// or etcd:// address "
                              f"or P2PHANDSHAKE (the Mooncake client has no other metadata plugin), got {ms!r}")
        if ms.startswith(("http://", "https://")):  # start-up connects to it: a bad port must be named here
            try:
                urlsplit(ms).port
            except ValueError as e:
                raise ConfigError(f"mooncake.metadata_server {ms!r}: {e}") from None
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"mooncake.protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        for key in ("local_hostname", "device_names", "key_prefix"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"mooncake.{key} must be a string, got {getattr(self, key)!r}")
        if not self.local_hostname:
            raise ConfigError("mooncake.local_hostname must not be empty")
        if not self.key_prefix or any(c.isspace() for c in self.key_prefix):
            raise ConfigError(f"mooncake.key_prefix must be a non-empty string without spaces, "
                              f"got {self.key_prefix!r}")
        if not isinstance(self.segment_bytes, int) or isinstance(self.segment_bytes, bool) or self.segment_bytes < 0:
            raise ConfigError(f"mooncake.segment_bytes must be a size >= 0, got {self.segment_bytes!r}")
        for key in ("local_buffer_bytes", "replicas", "batch_bytes", "max_queue_bytes"):
            positive_int(getattr(self, key), f"mooncake.{key}")
        thread_count(self.io_threads, "mooncake.io_threads")
        if self.replicas > MAX_REPLICAS:
            raise ConfigError(f"mooncake.replicas must be at most {MAX_REPLICAS}, got {self.replicas!r}")
        for key in ("connect_timeout_s", "rpc_timeout_s"):
            seconds(getattr(self, key), f"mooncake.{key}", MIN_TIMEOUT_S)
        seconds(self.transfer_timeout_s, "mooncake.transfer_timeout_s", 1.0)  # the client counts whole seconds
        for key in ("lookup_cache_s", "miss_cache_s", "lookup_coalesce_s", "lookup_deadline_s", "backoff_initial_s",
                    "backoff_max_s"):
            seconds(getattr(self, key), f"mooncake.{key}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ConfigError(f"mooncake.backoff_max_s ({self.backoff_max_s}) must be >= "
                              f"mooncake.backoff_initial_s ({self.backoff_initial_s})")
        if self.lookup_deadline_s <= self.lookup_coalesce_s:
            raise ConfigError(f"mooncake.lookup_deadline_s ({self.lookup_deadline_s}) must be more than "
                              f"mooncake.lookup_coalesce_s ({self.lookup_coalesce_s})")
        for key in ("mac_key_file", "mac_key_env"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), str):
                raise ConfigError(f"mooncake.{key} must be a string")
        if self.mac_key_file is not None and self.mac_key_env is not None:
            raise ConfigError("mooncake.mac_key_file and mooncake.mac_key_env: give at most one")
        if self.mac_algorithm not in ("blake2b", "blake3"):
            raise ConfigError(f"mooncake.mac_algorithm must be 'blake2b' or 'blake3', got {self.mac_algorithm!r}")

    def __repr__(self) -> str:  # no secrets here: the MAC key is read from a file or env var by name
        return f"MooncakeConfig({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields(self))})"

    def load_mac_key(self) -> bytes | None:
        return RemoteConfig.load_mac_key(self)  # same rules, messages say mooncake.*

    @staticmethod
    def url_fields(url: str) -> dict[str, Any]:
        """mooncake://HOST:RPC_PORT[?metadata_server=...&segment_bytes=...] as config keys.
        Without metadata_server: the master's own HTTP metadata server on HOST:8080."""
        if not isinstance(url, str):
            raise ConfigError(f"mooncake.url must be a string, got {type(url).__name__}")
        try:
            parts = urlsplit(url)
            query = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)))
        except ValueError as e:
            raise ConfigError(f"mooncake.url {url!r}: {e}") from None
        if parts.scheme != "mooncake" or not parts.netloc or parts.path not in ("", "/"):
            raise ConfigError(f"mooncake.url {url!r}: must be mooncake://HOST:PORT[?metadata_server=URL&...]")
        check_known_keys(query, URL_KEYS, f"mooncake.url {url!r} query")
        host, _ = split_host_port(parts.netloc, "mooncake.url's HOST:PORT")
        return {"master_address": parts.netloc,
                "metadata_server": f"http://{host}:{DEFAULT_METADATA_PORT}/metadata", **query}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> MooncakeConfig:
        d = dict(d or {})
        url = d.pop("url", None)
        check_known_keys(d, [f.name for f in fields(cls)], "mooncake tier config")
        if url is not None:
            d = {**cls.url_fields(url), **d}  # explicit keys win over the URL's
        for key in ("segment_bytes", "local_buffer_bytes", "batch_bytes", "max_queue_bytes"):
            if key == "segment_bytes" and d.get(key) in (0, "0"):  # 0: lend no memory
                d[key] = 0
            elif key in d:
                d[key] = parse_bytes(d[key], f"mooncake.{key}")
        return cls(**d)
