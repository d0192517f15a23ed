"""The Mooncake tier's hashing threads: how work is cut into pieces, checks
before headers, and nothing queued is dropped at shutdown (no server)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.tiers.mooncake.hashing import MIN_PIECE_BYTES, HashThreads


@pytest.fixture
def one_thread():
    h = HashThreads(1, name="test-hash")
    yield h
    h.stop(5)


@given(n=st.integers(1, 200), item=st.integers(1, 8 << 20), threads=st.integers(1, 6))
def test_pieces_cover_every_item_once(n, item, threads):
    h = HashThreads.__new__(HashThreads)  # pieces() needs only the thread count
    h.threads = [None] * threads
    p = h.pieces(n, item)
    assert p[0][0] == 0 and p[-1][1] == n and all(a < b for a, b in p)
    assert all(p[i][1] == p[i + 1][0] for i in range(len(p) - 1))  # contiguous, in order
    assert 1 <= len(p) <= threads
    if len(p) > 1:  # split only where each piece is worth a hand-off
        assert all((b - a) * item >= MIN_PIECE_BYTES // 2 for a, b in p)
        assert n * item >= len(p) * MIN_PIECE_BYTES


def test_a_big_round_is_shared_by_the_threads():
    h = HashThreads.__new__(HashThreads)
    h.threads = [None] * 2
    assert h.pieces(16, 4 << 20) == [(0, 8), (8, 16)]
    assert h.pieces(16, 64 << 10) == [(0, 16)]  # 1 MiB: one piece


def test_checks_run_before_queued_headers(one_thread):
    ran, gate = [], threading.Event()
    one_thread.run_soon([gate.wait], urgent=False)  # holds the only thread
    one_thread.run_soon([lambda: ran.append("header")], urgent=False)
    one_thread.run_soon([lambda: ran.append("check")], urgent=True)
    gate.set()
    one_thread.wait_background(5)
    assert ran == ["check", "header"]


def test_wait_background_waits_for_a_running_task(one_thread):
    gate, done = threading.Event(), []
    one_thread.run_soon([lambda: (gate.wait(), done.append(1))], urgent=False)
    t = threading.Thread(target=lambda: (one_thread.wait_background(30), done.append(2)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not done  # still waiting: the task holds its gate
    gate.set()
    t.join(30)
    assert done == [1, 2]


def test_stop_runs_what_is_queued_and_a_failing_task_does_not_end_a_thread():
    h = HashThreads(2, name="test-hash")
    ran = []

    def bad():
        raise RuntimeError("boom")

    h.run_soon([bad, bad], urgent=True)
    h.run_soon([lambda i=i: ran.append(i) for i in range(20)], urgent=False)
    h.stop(5)
    assert sorted(ran) == list(range(20)) and not any(t.is_alive() for t in h.threads)
