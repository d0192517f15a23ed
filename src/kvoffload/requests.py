"""Per-request helpers every manager uses: the order of a request's keys
(its prefix), its retention hint, and the rest of its prefix after a key.

Keys are ordered by their end-token positions, which the scheduler records
on the ReqContext (stores may complete out of order; vLLM passes sets).
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.abstractions import OffloadKey, ReqContext
from kvoffload.hints import request_hints

_NO_POSITION = float("inf")


def prefix_order(keys: list[OffloadKey], ctx: ReqContext | None) -> list[OffloadKey]:
    """Keys head first: by the request's end-token positions when it has them,
    else as given. Keys without a position go last, in given order."""
    if ctx is None or len(keys) < 2:
        return keys
    positions = ctx.offload_key_positions()
    if not positions:
        return keys
    try:
        return sorted(keys, key=positions.__getitem__)  # the common case: every key has one
    except KeyError:
        get = positions.get
        return sorted(keys, key=lambda k: get(k, _NO_POSITION))


def low_retention(ctx: ReqContext | None, count: Callable[[int], None] | None = None) -> bool:
    """True if the request says its blocks will not be reused
    (kv_transfer_params {"kv_retention": "low"}: a session's last turn, a
    one-shot prompt). Such a request stores its new blocks where they are
    evicted first and refreshes nothing it reads, so shared heads keep the
    recency other requests gave them. Never raises: an invalid hint is
    ignored (kvoffload.hints); count(n) counts it if this call parses it."""
    if ctx is None or ctx.kv_transfer_params is None:  # most requests: no parse, no state
        return False
    return request_hints(ctx, count).low_retention


class _PrefixIndex:
    """A request's keys in prefix order and each key's index in it; kept on
    the ReqContext (one per request, shared by its managers) and rebuilt
    when the scheduler has added keys since."""

    __slots__ = ("order", "index")

    def __init__(self, positions) -> None:
        self.order: list[OffloadKey] = sorted(positions, key=positions.__getitem__)
        self.index: dict[OffloadKey, int] = {k: i for i, k in enumerate(self.order)}


def rest_of_prefix(key: OffloadKey, ctx: ReqContext) -> list[OffloadKey]:
    """The request's keys after `key`, head first ([] if `key` has no
    position). Schedulers look a prefix up key by key and stop at the first
    non-HIT; a tier that answers "later" for one key uses this to start on
    the rest of the prefix at once instead of one step (or round trip) per key."""
    positions = ctx.offload_key_positions()
    if key not in positions:
        return []
    prefix = ctx.get_state(_PrefixIndex)
    if prefix is None or len(prefix.order) != len(positions):  # keys added since (never removed)
        prefix = _PrefixIndex(positions)
        ctx.set_state(prefix)
    return prefix.order[prefix.index[key] + 1:]
