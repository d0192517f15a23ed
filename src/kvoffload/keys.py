"""Offload keys: a block hash plus its KV cache group, packed as bytes.

Bytes rather than tuples: a dict keyed by bytes hashes once (cached) and
creates no GC-tracked objects, which matters at millions of keys.
"""

from collections.abc import Collection
from typing import NewType

OffloadKey = NewType("OffloadKey", bytes)

GROUP_BYTES = 4


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack a block hash and a KV cache group index into one key."""
    if not isinstance(block_hash, (bytes, bytearray)):
        raise TypeError(f"block_hash must be bytes, got {type(block_hash).__name__}")
    if not 0 <= group_idx < 2**32:
        raise ValueError(f"group_idx must fit in 4 unsigned bytes, got {group_idx}")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(GROUP_BYTES, "big"))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block hash part of a key."""
    return key[:-GROUP_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV cache group index part of a key."""
    return int.from_bytes(key[-GROUP_BYTES:], "big")


def check_key(key: object) -> None:
    """Raise a clear TypeError for anything that is not a well-formed key."""
    if type(key) is not bytes:
        raise TypeError(f"offload keys are bytes, got {type(key).__name__}: {key!r}")
    if len(key) <= GROUP_BYTES:
        raise ValueError(f"offload key too short ({len(key)} bytes): {key!r}")


def check_keys(keys: Collection[object]) -> None:
    """check_key's clear error for the first malformed key of a batch. Fast
    when all are fine: only C-level passes over the keys."""
    if len(keys) < 8:  # a plain loop beats building sets for a few keys
        for k in keys:
            if type(k) is not bytes or len(k) <= GROUP_BYTES:
                check_key(k)
    elif set(map(type, keys)) != {bytes} or min(map(len, keys)) <= GROUP_BYTES:
        for k in keys:
            check_key(k)
