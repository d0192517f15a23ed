"""Eviction policies by name: the registered ones below, or any "module:Class"
path to an EvictionPolicy subclass. A policy's module is imported on first
use (the registry holds "module:Class" strings)."""

from __future__ import annotations

from kvoffload.policies.base import EvictionPolicy
from kvoffload.registry import Registry

# The policies kvoffload ships. Every place that lists the policies
# (README.md, docs/POLICIES.md, the examples, `kvoffload replay --help`,
# spec docstrings) lists these names: tests/policies/test_policy_lists.py.
BUILT_IN = {
    "hubchain": "kvoffload.policies.hubchain.policy:HubChainPolicy",
    "lru": "kvoffload.policies.lru:LRUPolicy",
    "arc": "kvoffload.policies.arc:ARCPolicy",
    "s3fifo": "kvoffload.policies.s3fifo:S3FIFOPolicy",
    "sieve": "kvoffload.policies.sieve:SIEVEPolicy",
}
POLICIES = Registry(EvictionPolicy, "eviction policy", "policies", BUILT_IN)  # and those register_policy adds

DEFAULT_POLICY = "hubchain"  # the CPU tier's policy when the config names none


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


__all__ = ["BUILT_IN", "POLICIES", "DEFAULT_POLICY", "EvictionPolicy", "register_policy", "get_policy_class", "policy_names"]
