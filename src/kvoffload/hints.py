"""Per-request hints from kv_transfer_params, parsed once per request.

Hints come from clients (any caller of an OpenAI-compatible server can set
kv_transfer_params), and they are read inside the engine's scheduler, where
an exception kills the engine for every request. So reading them never
raises: a value we do not understand is ignored for that request alone,
logged once as a warning naming the request, the key and the value, and
counted (the `bad_request_hints` counter of the manager that read it first).
The result is cached on the ReqContext, which every manager of the request
shares, so a request is parsed, warned about and counted once.

Our keys (others belong to vLLM or other connectors and are left alone):
  kv_retention   "low" or "normal" (any case, surrounding spaces ignored; at most
                 MAX_RETENTION_CHARS characters in all)
  kv_load_tiers  a list of at most MAX_LOAD_TIERS {"medium": ..., "locality": ...}
                 dicts; invalid: ignored, the request loads from every tier
A null value is the same as a missing key.
"""

from __future__ import annotations

import logging
import reprlib
from collections.abc import Callable
from typing import Any

from kvoffload.abstractions import Locality, Medium, ReqContext, TierFilter, TierMatcher

log = logging.getLogger(__name__)

RETENTION = "kv_retention"
LOAD_TIERS = "kv_load_tiers"
COUNTER = "bad_request_hints"

_short = reprlib.Repr()  # a client's value may be huge: log its head only
_short.maxstring = _short.maxother = 80
_short.maxlist = _short.maxtuple = _short.maxdict = 4
_short.maxlevel = 3

# Distinct matchers are few (media x localities); a longer list is a bad
# client, and every secondary-tier lookup scans the whole filter.
MAX_LOAD_TIERS = 64
MAX_RETENTION_CHARS = 64


def _show(v: Any) -> str:
    """reprlib's head of v; Python 3.11's reprlib repr()s an int whole, which
    raises past 4300 digits."""
    try:
        return _short.repr(v)
    except Exception:  # noqa: BLE001 - request data: never raise
        return f"<{type(v).__name__}>"


class RequestHints:
    """A request's parsed hints. load_tiers: None when not given (the
    context's filter stays), TierFilter.ALL when given but invalid.
    bad: the keys ignored as invalid."""

    __slots__ = ("low_retention", "load_tiers", "bad")

    def __init__(self, low_retention: bool = False, load_tiers: TierFilter | None = None,
                 bad: tuple[str, ...] = ()):
        self.low_retention = low_retention
        self.load_tiers = load_tiers
        self.bad = bad

    def __repr__(self) -> str:
        return f"RequestHints(low_retention={self.low_retention}, load_tiers={self.load_tiers}, bad={self.bad})"


NO_HINTS = RequestHints()


def _retention(v: Any) -> tuple[bool, str | None]:
    """(low, why invalid)."""
    norm = v.strip().lower() if isinstance(v, str) and len(v) <= MAX_RETENTION_CHARS else None
    if norm in ("low", "normal"):
        return norm == "low", None
    return False, "must be 'low' or 'normal'"


def _enum(cls: type, v: Any) -> Any:
    if v is None:
        return None
    if not isinstance(v, str):
        raise ValueError(f"{cls.__name__.lower()} must be a string")
    try:
        return cls(v.strip().upper())
    except ValueError:
        raise ValueError(f"unknown {cls.__name__.lower()} {_show(v)} "
                         f"(one of {', '.join(m.value.lower() for m in cls)})") from None


def _load_tiers(v: Any) -> TierFilter:
    """The filter, or ValueError saying why the value is invalid."""
    if not isinstance(v, (list, tuple)):
        raise ValueError("must be a list of {medium, locality} dicts")
    if len(v) > MAX_LOAD_TIERS:
        raise ValueError(f"has {len(v)} entries; at most {MAX_LOAD_TIERS}")
    matchers = []
    for i, t in enumerate(v):
        if not isinstance(t, dict):
            raise ValueError(f"entry {i} must be a dict")
        unknown = [k for k in t if k not in ("medium", "locality")]
        if unknown:
            raise ValueError(f"entry {i}: unknown key {_show(unknown[0])}")
        try:
            matchers.append(TierMatcher(_enum(Medium, t.get("medium")), _enum(Locality, t.get("locality"))))
        except ValueError as e:
            raise ValueError(f"entry {i}: {e}") from None
    return TierFilter(tuple(dict.fromkeys(matchers)))  # each matcher once: lookups scan them all


def parse_hints(params: Any, req_id: Any = None) -> RequestHints:
    """The hints in one request's kv_transfer_params. Never raises: each
    invalid hint is logged (once, here) and ignored."""
    if params is None:
        return NO_HINTS
    bad: list[tuple[str, Any, str]] = []
    low, tiers = False, None
    try:
        if not isinstance(params, dict):
            bad.append(("kv_transfer_params", params, "must be a dict"))
        else:
            v = params.get(RETENTION)
            if v is not None:
                low, why = _retention(v)
                if why:
                    bad.append((RETENTION, v, why))
            v = params.get(LOAD_TIERS)
            if v is not None:
                try:
                    tiers = _load_tiers(v)
                except ValueError as e:
                    tiers = TierFilter.ALL
                    bad.append((LOAD_TIERS, v, str(e)))
    except Exception as e:  # noqa: BLE001 - last line of defence: request data must never raise
        low, tiers = False, None
        bad.append(("kv_transfer_params", params, f"unreadable ({type(e).__name__})"))
    if not bad:
        return RequestHints(low, tiers) if (low or tiers is not None) else NO_HINTS
    for key, value, why in bad:
        # a long value's head only; an object whose repr raises is shown by its type
        log.warning("request %s: ignoring %s=%s: %s", _show(req_id), key, _show(value), why)
    return RequestHints(low, tiers, tuple(k for k, _, _ in bad))


def request_hints(ctx: ReqContext, count: Callable[[int], None] | None = None) -> RequestHints:
    """ctx's hints, parsed on first use and cached on ctx. count(n) is
    called with the number of invalid hints by the call that parses them,
    so a request is counted once however many managers read it."""
    h = ctx.get_state(RequestHints)
    if h is None:
        h = parse_hints(ctx.kv_transfer_params, ctx.req_id)
        ctx.set_state(h)
        if h.bad and count is not None:
            count(len(h.bad))
    return h
