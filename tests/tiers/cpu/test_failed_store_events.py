"""A failed store's cleanup event (vLLM 0.33's contract, its
cpu/test_manager.py::test_take_events_prunes_retried_cleanup_and_drains_once):
removed + metadata_only, pruned for keys a retry holds again, drained once."""

from kvoffload.keys import make_offload_key
from kvoffload.tiers.cpu.manager import CPUOffloadingManager


def K(i):
    return make_offload_key(i.to_bytes(8, "big"), 0)


def test_failed_store_emits_metadata_only_removal():
    m = CPUOffloadingManager(4, enable_events=True)
    m.prepare_store([K(1), K(2)], None)
    m.complete_store([K(1), K(2)], None, success=False)
    (ev,) = m.take_events()
    assert ev.removed and ev.metadata_only and ev.keys == [K(1), K(2)]
    assert list(m.take_events()) == []  # drained once


def test_cleanup_of_a_key_a_retry_holds_again_is_pruned():
    m = CPUOffloadingManager(4, enable_events=True)
    m.prepare_store([K(1), K(2)], None)
    m.complete_store([K(1), K(2)], None, success=False)
    m.prepare_store([K(2)], None)  # the retry re-allocates K(2) before the events are taken
    (ev,) = m.take_events()
    assert ev.metadata_only and ev.keys == [K(1)]
    m.complete_store([K(2)], None)
    (stored,) = m.take_events()
    assert not stored.removed and stored.keys == [K(2)]


def test_a_retried_cleanup_with_every_key_held_again_is_dropped():
    m = CPUOffloadingManager(4, enable_events=True)
    m.prepare_store([K(1)], None)
    m.complete_store([K(1)], None, success=False)
    m.prepare_store([K(1)], None)
    assert list(m.take_events()) == []


def test_no_events_when_disabled():
    m = CPUOffloadingManager(4)
    m.prepare_store([K(1)], None)
    m.complete_store([K(1)], None, success=False)
    assert list(m.take_events()) == []
