"""A real redis-server on loopback for the whole session (never a fake).

The binary comes from Debian's redis-server (scripts/setup.sh installs it)
or $KVOFFLOAD_REDIS_SERVER. Without one the tests skip locally, but fail
under CI so a missing install step cannot hide behind skips.
"""

from __future__ import annotations

import os
import uuid

import pytest

from kvoffload.tiers.redis.server import LocalServer, find_server_binary


def _unavailable(msg: str):
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def _need_binary():
    if find_server_binary() is None:
        _unavailable("no redis-server binary (apt-get install redis-server, or run scripts/setup.sh)")


@pytest.fixture
def redis_binary():
    """For tests that start servers of their own (LocalServer)."""
    _need_binary()


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


@pytest.fixture(scope="module")
def redis_cluster():
    """A real 3-master Redis Cluster on loopback (redis-cli --cluster create)."""
    import shutil
    import subprocess
    import time

    import redis

    _need_binary()
    cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
    if cli is None:
        _unavailable("redis-cli missing (it comes with Debian's redis-server)")
    nodes = [LocalServer(maxmemory="64mb", extra_args=("--cluster-enabled", "yes", "--cluster-node-timeout", "2000"))
             for _ in range(3)]
    try:
        for n in nodes:
            n.start()
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while not all(redis.Redis(port=n.port).cluster("info").get("cluster_state") == "ok" for n in nodes):
            assert time.monotonic() < deadline, "cluster did not become ok"
            time.sleep(0.1)
        yield nodes
    finally:
        for n in nodes:
            n.close()
