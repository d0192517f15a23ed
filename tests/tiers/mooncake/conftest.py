"""Real Mooncake Stores on loopback (mooncake_master with its HTTP metadata
server, plus a `mooncake_client` store node lending memory), on free ports.

The binaries come with `pip install 'kvoffload[mooncake]'` (scripts/setup.sh
installs it). Without them the tests skip locally, but fail under CI so a
missing install step cannot hide behind skips.
"""

from __future__ import annotations

import os
import uuid

import pytest

from kvoffload.tiers.mooncake.server import LocalMooncake, find_binary


def _need_binary():
    if find_binary("mooncake_master") is None:
        msg = "no mooncake_master binary (pip install 'kvoffload[mooncake]', or run scripts/setup.sh)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def mooncake():
    """One store for the session; tests keep apart by key prefix."""
    _need_binary()
    srv = LocalMooncake(store_bytes=512 << 20).start()
    yield srv
    srv.close()


@pytest.fixture
def fresh_mooncake():
    """A store of the test's own (not started), to kill and restart."""
    _need_binary()
    srv = LocalMooncake(store_bytes=256 << 20)
    yield srv
    srv.close()


@pytest.fixture
def prefix():
    return f"t-{uuid.uuid4().hex[:12]}"
