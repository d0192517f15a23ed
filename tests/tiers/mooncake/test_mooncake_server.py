"""LocalMooncake, the throwaway store the tests and benchmarks start."""

from __future__ import annotations

import logging

import pytest

from kvoffload.tiers.mooncake import server
from kvoffload.tiers.mooncake.server import _accepts


def test_a_store_node_that_fails_to_start_is_started_again(fresh_mooncake, monkeypatch, caplog):
    """The first node exits at once (a real process, /bin/false): start()
    closes both and starts them again, and the store then serves."""
    real = server.find_binary
    calls = []

    def node_fails_once(name="mooncake_master"):
        if name == "mooncake_client":
            calls.append(name)
            if len(calls) == 1:
                return "/bin/false"
        return real(name)

    monkeypatch.setattr(server, "find_binary", node_fails_once)
    with caplog.at_level(logging.WARNING, logger=server.__name__):
        srv = fresh_mooncake.start()
    assert len(calls) == 2
    assert "attempt 1 of 3" in caplog.text and "node did not start" in caplog.text
    assert srv.node.poll() is None and _accepts(srv.node_port) and _accepts(srv.rpc_port)


def test_a_node_that_never_starts_fails_after_the_last_attempt(fresh_mooncake, monkeypatch):
    real = server.find_binary
    monkeypatch.setattr(server, "find_binary", lambda name="mooncake_master": "/bin/false"
                        if name == "mooncake_client" else real(name))
    with pytest.raises(RuntimeError, match="node did not start"):
        fresh_mooncake.start(attempts=2)
    assert fresh_mooncake.master is None and fresh_mooncake.node is None  # nothing left running
