"""A registry of OffloadingSpecs by name, so a config can say which to build."""

from __future__ import annotations

import importlib

from kvoffload.abstractions import OffloadingSpec
from kvoffload.config import ConfigError, OffloadingConfig

# name -> "module:Class", imported on first use so optional extras stay optional
_SPECS: dict[str, str] = {
    "cpu": "kvoffload.tiers.cpu.spec:CPUOffloadingSpec",
    "tiered": "kvoffload.tiering:TieredOffloadingSpec",
}


def register_spec(name: str, target: str | type[OffloadingSpec]) -> None:
    """Register a spec class (or its "module:Class" path) under a name."""
    if isinstance(target, type):
        target = f"{target.__module__}:{target.__qualname__}"
    _SPECS[name] = target


def spec_names() -> list[str]:
    return sorted(_SPECS)


def get_spec_class(name: str) -> type[OffloadingSpec]:
    """Resolve a registered name or a "module:Class" / "module.Class" path."""
    target = _SPECS.get(name, name)
    if ":" in target:
        module_name, cls_name = target.split(":", 1)
    elif "." in target:
        module_name, cls_name = target.rsplit(".", 1)
    else:
        raise ConfigError(f"unknown spec {name!r}; known specs: {spec_names()}")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load spec {name!r} ({target}): {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, OffloadingSpec)):
        raise ConfigError(f"spec {name!r} resolves to {cls!r}, which is not an OffloadingSpec")
    return cls


def build_spec(name: str, config: OffloadingConfig) -> OffloadingSpec:
    return get_spec_class(name)(config)
