"""The CPU manager's pin counts key by key (its slow path: a slot pinned
MAX_PINS times keeps the pins past that in `_more_pins`, and an error undoes
what the call changed). Mixed into CPUOffloadingManager, whose `_state`
(slot_state.py), `_more_pins`, `_slot_of` and `name` these read."""

from __future__ import annotations

from collections.abc import Collection

from kvoffload.abstractions import OffloadKey
from kvoffload.tiers.cpu.errors import BlockStateError
from kvoffload.tiers.cpu.slot_state import MAX_PINS, PENDING


class SlotPins:
    def _pin_each(self, keys: Collection[OffloadKey], slots: list[int]) -> int:
        """prepare_load's pins key by key; how many slots were unpinned before."""
        state, more = self._state, self._more_pins
        newly_pinned = 0
        for s in slots:  # (no enumerate: the error path finds its place)
            v = state[s]
            if not v:
                newly_pinned += 1
            elif v >= MAX_PINS:
                if v == PENDING:
                    # the loop stops at a pending slot's first listing (nothing here makes one pending)
                    self._unpin_each(slots[:slots.index(s)][::-1])  # undo: nothing changes on error
                    key = next(k for k in keys if self._slot_of[k] == s)
                    raise BlockStateError(f"{self.name}: prepare_load of key {key!r} that is still being written")
                more[s] = more.get(s, 0) + 1
                continue
            state[s] = v + 1
        return newly_pinned

    def _unpin_each(self, slots: list[int]) -> None:
        """Drop one pin of each slot (all pinned): the undo of _pin_each, in reverse."""
        state, more = self._state, self._more_pins
        for s in slots:
            if state[s] == MAX_PINS and s in more:
                more[s] -= 1
                if not more[s]:
                    del more[s]
            else:
                state[s] -= 1

    def _repin(self, slots: list[int]) -> None:
        """Put back one pin of each slot: the undo of _complete_each (a pin
        at MAX_PINS goes beside, as _pin_each puts it)."""
        state, more = self._state, self._more_pins
        for s in slots:
            if state[s] >= MAX_PINS:
                more[s] = more.get(s, 0) + 1
            else:
                state[s] += 1

    def _complete_each(self, keys: Collection[OffloadKey], slots: list[int], op: str) -> int:
        """_unpin's unpins key by key; how many slots became unpinned."""
        state, more = self._state, self._more_pins
        unpinned = 0
        for i, s in enumerate(slots):
            v = state[s]
            if v == 1:
                unpinned += 1
            elif not v or v == PENDING:  # not pinned, or listed more often than pinned
                self._repin(slots[:i])  # undo: nothing changes on error
                key = next(k for k in keys if self._slot_of[k] == s)
                raise BlockStateError(
                    f"{self.name}: {op} of key {key!r} that has no load in flight "
                    f"(or is listed more often than it was loaded)"
                )
            elif v == MAX_PINS and s in more:
                more[s] -= 1
                if not more[s]:
                    del more[s]
                continue
            state[s] = v - 1
        return unpinned
