"""Tiering: a primary CPU tier composed with ordered secondary tiers.

  tier.py       secondary tier types by name; Tier, one tier as driven here
  admission.py  which chunks are worth writing down to a slow tier
  jobs.py       our own jobs (cascades, promotions) and where they complete
  cascade.py    CPU chunks written down, bounded, the rest waiting (back-pressure)
  promotion.py  secondary hits read back into CPU
  state.py      our view of one request
  manager.py    TieringManager
  spec.py       TieredOffloadingSpec (the "tiered" spec)
"""

import importlib

# Names resolved on first use (PEP 562), so importing one module of this
# package (admission.py, from the CPU tier) does not load the whole package.
_WHERE = {
    "TieringManager": "manager", "TieredOffloadingSpec": "spec",
    **dict.fromkeys(("DEFAULT_MAX_QUEUE_DEPTH", "DEFAULT_STORE_THRESHOLD", "TIER_KEYS", "Tier", "TierContext",
                     "get_tier_class", "register_tier_type", "tier_type_names"), "tier"),
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
