"""What the CPU manager remembers of each running request, and how that
becomes recency when the request finishes.

Recency is per request, as in vLLM 0.33 (whose scheduler never calls
touch): the keys a request loaded (reused) and stored are recorded on its
ReqContext and re-ranked once in on_request_finished, head most recent, so a
request's tail is evicted before its head even when its stores arrived in
several batches. "Head first" is by the keys' end-token positions on the
context; a request without positions is ranked in its prepare_store order
(recorded then: complete_store gets a set), as vLLM 0.33 does.

One record per request and manager (several managers may share a context),
one call per batch of keys: nothing here runs per block.
"""

from __future__ import annotations

from kvoffload.abstractions import ReqContext
from kvoffload.requests import low_retention

_NO_POSITION = float("inf")


class RequestRecord:
    """What the manager remembers of one running request, on its context."""

    __slots__ = ("reused", "stored", "read_back", "prepare_order", "unsorted", "finished")

    def __init__(self) -> None:
        self.reused: list[bytes] = []  # keys it loaded, in load order
        self.stored: list[bytes] = []  # keys it stored, each batch head first
        self.read_back = False  # loaded after storing: may read back its own stores
        self.prepare_order: dict | None = None  # key -> prepare_store index (no key positions)
        self.unsorted = False  # a batch landed ranked before the previous one
        self.finished = False  # after on_request_finished: record nothing more

    def note_loaded(self, keys) -> None:
        self.reused.extend(keys)
        if self.stored:
            self.read_back = True

    def note_prepared(self, new: list[bytes]) -> None:
        """The prepare_store order of a request without key positions."""
        order = self.prepare_order
        if order is None:
            order = self.prepare_order = {}
        n = len(order)
        order.update(zip(new, range(n, n + len(new))))

    def note_stored(self, ordered: list[bytes], rank: dict | None) -> None:
        """A batch of completed stores, head first."""
        stored = self.stored
        if stored and rank is not None and not self.unsorted:
            # a batch ranked before the last one: finish_request must sort
            get = rank.get
            self.unsorted = get(ordered[0], _NO_POSITION) < get(stored[-1], _NO_POSITION)
        stored.extend(ordered)


def record_of(ctx: ReqContext | None, owner: object) -> RequestRecord | None:
    """This request's record, kept on its context under `owner` (created on
    first use); None once finished (a late complete_store then still finds
    the prepare order through rank_of)."""
    if ctx is None:
        return None
    rec = ctx.get_owned(owner)
    if rec is None:
        rec = RequestRecord()
        ctx.set_owned(owner, rec)
    return None if rec.finished else rec


def rank_of(ctx: ReqContext | None, owner: object) -> dict | None:
    """What orders this request's keys head first: its end-token
    positions, else its recorded prepare_store order, else nothing."""
    if ctx is None:
        return None
    positions = ctx.offload_key_positions()
    if positions:
        return positions
    rec = ctx.get_owned(owner)
    return None if rec is None else rec.prepare_order


def sort_by(keys: list[bytes], rank: dict[bytes, int]) -> list[bytes]:
    """keys by rank (positions or prepare order); unranked keys last, in given order."""
    try:
        if len(keys) >= 64:  # a long batch is usually in order already: two C passes, no keyed sort
            ranks = list(map(rank.__getitem__, keys))
            if ranks == sorted(ranks):
                return list(keys)
        return sorted(keys, key=rank.__getitem__)
    except KeyError:
        get = rank.get
        return sorted(keys, key=lambda k: get(k, _NO_POSITION))


def finish_request(ctx: ReqContext, owner: object, policy) -> None:
    """Commit the request's recency to `policy`: stored keys re-ranked (no
    use counted), then reused keys touched, each head most recent, so the
    request ends newest-first from its head. Keys gone since are skipped."""
    rec = record_of(ctx, owner)
    if rec is None:  # finished already
        return
    rec.finished = True  # kept for its prepare order: a late complete_store ranks by it
    policy.finished(ctx)
    reused, stored, read_back, unsorted = rec.reused, rec.stored, rec.read_back, rec.unsorted
    rec.reused = rec.stored = []
    if low_retention(ctx):
        return
    if read_back:
        # Reading back what this request stored (a promotion from a lower
        # tier) is an internal transfer, not a reuse. (Copies down to a
        # lower tier pin without a context: they are not recorded.)
        own = set(stored)
        reused = [k for k in reused if k not in own]
    if stored:  # sorted per batch already; batches may have landed out of order
        if unsorted:
            stored = sort_by(stored, rank_of(ctx, owner))
        policy.refresh(stored, ctx)
    if reused:  # loads come in prefix order (the scheduler's lookup order)
        policy.touch(reused, ctx)
