"""Resolving a plugin by registered name or by "module:Class" path, shared by
the spec, eviction-policy and tier-type registries."""

from __future__ import annotations

import importlib

from kvoffload.config import ConfigError


def load_class(name: str, table: dict[str, str | type], base: type, what: str, plural: str) -> type:
    """The class registered as `name` in `table` (a class or a "module:Class"
    string), or `name` itself read as "module:Class" / "module.Class". Any
    failure is a ConfigError that says what was asked for and what exists."""
    if not isinstance(name, str):
        raise ConfigError(f"{what} must be a name or 'module:Class', got {name!r}")
    target = table.get(name, name)
    if isinstance(target, str):
        if ":" in target:
            module_name, cls_name = target.split(":", 1)
        elif "." in target:
            module_name, cls_name = target.rsplit(".", 1)
        else:
            raise ConfigError(f"unknown {what} {name!r}; known {plural}: {sorted(table)} (or 'module:Class')")
        try:
            target = getattr(importlib.import_module(module_name), cls_name)
        # ValueError: ":" (Empty module name); TypeError: ".m:C" (a relative import)
        except (ImportError, AttributeError, ValueError, TypeError) as e:
            raise ConfigError(f"cannot load {what} {name!r}: {e}; known {plural}: {sorted(table)}") from None
    if not (isinstance(target, type) and issubclass(target, base)):
        article = "an" if base.__name__[0] in "AEIOU" else "a"
        raise ConfigError(f"{what} {name!r} is {target!r}, not {article} {base.__name__} subclass")
    return target


class Registry:
    """Classes of one kind by name (a class or its "module:Class" path,
    imported on first use so optional extras stay optional)."""

    def __init__(self, base: type, what: str, plural: str, entries: dict[str, str | type] | None = None):
        self.base, self.what, self.plural = base, what, plural
        self._table: dict[str, str | type] = dict(entries or {})

    def register(self, name: str, target: str | type) -> None:
        # A class is kept as is: it is imported already, and one defined in a
        # function or in __main__ has no "module:Class" path to import back.
        self._table[name] = target

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def get(self, name: object) -> type:
        """A registered name or a "module:Class" / "module.Class" path;
        ConfigError otherwise, saying what exists."""
        return load_class(name, self._table, self.base, self.what, self.plural)
