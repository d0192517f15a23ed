"""What a cache reset does to the CPU tier's slots while jobs are in flight.

vLLM's contract: the loads and stores in flight at a reset are never
completed (complete_load/complete_store will not come for them), and
on_reset_flushed() is called once the workers have finished every one of
them. So their keys are forgotten at once (a dropped store is never
readable: its bytes may never land), and their slots are fenced: held out
of the free list until on_reset_flushed(), since a worker may still read or
write them. Readable, unpinned slots are free at once.
"""

from __future__ import annotations

from kvoffload.tiers.cpu.slot_state import PENDING


def drop_all_keys(slot_of: dict[bytes, int], state: bytearray, free: list[int], fenced: list[int]) -> list[bytes]:
    """Forget every key: idle slots to `free`, slots with a job in flight to
    `fenced` (their state reset to 0). Returns the keys that were announced
    stored (readable), whose removal the caller announces."""
    removed = []
    for k, s in slot_of.items():
        v = state[s]
        if v == 0:
            free.append(s)
        else:
            fenced.append(s)
            state[s] = 0
        if v != PENDING:  # announced stored: announce its removal
            removed.append(k)
    slot_of.clear()
    return removed
