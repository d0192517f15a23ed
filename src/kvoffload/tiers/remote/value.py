"""What a remote value is: a 24-byte header, then the chunk's bytes.

    magic b"KVOF" | version u16 | flags u16 (0 in v1) | payload length u64 | xxh3_64 u64

Checked on every load: a wrong magic, version, length or checksum (a
truncated, foreign or corrupted value) is a miss, never served.
"""

from __future__ import annotations

import struct

import xxhash

from kvoffload.abstractions import LoadStoreSpec
from kvoffload.tiers.base import Namespace

MAGIC = b"KVOF"
VERSION = 1
HEADER = struct.Struct("<4sHHQQ")
HEADER_BYTES = HEADER.size  # 24


def make_header(payload) -> bytes:
    return HEADER.pack(MAGIC, VERSION, 0, len(payload), xxhash.xxh3_64_intdigest(payload))


def check_header(header, expected_len: int) -> int | None:
    """The checksum the payload must have, or None if the header is not ours
    or announces another length."""
    magic, version, flags, length, checksum = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION or flags != 0 or length != expected_len:
        return None
    return checksum


def payload_ok(payload, checksum: int) -> bool:
    return xxhash.xxh3_64_intdigest(payload) == checksum


class KeySpace:
    """Redis key names: <prefix>:<namespace digest>:<offload key in hex>.
    The digest keeps models/layouts apart on a shared server; the prefix
    lets several deployments (or tests) share one server."""

    def __init__(self, prefix: str, namespace: Namespace):
        self.prefix = prefix
        self.namespace = namespace
        self.head = f"{prefix}:{namespace.digest()}:".encode()

    def redis_key(self, key: bytes) -> bytes:
        return self.head + key.hex().encode()

    def redis_keys(self, keys) -> list[bytes]:
        head = self.head
        return [head + k.hex().encode() for k in keys]

    @property
    def pattern(self) -> bytes:
        """SCAN/KEYS pattern matching every key of this namespace."""
        return self.head + b"*"


class RemoteLoadStoreSpec(LoadStoreSpec):
    """Where a remote job's chunks live: one redis key per offload key, in
    key order (the offload keys ride along so the worker can report which
    ones it found gone)."""

    def __init__(self, redis_keys: list[bytes], keys: list[bytes]):
        self.redis_keys = redis_keys
        self.keys = keys

    def __len__(self) -> int:
        return len(self.redis_keys)

    def __repr__(self) -> str:
        return f"RemoteLoadStoreSpec({len(self.redis_keys)} keys)"
