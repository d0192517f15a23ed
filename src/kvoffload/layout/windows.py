"""Sliding windows: which blocks and chunks a KV group needs to resume.

Full attention needs every block of the prefix; a sliding window of W
tokens only the blocks holding the last W-1 tokens. Stores and loads of a
sliding-window group move only those chunks (whole chunks, so a chunk is
never half written).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.abstractions import GPULoadStoreSpec
from kvoffload.config import OffloadingConfig


def window_block_indices(num_tokens: int, tokens_per_block: int, sliding_window: int | None) -> range:
    """Indices (within the request) of the full blocks a group needs so that
    computation can resume after `num_tokens` tokens. Full attention needs all
    of them; a sliding window of W tokens only the blocks holding the last
    W-1 tokens (the next token attends to itself and the W-1 before it)."""
    if num_tokens < 0 or tokens_per_block <= 0:
        raise ValueError(f"bad num_tokens={num_tokens} or tokens_per_block={tokens_per_block}")
    end = num_tokens // tokens_per_block  # only full blocks are offloaded
    if sliding_window is None:
        return range(0, end)
    if sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    first = max(0, num_tokens - sliding_window + 1) // tokens_per_block
    return range(min(first, end), end)


def window_chunks(config: OffloadingConfig, group: int, num_tokens: int, first_token: int = 0) -> range:
    """Indices (within the request) of the offloaded chunks of a group that
    hold tokens [first_token, num_tokens) and that resuming after num_tokens
    needs: all of them for full attention, for a sliding window only those
    reaching into it. Whole chunks, so a chunk is never half written."""
    tpc = config.tokens_per_chunk
    g = config.groups[group]
    need = window_block_indices(num_tokens, tpc, g.sliding_window)
    return range(max(need.start, -(-first_token // tpc)), need.stop)


def window_gpu_spec(config: OffloadingConfig, block_tables: Sequence[Sequence[int]], num_tokens: int,
                    first_token: int = 0) -> tuple[GPULoadStoreSpec, list[range]]:
    """The GPU side of a store or load of a request's tokens [first_token,
    num_tokens) (chunk-aligned), with only the blocks each group needs
    (`window_chunks`); block_tables[g] are the request's GPU block ids of
    group g, by block index. Returns the spec and, per group, the chunk
    indices whose keys go with it (in order: group 0's, then group 1's...)."""
    if len(block_tables) != len(config.groups):
        raise ValueError(f"{len(block_tables)} block tables for {len(config.groups)} KV groups")
    ids: list[int] = []
    sizes, starts, chunks = [], [], []
    for g, table in enumerate(block_tables):
        r = window_chunks(config, g, num_tokens, first_token)
        if config.groups[g].tokens_per_block > config.tokens_per_chunk:
            raise ValueError(f"group {g}: a GPU block spans several chunks; give whole chunks' blocks")
        k = config.gpu_blocks_per_chunk(g)
        lo, hi = r.start * k, r.stop * k
        if hi > len(table):
            raise ValueError(f"group {g}: {num_tokens} tokens need {hi} GPU blocks, the table has {len(table)}")
        ids.extend(table[lo:hi])
        sizes.append(hi - lo)
        starts.append(lo)
        chunks.append(r)
    return GPULoadStoreSpec(ids, sizes, starts), chunks
