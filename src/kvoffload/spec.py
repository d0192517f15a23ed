"""A registry of OffloadingSpecs by name, so a config can say which to build."""

from __future__ import annotations

from kvoffload.abstractions import OffloadingSpec
from kvoffload.config import OffloadingConfig
from kvoffload.registry import Registry

SPECS = Registry(OffloadingSpec, "spec", "specs", {
    "cpu": "kvoffload.tiers.cpu.spec:CPUOffloadingSpec",
    "tiered": "kvoffload.tiering:TieredOffloadingSpec",
})
register_spec = SPECS.register  # a spec class (or its "module:Class" path) under a name
spec_names = SPECS.names
get_spec_class = SPECS.get  # a registered name or a "module:Class" / "module.Class" path


def build_spec(name: str, config: OffloadingConfig) -> OffloadingSpec:
    return get_spec_class(name)(config)
