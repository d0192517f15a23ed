"""ChunkGeometry: what one offloaded chunk is and how many the CPU tier
holds, resolved once, from the first source that knows both:

  declared   extra_config kv_bytes_per_chunk / kv_bytes_per_token, with
             num_cpu_chunks or cpu_bytes_to_use (the scheduler-side manager
             is built before any KV cache exists, maybe in another process)
  KV caches  the worker measures a chunk (tiers/cpu/plan.chunk_layout)
  pool file  a manager in another process reads the shared pool's header

A later source is checked against what was declared: a mismatch is a
ConfigError (the pool would not hold what the manager counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvoffload.config import ConfigError, parse_bytes
from kvoffload.tiers.base import align_up


@dataclass(frozen=True)
class ChunkGeometry:
    tokens_per_chunk: int
    chunk_bytes: int  # KV bytes of one chunk: all layers of the largest KV group
    num_chunks: int  # chunk slots in the CPU tier

    @property
    def slot_bytes(self) -> int:
        """A host-pool slot: the chunk, 4 KiB aligned."""
        return align_up(self.chunk_bytes)


class ResolvedGeometry:
    """Where a spec's ChunkGeometry lands once a source knows it. The spec's
    manager holds the same one and reads the chunk size from it (for its
    *_bytes counters): the manager may exist before the size is known
    (num_cpu_chunks declared, the size measured by a later worker)."""

    __slots__ = ("geometry",)

    def __init__(self) -> None:
        self.geometry: ChunkGeometry | None = None

    @property
    def chunk_bytes(self) -> int:
        """KV bytes of one chunk; 0 while unknown."""
        return 0 if self.geometry is None else self.geometry.chunk_bytes


def declared_chunk_bytes(extra: dict[str, Any], tokens_per_chunk: int) -> int | None:
    """KV bytes per chunk from extra_config, if it says."""
    if "kv_bytes_per_chunk" in extra and "kv_bytes_per_token" in extra:
        raise ConfigError("give kv_bytes_per_chunk or kv_bytes_per_token, not both")
    if "kv_bytes_per_chunk" in extra:
        return parse_bytes(extra["kv_bytes_per_chunk"], "kv_bytes_per_chunk")
    if "kv_bytes_per_token" in extra:
        return parse_bytes(extra["kv_bytes_per_token"], "kv_bytes_per_token") * tokens_per_chunk
    return None


def chunks_in(cpu_bytes: int, chunk_bytes: int) -> int:
    """How many chunk slots cpu_bytes_to_use holds."""
    slot = align_up(chunk_bytes)  # the host pool aligns every slot to 4 KiB
    n = cpu_bytes // slot
    if n <= 0:
        raise ConfigError(
            f"cpu_bytes_to_use={cpu_bytes} holds no chunk of {chunk_bytes} bytes ({slot} with alignment)"
        )
    return n


def check_measured(declared: int | None, measured: int, tokens_per_chunk: int) -> None:
    """The worker's measured chunk against a declared one."""
    if declared is not None and measured != declared:
        raise ConfigError(
            f"extra_config declares {declared} KV bytes per chunk, but the KV caches "
            f"have {measured} ({measured // tokens_per_chunk} per token over "
            f"{tokens_per_chunk} tokens): fix kv_bytes_per_chunk / kv_bytes_per_token"
        )


def check_pool_file(path: str, num_chunks: int, chunk_bytes: int,
                    declared_chunks: int | None, declared_bytes: int | None) -> None:
    """A shared pool file's header against what was declared."""
    for declared, have, what in ((declared_bytes, chunk_bytes, "KV bytes per chunk"),
                                 (declared_chunks, num_chunks, "chunks")):
        if declared is not None and declared != have:
            raise ConfigError(f"extra_config declares {declared} {what}, but the shared pool {path} has {have}")
