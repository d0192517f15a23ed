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
from pathlib import Path

import numpy as np

from kvoffload.replay import agentic
from kvoffload.replay.trace_model import (  # re-exported: the loaders' public names
    MASK64,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    Request,
    Trace,
    TraceError,
    fail,
    int_field,
    mix64,
    num_field,
)

__all__ = ["FORMATS", "DEFAULT_BLOCK_SIZE", "MASK64", "MAX_TOKENS", "MAX_TOKEN_ID", "Request", "Trace",
           "TraceError", "chain_hashes", "detect_format", "load_trace", "mark_final_turns", "mix64"]

FORMATS = ("mooncake", "bailian", "tokens", "agentic")
DEFAULT_BLOCK_SIZE = {"mooncake": 512, "bailian": 16, "tokens": 16, "agentic": 64}

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


def _hash_ids(d: dict, path: Path, lineno: int, input_length: int, block_size: int) -> list[int]:
    ids = d.get("hash_ids")
    if not isinstance(ids, list):
        raise fail(path, lineno, f"hash_ids must be a list of integers, got {ids!r}")
    for v in ids:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise fail(path, lineno, f"hash_ids must hold non-negative integers, got {v!r}")
    # ceil: the partial tail block hashed too (Mooncake, Bailian); floor: full blocks only
    # (kv-cache-tester's convention; the tail is simply not offloadable)
    need = -(-input_length // block_size)
    if len(ids) not in (need, input_length // block_size):
        raise fail(path, lineno, f"hash_ids has {len(ids)} entries but input_length={input_length} "
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
                raise fail(path, lineno, f"not UTF-8 text (byte {e.start + 1} of the line: "
                            f"{raw[e.start:e.start + 1]!r})") from None
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise fail(path, lineno, f"invalid JSON: {e.msg} (column {e.colno})") from None
            except RecursionError:  # e.g. "[[[[..." thousands deep
                raise fail(path, lineno, "invalid JSON: nested too deeply") from None
            if not isinstance(d, dict):
                raise fail(path, lineno, f"expected a JSON object, got {type(d).__name__}")
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
            raise fail(path, lineno, "prompt must be a list of integer token ids")
        bad = next((t for t in prompt if not 0 <= t <= MAX_TOKEN_ID), None)
        if bad is not None:
            raise fail(path, lineno, f"prompt token ids must be in [0, {MAX_TOKEN_ID}], got {bad}")
        return Request(
            req_id=str(d.get("id", idx)),
            arrival_ms=num_field(d, "timestamp", path, lineno, default=0.0),
            prompt_tokens=len(prompt),
            output_tokens=int_field(d, "output_length", path, lineno, default=0),
            block_hashes=chain_hashes(prompt, bs),
        )
    input_length = int_field(d, "input_length", path, lineno)
    output_length = int_field(d, "output_length", path, lineno)
    hashes = _hash_ids(d, path, lineno, input_length, bs)
    if fmt == "mooncake":
        return Request(str(idx), num_field(d, "timestamp", path, lineno), input_length,
                       output_length, hashes)
    # bailian: timestamps are seconds
    for key in ("chat_id", "turn"):
        if key not in d:
            raise fail(path, lineno, f"missing field {key!r}")
    chat = d["chat_id"]
    return Request(f"{idx}-{chat}", num_field(d, "timestamp", path, lineno) * 1000.0, input_length,
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
