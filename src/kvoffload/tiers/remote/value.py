"""What a remote value is: a 48-byte header, then the chunk's bytes.

    magic b"KVOF" | version u16 | flags u16 | payload length u64
    | xxh3_64(full Redis key) u64 | xxh3_64(header so far + payload) u64 | MAC 16 bytes

The key hash binds a value to the key (prefix, namespace digest, offload
key) it was stored under: a value copied or renamed under another key, or
another namespace's value, is refused. The checksum covers the header
before it (so the key hash and length cannot be flipped unseen) and the
payload. With a shared secret (remote.mac_key_file / mac_key_env), a flag
names the MAC (BLAKE2b, or BLAKE3 with remote.mac_algorithm) and the last
field is that hash keyed over key + header + payload: someone who can write
to the server but lacks the secret cannot forge a value. Without one the
flags and MAC field are zero.

Checked on every load: anything else (a truncated, foreign, corrupted,
misplaced or forged value, or a version 1 value from before the key
binding) is a miss, counted, never served.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import xxhash

from kvoffload.abstractions import LoadStoreSpec
from kvoffload.tiers.base import Namespace

MAGIC = b"KVOF"
VERSION = 2  # 1: no key hash, no MAC
MAC_FLAGS = {"blake2b": 1, "blake3": 2}  # flags: which keyed hash made the MAC field
HEADER = struct.Struct("<4sHHQQQ16s")
HEADER_BYTES = HEADER.size  # 48
_CHECKED = 24  # header bytes covered by the checksum: through the key hash
_MACED = 32  # header bytes covered by the MAC: through the checksum
MAC_BYTES = 16
_NO_MAC = bytes(MAC_BYTES)

# what a load found under a key
OK, MISSING, CORRUPT, ERROR, WRONG_KEY, BAD_MAC, WRONG_TYPE = range(7)


def key_hash(redis_key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(redis_key)


class ValueCodec:
    """Makes and checks headers; holds the MAC key (never shown)."""

    def __init__(self, mac_key: bytes | None = None, algorithm: str = "blake2b"):
        """mac_key: 32 bytes (RemoteConfig.load_mac_key) or None for no MAC."""
        self._mac_key = mac_key
        self.algorithm = algorithm if mac_key is not None else None
        self._flag = MAC_FLAGS[algorithm] if mac_key is not None else 0
        if self._flag == MAC_FLAGS["blake3"]:
            import blake3  # checked by RemoteConfig; imported only when used

            self._blake3 = blake3.blake3

    def __repr__(self) -> str:
        return f"ValueCodec(mac={self.algorithm or 'off'})"

    def _mac(self, redis_key: bytes, head, payload) -> bytes:
        if self._flag == MAC_FLAGS["blake3"]:
            m = self._blake3(key=self._mac_key)
        else:
            m = hashlib.blake2b(key=self._mac_key, digest_size=MAC_BYTES)
        m.update(len(redis_key).to_bytes(4, "little"))
        m.update(redis_key)
        m.update(head)
        m.update(payload)
        return m.digest()[:MAC_BYTES]

    def header(self, redis_key: bytes, payload) -> bytes:
        flags = self._flag
        head = struct.pack("<4sHHQQ", MAGIC, VERSION, flags, len(payload), key_hash(redis_key))
        h = xxhash.xxh3_64(head)
        h.update(payload)
        head += struct.pack("<Q", h.intdigest())
        return head + (self._mac(redis_key, head, payload) if flags else _NO_MAC)

    @staticmethod
    def shape_ok(header, expected_len: int) -> bool:
        """Whether a header is ours, this version, for a payload of this length
        (checked before reading the payload; verify() does the rest)."""
        magic, version, flags, length, _, _, _ = HEADER.unpack(header)
        return magic == MAGIC and version == VERSION and flags in (0, *MAC_FLAGS.values()) and length == expected_len

    def verify(self, redis_key: bytes, header, payload) -> int:
        """OK, or why the value under redis_key must not be served."""
        _, _, flags, _, khash, checksum, mac = HEADER.unpack(header)
        head = memoryview(header)[:_CHECKED]
        h = xxhash.xxh3_64(head)
        h.update(payload)
        if h.intdigest() != checksum or (not flags and mac != _NO_MAC):
            return CORRUPT
        if khash != key_hash(redis_key):
            return WRONG_KEY
        if self._flag:
            # a value without a MAC, or with another secret's or algorithm's, is a forgery here
            if flags != self._flag or not hmac.compare_digest(
                    mac, self._mac(redis_key, memoryview(header)[:_MACED], payload)):
                return BAD_MAC
        return OK


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
