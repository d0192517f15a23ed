"""The CPU manager's error for a key in the wrong state."""

from __future__ import annotations


class BlockStateError(KeyError):
    """A key is not in the state a call needs (not stored, not ready, not
    pinned, no store in flight). Nothing was changed."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""
