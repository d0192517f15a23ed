"""The real `sglang` package (installed without its GPU dependencies by
scripts/setup.sh), a real redis-server and a real Mooncake Store on loopback.
Without them the tests skip locally, but fail under CI so a missing install
step cannot hide behind skips."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def _unavailable(msg: str):
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def redis_server():
    from kvoffload.tiers.redis.server import LocalServer, find_server_binary

    if find_server_binary() is None:
        _unavailable("no redis-server binary (run scripts/setup.sh)")
    srv = LocalServer(maxmemory="128mb").start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def mooncake():
    from kvoffload.tiers.mooncake.server import LocalMooncake, find_binary

    if find_binary("mooncake_master") is None:
        _unavailable("no mooncake_master binary (run scripts/setup.sh)")
    srv = LocalMooncake(store_bytes=128 << 20).start()
    yield srv
    srv.close()


@pytest.fixture
def prefix():
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["storage", "redis", "mooncake"])
def section(request, tmp_path, prefix):
    """One backend section per tier kind: the storage tier, Redis, Mooncake."""
    from sglang_backend_rig import tier_section

    return tier_section(request.param, request, tmp_path, prefix)
