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

from kvoffload.tiering.manager import TieringManager
from kvoffload.tiering.spec import TieredOffloadingSpec
from kvoffload.tiering.tier import (
    DEFAULT_MAX_QUEUE_DEPTH,
    DEFAULT_STORE_THRESHOLD,
    TIER_KEYS,
    Tier,
    TierContext,
    get_tier_class,
    register_tier_type,
    tier_type_names,
)

__all__ = [
    "DEFAULT_MAX_QUEUE_DEPTH", "DEFAULT_STORE_THRESHOLD", "TIER_KEYS", "Tier", "TierContext",
    "TieredOffloadingSpec", "TieringManager", "get_tier_class", "register_tier_type", "tier_type_names",
]
