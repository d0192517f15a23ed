"""Mooncake object keys: <prefix>:<namespace digest>:<offload key in hex>,
as the Redis tier names them, but str (the client's key type)."""

from __future__ import annotations

from kvoffload.tiers.remote.value import KeySpace


class MooncakeKeySpace(KeySpace):
    def __init__(self, prefix, namespace):
        super().__init__(prefix, namespace)
        self.head_str = self.head.decode()

    def redis_key(self, key: bytes) -> str:
        return self.head_str + key.hex()

    def redis_keys(self, keys) -> list[str]:
        head = self.head_str
        return [head + k.hex() for k in keys]
