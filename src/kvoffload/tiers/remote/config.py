"""Settings of the remote tier, checked once at start-up.

Every bad value raises ConfigError naming the key. The password and the
MAC key never appear in messages, logs or reprs (see kvoffload.redact).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar
from urllib.parse import urlsplit

from kvoffload.config import (MIN_TIMEOUT_S, ConfigError, check_known_keys, parse_bytes, positive_int, seconds,
                              thread_count)
from kvoffload.redact import MASK, redact_url

SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")
MIN_MAC_KEY_BYTES = 16
MAX_TTL_S = 10 * 365 * 86400  # 10 years; Redis refuses every SET beyond about 9e15 s


@dataclass(frozen=True)
class RemoteConfig:
    url: str = "redis://127.0.0.1:6379/0"  # redis://, rediss:// (TLS), unix:///path.sock
    username: str | None = None  # ACL user; overrides the URL's
    password: str | None = None  # overrides the URL's
    password_env: str | None = None  # or: name of an environment variable holding it
    password_file: str | None = None  # or: a file holding it (e.g. a mounted secret)
    key_prefix: str = "kvoffload"  # keys: <prefix>:<namespace digest>:<hex key>
    cluster: bool = False  # Redis Cluster (redis.cluster.RedisCluster)
    connect_timeout_s: float = 1.0
    socket_timeout_s: float = 2.0  # per send/receive call: a stalled transfer takes up to 2-3x (docs/REMOTE.md)
    # A GET/SET round slower than this fails (its deadline: socket_timeout_s + its bytes at this rate): a
    # link that trickles bytes never lets one call time out. 0: no deadline. At 16 MiB/s a load is far
    # slower than recomputing its blocks, so a healthy link never comes near it.
    min_transfer_mib_s: float = 16.0
    ttl_s: int | None = None  # SET ... EX ttl_s; None leaves expiry to the server
    lookup_cache_s: float = 2.0  # how long a "present" answer is trusted
    miss_cache_s: float = 0.25  # how long an "absent" answer is trusted (short: other engines store)
    lookup_coalesce_s: float = 0.002  # wait this long to batch lookups before a check
    lookup_deadline_s: float = 0.5  # a lookup unanswered this long after its first RETRY is a MISS
    # data connections (one thread each); a load of >= 2 MiB is split over them. 4: loads of many
    # chunks ran fastest with 4 of 1/2/4 (docs/BENCHMARKS.md "Remote tier"), the server's output and our
    # checks overlapping; each connection may hold batch_bytes of replies in the server's output buffer
    io_threads: int = 4
    batch_bytes: int = 32 << 20  # bytes per pipelined GET/SET round
    max_queue_bytes: int = 1 << 30  # stores queued beyond this are refused (the tiering manager retries them)
    backoff_initial_s: float = 0.05  # first reconnect delay after a failure
    backoff_max_s: float = 5.0  # cap of the exponential back-off
    tls_ca_certs: str | None = None  # CA bundle for rediss://
    tls_verify: bool = True  # verify the server certificate for rediss://
    # Shared secret for a keyed MAC over key + header + payload (servers shared
    # between trust domains). Read from a file or an environment variable so
    # it never sits in a config; at most one of the two.
    mac_key_file: str | None = None
    mac_key_env: str | None = None
    mac_algorithm: str = "blake2b"  # blake2b (stdlib) or blake3 (pip blake3; several times faster)
    section: ClassVar[str] = "remote"  # how messages name these keys (the Mooncake tier reuses load_mac_key)

    def __post_init__(self):
        if not isinstance(self.url, str):
            raise ConfigError(f"remote.url must be a string, got {self.url!r}")
        try:
            parts = urlsplit(self.url)
            port = parts.port  # checks it
        except ValueError as e:  # e.g. "Invalid IPv6 URL", "Port out of range 0-65535"
            raise ConfigError(f"remote.url {self.redacted_url!r}: {e}") from None
        if port == 0:
            raise ConfigError(f"remote.url {self.redacted_url!r}: the port must be in 1..65535")
        scheme = parts.scheme
        if scheme not in SCHEMES:
            raise ConfigError(f"remote.url {self.redacted_url!r}: scheme must be one of {list(SCHEMES)}")
        if self.cluster and scheme in ("unix",):
            raise ConfigError("remote.cluster: Redis Cluster needs a redis:// or rediss:// url, not unix://")
        for key in ("username", "password", "password_env", "password_file", "tls_ca_certs", "mac_key_file",
                    "mac_key_env"):
            v = getattr(self, key)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"remote.{key} must be a string, got {type(v).__name__}")
        if not isinstance(self.key_prefix, str) or not self.key_prefix or any(c.isspace() for c in self.key_prefix):
            raise ConfigError(f"remote.key_prefix must be a non-empty string without spaces, got {self.key_prefix!r}")
        for key in ("cluster", "tls_verify"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"remote.{key} must be true or false, got {getattr(self, key)!r}")
        for key in ("connect_timeout_s", "socket_timeout_s"):
            seconds(getattr(self, key), f"remote.{key}", MIN_TIMEOUT_S)
        for key in ("lookup_cache_s", "miss_cache_s", "lookup_coalesce_s", "lookup_deadline_s", "backoff_initial_s",
                    "backoff_max_s"):
            seconds(getattr(self, key), f"remote.{key}")
        rate = self.min_transfer_mib_s
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < float("inf"):
            raise ConfigError(f"remote.min_transfer_mib_s must be a number >= 0 (0: no deadline), got {rate!r}")
        if self.ttl_s is not None:
            positive_int(self.ttl_s, "remote.ttl_s")
            if self.ttl_s > MAX_TTL_S:  # every store would fail ("invalid expire time"), counted, unlogged
                raise ConfigError(f"remote.ttl_s must be at most {MAX_TTL_S} (10 years), got {self.ttl_s}; "
                                  f"leave it unset for no expiry")
        thread_count(self.io_threads, "remote.io_threads")
        positive_int(self.batch_bytes, "remote.batch_bytes")
        positive_int(self.max_queue_bytes, "remote.max_queue_bytes")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ConfigError(f"remote.backoff_max_s ({self.backoff_max_s}) must be >= "
                              f"remote.backoff_initial_s ({self.backoff_initial_s})")
        if self.lookup_deadline_s <= self.lookup_coalesce_s:
            raise ConfigError(f"remote.lookup_deadline_s ({self.lookup_deadline_s}) must be more than "
                              f"remote.lookup_coalesce_s ({self.lookup_coalesce_s})")
        if sum(getattr(self, k) is not None for k in ("password", "password_env", "password_file")) > 1:
            raise ConfigError("remote.password, remote.password_env and remote.password_file: give at most one")
        if self.mac_key_file is not None and self.mac_key_env is not None:
            raise ConfigError("remote.mac_key_file and remote.mac_key_env: give at most one")
        if self.mac_algorithm not in ("blake2b", "blake3"):
            raise ConfigError(f"remote.mac_algorithm must be 'blake2b' or 'blake3', got {self.mac_algorithm!r}")
        if self.mac_algorithm == "blake3" and (self.mac_key_file or self.mac_key_env):
            try:
                import blake3  # noqa: F401
            except ImportError:
                raise ConfigError("remote.mac_algorithm 'blake3' needs the blake3 package "
                                  "(pip install blake3)") from None

    @property
    def redacted_url(self) -> str:
        """The URL with any password replaced, for messages and logs."""
        return redact_url(self.url)

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "url":
                v = self.redacted_url
            elif f.name == "password" and v is not None:
                v = MASK
            shown.append(f"{f.name}={v!r}")
        return f"RemoteConfig({', '.join(shown)})"

    __str__ = __repr__

    def load_password(self) -> str | None:
        """password, or the one password_env / password_file names (None: the URL's, if any)."""
        if self.password_env is not None:
            value = os.environ.get(self.password_env)
            if value is None:
                raise ConfigError(f"remote.password_env {self.password_env!r}: the environment variable is not set")
            return value
        if self.password_file is not None:
            try:
                with open(self.password_file, encoding="utf-8") as f:
                    return f.read().rstrip("\r\n")
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"remote.password_file {self.password_file!r}: cannot read it "
                                  f"({getattr(e, 'strerror', None) or type(e).__name__})") from None
        return self.password

    def load_mac_key(self) -> bytes | None:
        """The MAC key from mac_key_file / mac_key_env (None: no MAC).
        Any length of at least 16 bytes; hashed to the 32 bytes BLAKE2b takes."""
        import hashlib

        if self.mac_key_file is not None:
            where = f"{self.section}.mac_key_file {self.mac_key_file!r}"
            try:
                with open(self.mac_key_file, "rb") as f:
                    secret = f.read().rstrip(b"\r\n")
            except OSError as e:
                raise ConfigError(f"{where}: cannot read it ({e.strerror})") from None
        elif self.mac_key_env is not None:
            where = f"{self.section}.mac_key_env {self.mac_key_env!r}"
            value = os.environ.get(self.mac_key_env)
            if value is None:
                raise ConfigError(f"{where}: the environment variable is not set")
            secret = value.encode()
        else:
            return None
        if len(secret) < MIN_MAC_KEY_BYTES:
            raise ConfigError(f"{where}: the key must be at least {MIN_MAC_KEY_BYTES} bytes, got {len(secret)}")
        return hashlib.blake2b(secret, digest_size=32, person=b"kvoffload-mac").digest()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> RemoteConfig:
        d = dict(d or {})
        check_known_keys(d, [f.name for f in fields(cls)], "remote tier config")
        for key in ("batch_bytes", "max_queue_bytes"):
            if key in d:
                d[key] = parse_bytes(d[key], f"remote.{key}")
        return cls(**d)
