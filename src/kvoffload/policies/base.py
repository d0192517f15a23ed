"""The eviction policy contract: which held, evictable key goes first.

A policy only orders keys; the manager owns slots, pins and pending writes
and tells the policy, through `can_evict`, which keys it may pick.
Keys arrive in prefix order (head first). All else equal a policy evicts a
prefix's tail before its head: every later request sharing the prefix needs
the head, while the tail is only useful after the head.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from kvoffload.abstractions import ReqContext
from kvoffload.config import ConfigError


class EvictionPolicy(ABC):
    name: ClassVar[str]

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ConfigError(f"{type(self).__name__}: capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        """Track newly stored keys (prefix order, head first). The manager
        never inserts a key the policy already tracks."""

    @abstractmethod
    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        """Mark keys recently used (prefix order); unknown keys are ignored."""

    def insert_cold(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        """Track newly stored keys that their request says will not be
        reused (kv_retention "low"): they should go before every other
        key, tail first. Default: an ordinary insert (the hint is ignored)."""
        self.insert(keys, ctx)

    def refresh(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        """Re-rank keys (prefix order) as most recent without counting a use:
        the manager calls it when a request that stored them finishes, so a
        request's batches end up tail-oldest. Default: nothing (a policy
        that counts uses must not see this as one)."""

    def finished(self, ctx: ReqContext) -> None:
        """The request finished (the manager calls it first, then refresh
        and touch). Its stores may still land after this, in vLLM's order:
        a policy keeping per-request state lets it go here. Default: nothing."""

    def access(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        """Optional: a running request loaded these keys (prefix order). A
        policy may rank them with the request's own keys until it finishes
        (on_request_finished then touches them: the committed use). Not
        overriding it (the default) means no call at all."""

    def admit(self, keys: list[bytes], free: int, ctx: ReqContext | None,
              can_evict: Callable[[bytes], bool]) -> int:
        """Optional admission: how many of a store's new keys (prefix order,
        head first; `free` slots are free) to store, a head of them; the
        manager then evicts for those alone and leaves the rest unstored.
        Called before evict() of the same store; may prepare that evict.
        Not overriding it (the default) means: all, and no call at all."""
        return len(keys)

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Stop tracking a key (no-op if unknown)."""

    @abstractmethod
    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        """Pick n victims with can_evict(key) True and stop tracking them.
        If fewer than n are evictable return None and change nothing."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...


def access_of(policy: EvictionPolicy):
    """The policy's bound access method, or None when it keeps the default."""
    return None if type(policy).access is EvictionPolicy.access else policy.access


def admission_of(policy: EvictionPolicy):
    """The policy's bound admit method, or None when it keeps the default
    (the manager then skips the call: no cost for policies without one)."""
    return None if type(policy).admit is EvictionPolicy.admit else policy.admit
