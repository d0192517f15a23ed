"""The embedded default workload: seeded multi-turn chat sessions.

Sessions share a few system prompts (a popular one more often), and each
turn's prompt is the previous prompt plus the model's answer plus a new
user message, so a turn reuses everything before it. Token ids are random
but seeded, and hashed exactly like a `tokens` trace.
"""

from __future__ import annotations

import sys

import numpy as np

from kvoffload.replay.traces import Request, Trace, chain_hashes


def generate_chat(seed: int = 0, sessions: int = 200, block_size: int = 64,
                  system_prompts: int = 4, max_turns: int = 8, limit: int | None = None,
                  progress: bool = False) -> Trace:
    """limit: only the first `limit` requests (by arrival), the same as
    generating all and cutting, without building the other sessions: each
    session's first request arrives at its start, and the sessions start in
    order, so the first N requests come from the first N sessions.
    progress: a bar on stderr when generating takes more than 2 s."""
    rng = np.random.default_rng(seed)
    vocab = 32000
    sys_tokens = [rng.integers(0, vocab, int(rng.integers(512, 3072))) for _ in range(system_prompts)]
    popularity = 1.0 / np.arange(1, system_prompts + 1)  # Zipf-like
    popularity /= popularity.sum()
    requests: list[Request] = []
    start_ms = np.cumsum(rng.exponential(2000.0, sessions))  # a session every ~2 s
    built = range(sessions if limit is None else min(sessions, limit))
    if progress:
        try:
            from tqdm import tqdm

            built = tqdm(built, desc="generating chat sessions", unit="session", file=sys.stderr,
                         delay=2, leave=False)
        except ImportError:
            pass
    for s in built:
        tokens = list(sys_tokens[int(rng.choice(system_prompts, p=popularity))])
        hashes: list[int] = []
        t = float(start_ms[s])
        for turn in range(int(rng.integers(1, max_turns + 1))):
            tokens.extend(rng.integers(0, vocab, int(rng.integers(32, 512))).tolist())
            _extend(hashes, tokens, block_size)
            prompt_len = len(tokens)
            n_prompt_full = prompt_len // block_size
            output = int(rng.integers(16, 512))
            tokens.extend(rng.integers(0, vocab, output).tolist())
            _extend(hashes, tokens, block_size)
            decode = hashes[n_prompt_full : (prompt_len + output) // block_size]
            requests.append(Request(
                req_id=f"s{s}t{turn}", arrival_ms=t, prompt_tokens=prompt_len, output_tokens=output,
                block_hashes=hashes[:n_prompt_full], decode_hashes=list(decode), session=f"s{s}",
            ))
            t += float(rng.exponential(30000.0))  # user think time
    requests.sort(key=lambda r: r.arrival_ms)
    if limit is not None:
        requests = requests[:limit]
    return Trace(name=f"chat(seed={seed},sessions={sessions})", block_size=block_size, requests=requests)


def _extend(hashes: list[int], tokens: list[int], block_size: int) -> None:
    """Hash the newly completed full blocks of a growing session."""
    done = len(hashes)
    parent = hashes[-1] if hashes else 0
    hashes.extend(chain_hashes(tokens[done * block_size :], block_size, parent))
