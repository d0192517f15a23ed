"""Serving traces: the request stream a replay drives through the tiers.

A request is reduced to what a prefix cache sees: its arrival time, its
token counts and one 64-bit hash per prompt block, prefix-chained (equal
hashes mean an equal prefix up to and including that block). Three formats
load from JSONL, one object per line (and kv-cache-tester's agentic JSON
documents, a file or a directory of them: replay/agentic.py):

- mooncake: timestamp (ms), input_length, output_length, hash_ids
  (512-token blocks, as in Mooncake's FAST'25 traces)
- bailian:  chat_id, parent_chat_id (the previous turn's chat, -1 at a
  session's first), turn, type, timestamp (s), input_length, output_length,
  hash_ids (16-token blocks, Alibaba Bailian)
- tokens:   prompt (a list of token ids), optional timestamp (ms) and
  output_length; hashed here with a prefix-chained hash of full blocks

A malformed line raises TraceError naming the file and line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MASK64 = (1 << 64) - 1
FORMATS = ("mooncake", "bailian", "tokens", "agentic")
DEFAULT_BLOCK_SIZE = {"mooncake": 512, "bailian": 16, "tokens": 16, "agentic": 64}
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


def chain_hashes(tokens: np.ndarray | list[int], block_size: int, parent: int = 0) -> list[int]:
    """Prefix-chained 64-bit hashes of the full blocks of a token sequence."""
    import hashlib

    tokens = np.asarray(tokens, dtype=np.int64)
    out = []
    h = parent
    for i in range(len(tokens) // block_size):
        blob = h.to_bytes(8, "little") + tokens[i * block_size : (i + 1) * block_size].tobytes()
        h = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little")
        out.append(h)
    return out


def _fail(path: Path, lineno: int, msg: str) -> TraceError:
    return TraceError(f"{path}:{lineno}: {msg}")


def _int_field(d: dict, key: str, path: Path, lineno: int, default: int | None = None) -> int:
    if key not in d:
        if default is not None:
            return default
        raise _fail(path, lineno, f"missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _fail(path, lineno, f"{key} must be a non-negative integer, got {v!r}")
    if v > MAX_TOKENS:
        raise _fail(path, lineno, f"{key} must be at most {MAX_TOKENS} tokens, got {v}")
    return v


def _num_field(d: dict, key: str, path: Path, lineno: int, default: float | None = None) -> float:
    if key not in d:
        if default is not None:
            return default
        raise _fail(path, lineno, f"missing field {key!r}")
    v = d[key]
    # NaN compares false with everything: a NaN arrival would stall the simulated clock forever
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
        raise _fail(path, lineno, f"{key} must be a finite non-negative number, got {v!r}")
    try:
        return float(v)
    except OverflowError:  # an int past float's range
        raise _fail(path, lineno, f"{key} must be a finite non-negative number, got {v!r}") from None


def _hash_ids(d: dict, path: Path, lineno: int, input_length: int, block_size: int) -> list[int]:
    ids = d.get("hash_ids")
    if not isinstance(ids, list):
        raise _fail(path, lineno, f"hash_ids must be a list of integers, got {ids!r}")
    for v in ids:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _fail(path, lineno, f"hash_ids must hold non-negative integers, got {v!r}")
    # ceil: the partial tail block hashed too (Mooncake, Bailian); floor: full blocks only
    # (kv-cache-tester's convention; the tail is simply not offloadable)
    need = -(-input_length // block_size)
    if len(ids) not in (need, input_length // block_size):
        raise _fail(path, lineno, f"hash_ids has {len(ids)} entries but input_length={input_length} "
                    f"needs ceil({input_length}/{block_size})={need} or, full blocks only, "
                    f"floor={input_length // block_size} (wrong --block-size?)")
    return [mix64(v) for v in ids]


def detect_format(first: dict) -> str:
    if "prompt" in first:
        return "tokens"
    if "chat_id" in first or "parent_chat_id" in first:
        return "bailian"
    return "mooncake"


def load_trace(path: str | Path, fmt: str = "auto", block_size: int | None = None,
               limit: int | None = None, stagger_s: float | None = None) -> Trace:
    """Read a JSONL trace, or an agentic trace file or directory (see
    replay/agentic.py; `stagger_s` between its conversations' starts);
    `limit` keeps only the first requests."""
    path = Path(path)
    if limit is not None and limit <= 0:
        raise TraceError(f"limit must be a positive number of requests, got {limit}")
    if fmt != "auto" and fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; known: auto, {', '.join(FORMATS)}")
    from kvoffload.replay import agentic

    if fmt == "agentic" or fmt == "auto" and agentic.looks_agentic(path):
        return agentic.load_agentic(path, block_size, limit, stagger_s)
    roots: dict = {}  # bailian: chat_id -> the chat_id its session started with
    try:
        f = path.open("rb")  # decoded line by line, so a bad byte is named by its line
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from None
    trace: Trace | None = None
    with f:
        for lineno, raw in enumerate(_lines(f, path), 1):
            if limit is not None and trace is not None and len(trace.requests) >= limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _fail(path, lineno, f"not UTF-8 text (byte {e.start + 1} of the line: "
                            f"{raw[e.start:e.start + 1]!r})") from None
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise _fail(path, lineno, f"invalid JSON: {e.msg} (column {e.colno})") from None
            except RecursionError:  # e.g. "[[[[..." thousands deep
                raise _fail(path, lineno, "invalid JSON: nested too deeply") from None
            if not isinstance(d, dict):
                raise _fail(path, lineno, f"expected a JSON object, got {type(d).__name__}")
            if trace is None:
                fmt = detect_format(d) if fmt == "auto" else fmt
                bs = DEFAULT_BLOCK_SIZE[fmt] if block_size is None else block_size
                if bs <= 0:
                    raise TraceError(f"block size must be positive, got {bs}")
                trace = Trace(name=path.name, block_size=bs)
            req = _parse(fmt, d, path, lineno, len(trace.requests), trace.block_size)
            if fmt == "bailian":
                req.session = _bailian_session(roots, d)
            trace.requests.append(req)
    if trace is None or not trace.requests:
        raise TraceError(f"{path}: no requests in trace")
    return trace


def _lines(f, path: Path):
    """The file's lines; a read error (a directory, an I/O error) as a TraceError."""
    try:
        yield from f
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from None


def _parse(fmt: str, d: dict, path: Path, lineno: int, idx: int, bs: int) -> Request:
    if fmt == "tokens":
        prompt = d.get("prompt")
        if not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise _fail(path, lineno, "prompt must be a list of integer token ids")
        bad = next((t for t in prompt if not 0 <= t <= MAX_TOKEN_ID), None)
        if bad is not None:
            raise _fail(path, lineno, f"prompt token ids must be in [0, {MAX_TOKEN_ID}], got {bad}")
        return Request(
            req_id=str(d.get("id", idx)),
            arrival_ms=_num_field(d, "timestamp", path, lineno, default=0.0),
            prompt_tokens=len(prompt),
            output_tokens=_int_field(d, "output_length", path, lineno, default=0),
            block_hashes=chain_hashes(prompt, bs),
        )
    input_length = _int_field(d, "input_length", path, lineno)
    output_length = _int_field(d, "output_length", path, lineno)
    hashes = _hash_ids(d, path, lineno, input_length, bs)
    if fmt == "mooncake":
        return Request(str(idx), _num_field(d, "timestamp", path, lineno), input_length,
                       output_length, hashes)
    # bailian: timestamps are seconds
    for key in ("chat_id", "turn"):
        if key not in d:
            raise _fail(path, lineno, f"missing field {key!r}")
    chat = d["chat_id"]
    return Request(f"{idx}-{chat}", _num_field(d, "timestamp", path, lineno) * 1000.0, input_length,
                   output_length, hashes)


def _bailian_session(roots: dict, d: dict) -> str:
    """Bailian's parent_chat_id names the previous turn's chat (-1 at a
    session's first turn), so a session is the chain back to its root chat."""
    chat, parent = d["chat_id"], d.get("parent_chat_id", -1)
    root = chat if parent in (-1, None) else roots.get(_hashable(parent), parent)
    roots[_hashable(chat)] = root
    return str(root)


def _hashable(v):
    return v if isinstance(v, (int, str, float)) else json.dumps(v, sort_keys=True)


def mark_final_turns(trace: Trace) -> int:
    """Give kv_retention "low" to every request none of whose new blocks a
    later request reuses: the hint an application sends when it knows a
    session's last turn (an agent's final step, a one-shot job). Uses the
    trace's future, so a replay with it shows what such hints are worth.
    Returns how many requests were marked."""
    first_of: dict[int, int] = {}  # block -> index of the request that first held it
    continued = [False] * len(trace.requests)
    for i, r in enumerate(trace.requests):
        for h in r.block_hashes:
            j = first_of.setdefault(h, i)
            if j != i:
                continued[j] = True
        for h in r.decode_hashes or ():  # stored after the prompt: a later turn may reuse them
            first_of.setdefault(h, i)
    for r, c in zip(trace.requests, continued):
        if not c:
            r.kv_transfer_params = {**(r.kv_transfer_params or {}), "kv_retention": "low"}
    return continued.count(False)


def shared_trace_path(name: str = "mooncake_conversation_trace.jsonl") -> Path:
    """Where the project's shared traces live: $KVOFFLOAD_SHARED_DIR/traces, else
    ../shared/traces beside the checkout, else /work/shared/traces. The first that
    holds `name` wins; the checkout's sibling is returned when none does."""
    import os

    checkout = Path(__file__).resolve().parents[3]
    candidates = [checkout.parent / "shared", Path("/work/shared")]
    if os.environ.get("KVOFFLOAD_SHARED_DIR"):
        candidates.insert(0, Path(os.environ["KVOFFLOAD_SHARED_DIR"]))
    for base in candidates:
        if (base / "traces" / name).exists():
            return base / "traces" / name
    return candidates[0] / "traces" / name
