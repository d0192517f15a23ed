"""Eviction policies by name: "lru", "arc", or any "module:Class" path to an
EvictionPolicy subclass."""

from __future__ import annotations

import importlib

from kvoffload.config import ConfigError
from kvoffload.policies.base import EvictionPolicy

_POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_policy(name: str, cls: type[EvictionPolicy]) -> None:
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise TypeError(f"policy {name!r}: {cls!r} is not an EvictionPolicy subclass")
    _POLICIES[name] = cls


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def get_policy_class(name: str) -> type[EvictionPolicy]:
    """A registered name, or "module:Class" (also "module.Class")."""
    if not isinstance(name, str):
        raise ConfigError(f"eviction policy must be a name or 'module:Class', got {name!r}")
    cls = _POLICIES.get(name.lower())
    if cls is not None:
        return cls
    if ":" in name:
        module_name, cls_name = name.split(":", 1)
    elif "." in name:
        module_name, cls_name = name.rsplit(".", 1)
    else:
        raise ConfigError(
            f"unknown eviction policy {name!r}; known policies: {policy_names()} "
            f"(or 'module:Class' of an EvictionPolicy subclass)"
        )
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load eviction policy {name!r}: {e}; known policies: {policy_names()}") from None
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise ConfigError(f"eviction policy {name!r} is {cls!r}, not an EvictionPolicy subclass")
    return cls


from kvoffload.policies.arc import ARCPolicy  # noqa: E402
from kvoffload.policies.lru import LRUPolicy  # noqa: E402

register_policy("lru", LRUPolicy)
register_policy("arc", ARCPolicy)

from kvoffload.policies.prefix import PrefixAwarePolicy  # noqa: E402
from kvoffload.policies.s3fifo import S3FIFOPolicy  # noqa: E402
from kvoffload.policies.sieve import SIEVEPolicy  # noqa: E402

register_policy("s3fifo", S3FIFOPolicy)
register_policy("sieve", SIEVEPolicy)
register_policy("prefix", PrefixAwarePolicy)

__all__ = ["EvictionPolicy", "LRUPolicy", "ARCPolicy", "S3FIFOPolicy", "SIEVEPolicy", "PrefixAwarePolicy",
           "register_policy", "get_policy_class", "policy_names"]
