"""The tiering manager's view of one request."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.abstractions import OffloadKey, ReqContext


@dataclass
class RequestState:
    request_level: list[bool]  # per tier: wants already-resident chunks too
    failed: set[OffloadKey] = field(default_factory=set)  # promotions that failed: MISS
    # keys it found readable in CPU: its promotions must not evict them, or a
    # prefix longer than what CPU can spare would never be resident at once
    cpu_hits: dict[OffloadKey, None] = field(default_factory=dict)
    # chunks promoted for it, pinned in CPU until it loads them (or stores,
    # i.e. computes: then it never will, vLLM loads before computing) or
    # finishes: else another request's promotion may evict them first, and
    # two requests whose prefixes do not fit in CPU together take turns
    # evicting each other's promotions, neither ever getting its prefix
    held: dict[OffloadKey, None] = field(default_factory=dict)
    promoting: int = 0  # chunks of its promotions in flight
    promote_since: float = 0.0  # monotonic time its oldest promotion in flight was submitted
    room_waits: int = 0  # flushes its promotion waited for room, holding nothing (promotion.py)
    jobs: int = 0  # secondary jobs in flight for this request
    # primary (GPU -> CPU) store jobs in flight: each may cascade when it
    # completes, so the children hear on_request_finished only after the last
    stores: int = 0
    ctx: ReqContext | None = None  # set with the first store (a reset may finish it)
    finished: bool = False
