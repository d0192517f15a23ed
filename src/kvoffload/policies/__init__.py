"""Eviction policies by name: "lru", "arc", or any "module:Class" path to an
EvictionPolicy subclass."""

from __future__ import annotations

from kvoffload.policies.base import EvictionPolicy
from kvoffload.registry import Registry

POLICIES = Registry(EvictionPolicy, "eviction policy", "policies")

# The CPU tier's policy when the config names none (issue 17, version 16 of
# hubchain: docs/BENCHMARKS.md, "hubchain made the default"). LRU until then.
DEFAULT_POLICY = "hubchain"


def register_policy(name: str, cls: type[EvictionPolicy]) -> None:
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise TypeError(f"policy {name!r}: {cls!r} is not an EvictionPolicy subclass")
    POLICIES.register(name, cls)


def policy_names() -> list[str]:
    return POLICIES.names()


def get_policy_class(name: str) -> type[EvictionPolicy]:
    """A registered name (any case), or "module:Class" (also "module.Class")."""
    if isinstance(name, str) and name.lower() in POLICIES:
        name = name.lower()
    return POLICIES.get(name)


from kvoffload.policies.arc import ARCPolicy  # noqa: E402
from kvoffload.policies.lru import LRUPolicy  # noqa: E402

register_policy("lru", LRUPolicy)
register_policy("arc", ARCPolicy)

from kvoffload.policies.chain import ChainPolicy  # noqa: E402
from kvoffload.policies.prefix import PrefixAwarePolicy  # noqa: E402
from kvoffload.policies.s3fifo import S3FIFOPolicy  # noqa: E402
from kvoffload.policies.sieve import SIEVEPolicy  # noqa: E402

register_policy("s3fifo", S3FIFOPolicy)
register_policy("sieve", SIEVEPolicy)
register_policy("prefix", PrefixAwarePolicy)
register_policy("chain", ChainPolicy)

from kvoffload.policies.segchain import SegChainPolicy  # noqa: E402

register_policy("segchain", SegChainPolicy)

from kvoffload.policies.duel import DuelPolicy  # noqa: E402

register_policy("duel", DuelPolicy)

from kvoffload.policies.hubchain import HubChainPolicy  # noqa: E402

register_policy("hubchain", HubChainPolicy)

__all__ = ["EvictionPolicy", "LRUPolicy", "ARCPolicy", "S3FIFOPolicy", "SIEVEPolicy", "PrefixAwarePolicy", "ChainPolicy", "SegChainPolicy", "DuelPolicy", "HubChainPolicy",
           "register_policy", "get_policy_class", "policy_names", "DEFAULT_POLICY"]
