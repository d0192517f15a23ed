"""The trace model every loader fills (traces.py for JSONL formats,
agentic.py for kv-cache-tester documents): a Trace of Requests, each reduced
to what a prefix cache sees, and the field parsers the loaders share, each
raising one TraceError that names the file and line.

Invariants: a Request's block_hashes are prefix-chained 64-bit ints (equal
hashes mean an equal prefix up to and including that block); token counts
are in 0..MAX_TOKENS; times are finite and >= 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MASK64 = (1 << 64) - 1
# Token counts past this are no request's (the largest int32, as engines
# count positions); bigger ones would only overflow or exhaust memory later.
MAX_TOKENS = 2**31 - 1
MAX_TOKEN_ID = 2**63 - 1  # token ids are hashed as int64


class TraceError(ValueError):
    """A trace file is unreadable or a line is malformed; names the line."""


@dataclass
class Request:
    req_id: str
    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: list[int]  # one per prompt block, prefix-chained, 64-bit
    # Hashes of the full blocks completed during decode (prompt tail plus
    # output), when the trace lets us know them; None: unknowable, so the
    # replay gives them hashes no later prompt can match.
    decode_hashes: list[int] | None = None
    session: str | None = None
    kv_transfer_params: dict | None = None  # handed to the offloading manager as is
    # block_hashes as int64 (the replay's content seeds), from a loader that
    # has them in an array already: saves the replay a conversion per block.
    # Whoever changes block_hashes afterwards sets this back to None.
    hash_array: np.ndarray | None = field(default=None, repr=False, compare=False)


@dataclass
class Trace:
    name: str
    block_size: int  # tokens per hash block
    requests: list[Request] = field(default_factory=list)

    @property
    def num_block_refs(self) -> int:
        return sum(len(r.block_hashes) for r in self.requests)

    def num_unique_blocks(self) -> int:
        return len({h for r in self.requests for h in r.block_hashes})

    def block_tokens(self, req: Request, i: int) -> int:
        """Tokens of prompt block i (the last block may be partial)."""
        return max(0, min(self.block_size, req.prompt_tokens - i * self.block_size))


def mix64(x: int) -> int:
    """splitmix64 finalizer: spreads small trace ids over 64 bits."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def fail(path: Path, lineno: int, msg: str) -> TraceError:
    """A TraceError naming the file and line (or request) of `msg`."""
    return TraceError(f"{path}:{lineno}: {msg}")


def int_field(d: dict, key: str, path: Path, lineno: int, default: int | None = None) -> int:
    """d[key] as a token count (0..MAX_TOKENS); `default` when absent, if given."""
    if key not in d:
        if default is not None:
            return default
        raise fail(path, lineno, f"missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise fail(path, lineno, f"{key} must be a non-negative integer, got {v!r}")
    if v > MAX_TOKENS:
        raise fail(path, lineno, f"{key} must be at most {MAX_TOKENS} tokens, got {v}")
    return v


def num_field(d: dict, key: str, path: Path, lineno: int, default: float | None = None) -> float:
    """d[key] as a finite number >= 0 (a time); `default` when absent, if given."""
    if key not in d:
        if default is not None:
            return default
        raise fail(path, lineno, f"missing field {key!r}")
    v = d[key]
    # NaN compares false with everything: a NaN arrival would stall the simulated clock forever
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
        raise fail(path, lineno, f"{key} must be a finite non-negative number, got {v!r}")
    try:
        return float(v)
    except OverflowError:  # an int past float's range
        raise fail(path, lineno, f"{key} must be a finite non-negative number, got {v!r}") from None
