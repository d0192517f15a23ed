"""Fixtures for storage-tier tests: real slab files under pytest's tmp_path."""

import pytest

from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.storage.tier import StorageTier
from storage_helpers import CHUNK, NS, close


@pytest.fixture
def pool():
    p = HostPool(16, CHUNK)
    yield p
    p.close()


@pytest.fixture
def make_tier(tmp_path):
    made = []

    def make(capacity_slots: int = 32, namespace: Namespace = NS, path=None, **kw) -> StorageTier:
        t = StorageTier(str(path or tmp_path / "store"), capacity_slots * CHUNK, CHUNK, namespace, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        try:
            close(t)
        except OSError:
            pass
