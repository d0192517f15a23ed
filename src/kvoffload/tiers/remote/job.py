"""A transfer job of a remote tier's worker, shared by every remote tier."""

from __future__ import annotations

import time


class TransferJob:
    """One submitted job, over its parts: reported once parts_left reaches 0,
    ok only if every part was."""

    __slots__ = ("job_id", "is_store", "blocks", "parts_left", "ok", "start")

    def __init__(self, job_id: int, is_store: bool, blocks: int, parts: int):
        self.job_id = job_id
        self.is_store = is_store
        self.blocks = blocks
        self.parts_left = parts
        self.ok = True
        self.start = time.perf_counter()
