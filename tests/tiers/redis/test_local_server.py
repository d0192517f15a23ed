"""The test servers' port choice: a port taken between the check and the
server's bind is picked again; a restart keeps its port. pause() returns
only once every thread of the server has stopped."""

import socket
from pathlib import Path

import redis

import pytest

from kvoffload.tiers.redis import server as server_mod
from kvoffload.tiers.redis.server import LocalServer, find_server_binary, free_port

pytestmark = pytest.mark.skipif(find_server_binary() is None, reason="no redis-server")


def test_a_port_taken_before_the_bind_is_picked_again(monkeypatch):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    picks = iter([taken])
    monkeypatch.setattr(server_mod, "free_port", lambda highest=65535: next(picks, None) or free_port(highest))
    srv = LocalServer()
    assert srv.port == taken
    try:
        srv.start()
        assert srv.port != taken
        port = srv.port
        srv.kill()
        srv.start()  # a restart keeps its port (the outage tests rely on it)
        assert srv.port == port
    finally:
        srv.kill()
        squatter.close()


def test_an_explicit_port_that_is_taken_fails_in_one_error():
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    srv = LocalServer(port=squatter.getsockname()[1])
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            srv.start(timeout_s=5)
    finally:
        squatter.close()


def test_cluster_ports_leave_room_for_the_bus_port_below_the_ephemeral_range():
    for _ in range(20):
        port = free_port(55535)
        assert port + 10000 < 32768


def _states(pid: int) -> set[str]:
    states = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text()
        states.add(stat[stat.rindex(")") + 2])
    return states


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="no procfs")
def test_pause_returns_once_every_thread_has_stopped():
    # redis-server runs several threads (bio, io): all must be stopped, not only signalled
    with LocalServer(extra_args=("--io-threads", "2")) as srv:
        for _ in range(20):
            srv.pause()
            assert _states(srv.proc.pid) <= {"T", "t"}
            srv.resume()
        assert redis.Redis(port=srv.port, socket_timeout=5).ping()
