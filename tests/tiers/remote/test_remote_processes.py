"""Two independent processes ('engines'): one stores, the other hits and
reads the exact bytes back. Nothing is shared but the server."""

from __future__ import annotations

import pytest

import subprocess
import sys
from pathlib import Path

from kvoffload.abstractions import LookupResult
from remote_helpers import keys_for, lookup, make_tier

pytestmark = [pytest.mark.redis, pytest.mark.slow]

PROC = Path(__file__).with_name("remote_engine_proc.py")


def _start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PROC), *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_one_process_stores_another_hits(redis_server, prefix):
    # start both at once (torch imports dominate); the loader waits for "go"
    loader = _start("load", redis_server.url, prefix, 77, 12)
    writer = _start("store", redis_server.url, prefix, 77, 12)
    try:
        assert writer.wait(timeout=60) == 0, writer.stderr.read()
        assert loader.stdout.readline().strip() == "ready", loader.stderr.read()
        out, err = loader.communicate("go\n", timeout=60)
        assert loader.returncode == 0, err
        assert out.strip() == "hits=12 exact=12"
    finally:
        for p in (loader, writer):
            if p.poll() is None:
                p.kill()
    # an engine with another prefix sees none of it
    tier, m, _w, _pool = make_tier(redis_server.url, prefix + "-other")
    try:
        assert all(lookup(m, k) is LookupResult.MISS for k in keys_for(12, seed=77))
    finally:
        tier.shutdown()
