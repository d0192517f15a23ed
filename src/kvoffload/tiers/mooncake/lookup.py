"""Existence checks against Mooncake: the Redis tier's background checker
(tiers/remote/lookup.py: coalescing, busy_since, results), with one
batch_is_exist call per round instead of an EXISTS pipeline."""

from __future__ import annotations

import time

from kvoffload.tiers.mooncake.client import network_failed
from kvoffload.tiers.remote.lookup import ExistenceChecker


class MooncakeExistenceChecker(ExistenceChecker):
    tier_name = "mooncake"

    def _check(self, keys: list[bytes]) -> None:
        backoff = self._state.backoff
        if not backoff.available():
            self.results.extend((k, None) for k in keys)
            return
        keys, rkeys = self._server_keys(keys)
        if not keys:
            return
        self.busy_since = time.monotonic()
        try:
            answers = self._client.batch_is_exist(rkeys)
        except Exception as e:  # noqa: BLE001 - e.g. a closed client: unknown, not a crash
            self.warn("mooncake lookup error: %s", e)
            answers = [-1] * len(keys)
        if len(answers) != len(keys) or any(network_failed(a) for a in answers):
            backoff.failed()
            self.results.extend((k, None) for k in keys)
            return
        backoff.succeeded()
        # 1 present, 0 absent, other codes: unknown (the manager's short-lived miss)
        self.results.extend((k, None if a < 0 else a == 1) for k, a in zip(keys, answers))
