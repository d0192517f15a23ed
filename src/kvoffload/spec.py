"""A registry of OffloadingSpecs by name, so a config can say which to build."""

from __future__ import annotations

from kvoffload.abstractions import OffloadingSpec
from kvoffload.config import OffloadingConfig
from kvoffload.registry import load_class

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
    return load_class(name, _SPECS, OffloadingSpec, "spec", "specs")


def build_spec(name: str, config: OffloadingConfig) -> OffloadingSpec:
    return get_spec_class(name)(config)
