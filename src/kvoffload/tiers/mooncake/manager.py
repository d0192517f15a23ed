"""Scheduler side of the Mooncake tier: the Redis tier's manager
(tiers/remote/manager.py: short-lived present/absent answers, RETRY while
a background batch check runs, lookup_deadline_s, HIT_PENDING while
storing), with existence asked by batch_is_exist."""

from __future__ import annotations

from kvoffload.tiers.mooncake.lookup import MooncakeExistenceChecker
from kvoffload.tiers.remote.manager import RemoteOffloadingManager


class MooncakeOffloadingManager(RemoteOffloadingManager):
    checker_class = MooncakeExistenceChecker
