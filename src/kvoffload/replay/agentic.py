"""kv-cache-tester's agentic traces (callanjfox/kv-cache-tester, the format
its trace_replay_tester.py replays): one JSON document per conversation,

    {"id", "block_size": 64, "hash_id_scope": "local", "requests": [
        {"t": s from the conversation's start, "type": "s"|"n", "in", "out",
         "hash_ids": [...], "api_time", "think_time", ...},
        {"type": "subagent", "t": ..., "requests": [...]}, ...]}

- hash_ids name the full 64-token blocks of the prompt (floor(in / 64) of
  them; a ceil count, with a hashed partial tail, is accepted too). An id
  is prefix-consistent: one id, one predecessor, one position.
- "local" scope: ids mean something within one file only, so each file's
  ids are salted with the file's place in the load (two files' id 1 are
  different blocks). "global": ids are shared across files, unsalted.
- A "subagent" entry nests a sub-agent's own calls: each is a request of
  its own (its own context, its own hash_ids, same id scope as the file),
  timed from the sub-agent's start (the parent's time plus the entry's t),
  as the tester flattens them. Sub-agents may nest.
- t already holds the recorded pacing: t[n] = t[n-1] + api_time[n-1] +
  think_time[n] (the server's time, then the user's or tool's), so
  `--arrival trace` replays think and API time as recorded.
- Conversations start `stagger_s` apart, in file-name order; the merged
  stream is ordered by arrival, so the stagger sets the interleaving even
  with `--arrival asap`.

Any malformed input raises one TraceError naming the file (and the request).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from kvoffload.replay.trace_model import MASK64, Request, Trace, TraceError, int_field, mix64, num_field

BLOCK_SIZE = 64  # the format's default (the tester's --chunk-size)
DEFAULT_STAGGER_S = 60.0  # as issue 17's study: conversations start a minute apart
MAX_NESTING = 32  # sub-agents of sub-agents; deeper is a malformed file, not recursion


def looks_agentic(path: Path) -> bool:
    """A directory, or a JSON document (not JSONL) with the format's keys."""
    if path.is_dir():
        return True
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError:
        return False  # load_trace names the error
    first = head.lstrip().split(b"\n", 1)[0].strip()
    if not first.startswith(b"{"):
        return False
    # a pretty-printed document opens with a lone "{"; a one-line one shows its keys early
    return first == b"{" or b'"hash_id_scope"' in head or b'"requests"' in head


def agentic_files(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.glob("*.json") if p.is_file())
    if not files:
        raise TraceError(f"{path}: no *.json agentic traces in this directory")
    return files


def load_agentic(path: str | Path, block_size: int | None = None, limit: int | None = None,
                 stagger_s: float | None = None) -> Trace:
    """A file or a directory of agentic traces as one request stream."""
    path = Path(path)
    if limit is not None and limit <= 0:
        raise TraceError(f"limit must be a positive number of requests, got {limit}")
    stagger = DEFAULT_STAGGER_S if stagger_s is None else stagger_s
    if isinstance(stagger, bool) or not isinstance(stagger, (int, float)) or not 0 <= stagger < math.inf:
        raise TraceError(f"stagger must be a finite number of seconds >= 0, got {stagger!r}")
    bs = block_size
    if bs is not None and bs <= 0:
        raise TraceError(f"block size must be positive, got {bs}")
    reqs: list[tuple[float, int, int, Request]] = []  # (arrival, conversation, order, request)
    for conv, f in enumerate(agentic_files(path)):
        doc = _read(f)
        fbs = doc.get("block_size")
        if fbs is None:  # unstated: the block size asked for, else the format's
            fbs = bs or BLOCK_SIZE
        if isinstance(fbs, bool) or not isinstance(fbs, int) or fbs <= 0:
            raise TraceError(f"{f}: block_size must be a positive integer, got {fbs!r}")
        if bs is None:
            bs = fbs
        elif fbs != bs:
            raise TraceError(f"{f}: block_size {fbs} differs from {bs} (--block-size or an earlier file); "
                             f"one replay has one block size")
        scope = doc.get("hash_id_scope", "local")
        if not isinstance(scope, str):
            raise TraceError(f"{f}: hash_id_scope must be a string, got {scope!r}")
        salt = 0 if scope == "global" else mix64(conv + 1)
        parser = _Parser(f, f.stem, bs, salt, conv * stagger)
        parser.walk(doc.get("requests"), "requests", base=0.0, agent=f.stem, depth=0)
        if not parser.out:
            raise TraceError(f"{f}: no requests in trace")
        reqs.extend((r.arrival_ms, conv, i, r) for i, r in enumerate(parser.out))
    reqs.sort(key=lambda x: x[:3])
    trace = Trace(name=path.name, block_size=bs, requests=[r for *_, r in reqs])
    if limit is not None:
        trace.requests = trace.requests[:limit]
    return trace


