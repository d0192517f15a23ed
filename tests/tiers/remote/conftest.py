"""A real redis-server on loopback for the whole session (never a fake).

The binary comes from Debian's redis-server (scripts/setup.sh installs it)
or $KVOFFLOAD_REDIS_SERVER. Without one the tests skip locally, but fail
under CI so a missing install step cannot hide behind skips.
"""

from __future__ import annotations

import os
import uuid

import pytest

from kvoffload.tiers.remote.server import LocalServer, find_server_binary


def _need_binary():
    if find_server_binary() is None:
        msg = "no redis-server binary (apt-get install redis-server, or run scripts/setup.sh)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def redis_server():
    _need_binary()
    srv = LocalServer(maxmemory="256mb", unix_socket=True).start()
    yield srv
    srv.close()


@pytest.fixture
def fresh_server():
    """A server of the test's own, to kill and restart."""
    _need_binary()
    srv = LocalServer(maxmemory="64mb")
    yield srv
    srv.close()


@pytest.fixture
def prefix():
    """A key prefix unique to the test, so tests sharing the server never see each other's keys."""
    return f"t-{uuid.uuid4().hex[:12]}"
