"""Helpers for "a manager call that raises changes nothing" tests: a deep,
comparable copy of a manager's state, and the malformed keys to send."""

from __future__ import annotations

from collections import OrderedDict, deque
from enum import Enum

# Malformed keys: each raises wherever a key is checked (not bytes, unhashable, too short).
BAD_KEYS = [5, "k" * 20, None, [b"x" * 20], b"", b"abc"]  # keys end in 4 group bytes


def deep_state(obj, skip: frozenset[str] = frozenset(), _seen: dict | None = None):
    """obj's state as plain, comparable values: containers copied in order,
    kvoffload objects as their attributes (named in skip: left out), other
    objects (threads, files, arrays, clients, functions) by type only."""
    seen = {} if _seen is None else _seen
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, Enum)):
        return obj
    if id(obj) in seen:  # shared or cyclic: where we first met it
        return ("<seen>", seen[id(obj)])
    seen[id(obj)] = len(seen)

    def rec(x):
        return deep_state(x, skip, seen)

    if isinstance(obj, bytearray):  # (the CPU tier's slot states)
        return ("bytearray", bytes(obj))
    if isinstance(obj, (list, tuple, deque)):
        return (type(obj).__name__, [rec(x) for x in obj])
    if isinstance(obj, OrderedDict):
        return ("OrderedDict", [(rec(k), rec(v)) for k, v in obj.items()])
    if isinstance(obj, dict):  # insertion order is state too (policies, recency)
        return ("dict", [(k if isinstance(k, (bytes, str, int, tuple)) else rec(k), rec(v)) for k, v in obj.items()])
    if isinstance(obj, (set, frozenset)):
        return ("set", sorted(map(repr, obj)))
    mod = type(obj).__module__ or ""
    if not mod.startswith("kvoffload"):
        return f"<{type(obj).__name__}>"
    attrs = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                attrs[name] = getattr(obj, name)
    return (type(obj).__name__, [(k, rec(v)) for k, v in sorted(attrs.items()) if k not in skip])