def _read(f: Path) -> dict:
    try:
        raw = f.read_bytes()
    except OSError as e:
        raise TraceError(f"cannot read trace {f}: {e.strerror}") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise TraceError(f"{f}: not UTF-8 text (byte {e.start + 1})") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"{f}: invalid JSON: {e.msg} (line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise TraceError(f"{f}: invalid JSON: nested too deeply") from None
    if not isinstance(doc, dict):
        raise TraceError(f"{f}: expected a JSON object with 'requests', got {type(doc).__name__}")
    return doc


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """mix64 over a uint64 array (wrapping arithmetic, as MASK64 does)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class _Parser:
    def __init__(self, f: Path, stem: str, bs: int, salt: int, start_s: float):
        self.f, self.stem, self.bs, self.start_s = f, stem, bs, start_s
        self.salt = np.uint64(salt)
        self.out: list[Request] = []
        self.agents = 0

    def walk(self, reqs, where: str, base: float, agent: str, depth: int) -> None:
        if not isinstance(reqs, list):
            raise TraceError(f"{self.f}: {where} must be a list of requests, got {type(reqs).__name__}")
        if depth > MAX_NESTING:
            raise TraceError(f"{self.f}: {where}: sub-agents nested more than {MAX_NESTING} deep")
        for i, d in enumerate(reqs):
            at = f"{where}[{i}]"
            if not isinstance(d, dict):
                raise TraceError(f"{self.f}: {at}: expected a JSON object, got {type(d).__name__}")
            t = num_field(d, "t", self.f, at)
            if d.get("type") == "subagent":
                self.agents += 1
                self.walk(d.get("requests"), f"{at}.requests", base + t, f"{self.stem}/sa{self.agents}", depth + 1)
                continue
            for key in ("api_time", "think_time"):  # the pacing t records; checked, not needed
                if key in d:
                    num_field(d, key, self.f, at)
            arrival_ms = (self.start_s + base + t) * 1000.0
            if not math.isfinite(arrival_ms):  # finite parts, an infinite sum: the clock would never get there
                raise TraceError(f"{self.f}: {at}: arrival time overflows ({self.start_s:g} s stagger "
                                 f"+ {base:g} s + t={t:g} s)")
            self.out.append(self._request(d, at, arrival_ms, agent))

    def _request(self, d: dict, at: str, arrival_ms: float, agent: str) -> Request:
        n_in = int_field(d, "in", self.f, at)
        n_out = int_field(d, "out", self.f, at)
        ids = d.get("hash_ids")
        if not isinstance(ids, list):
            raise TraceError(f"{self.f}: {at}: hash_ids must be a list of integers, got {ids!r}")
        try:  # C-level checks first (this runs for every id of every request)
            if set(map(type, ids)) - {int}:
                raise TypeError
            arr = np.array(ids, dtype=np.uint64)
        except (TypeError, OverflowError):
            bad = next(v for v in ids if type(v) is not int or not 0 <= v <= MASK64)
            raise TraceError(f"{self.f}: {at}: hash_ids must hold integers in [0, 2**64), got {bad!r}") from None
        full, ceil = n_in // self.bs, -(-n_in // self.bs)
        if len(ids) not in (full, ceil):
            raise TraceError(f"{self.f}: {at}: hash_ids has {len(ids)} entries but in={n_in} needs "
                             f"floor({n_in}/{self.bs})={full} (full blocks) or ceil={ceil}")
        hashes = _mix64_array(arr ^ self.salt)
        return Request(f"{self.stem}:{len(self.out)}", arrival_ms, n_in, n_out, hashes.tolist(), session=agent,
                       hash_array=hashes.view(np.int64))
