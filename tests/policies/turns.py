"""Requests through the CPU manager as vLLM drives it, for the policy tests."""

from kvoffload.abstractions import LookupResult, ReqContext
from kvoffload.keys import make_offload_key
from kvoffload.tiers.cpu.manager import CPUOffloadingManager


def keys(conv: int, n: int) -> list[bytes]:
    return [make_offload_key(conv.to_bytes(2, "big") + i.to_bytes(4, "big"), 0) for i in range(n)]


def turn(m: CPUOffloadingManager, prompt: list[bytes], step: int = 4, params=None) -> int:
    """One request: lookups to the first miss, load the hits, store the rest
    in steps, finish. Returns its prefix hits."""
    ctx = ReqContext("r", kv_transfer_params=params)
    for i, k in enumerate(prompt):
        ctx.set_offload_key_position(k, (i + 1) * 64)
    m.on_new_request(ctx)
    n = 0
    for k in prompt:
        if m.lookup(k, ctx) is not LookupResult.HIT:
            break
        n += 1
    if n:
        m.prepare_load(prompt[:n], ctx)
        m.complete_load(prompt[:n], ctx)
    rest = prompt[n:]
    for a in range(0, len(rest), step):
        out = m.prepare_store(rest[a:a + step], ctx)
        if out is not None and out.keys_to_store:
            m.complete_store(out.keys_to_store, ctx)
    m.on_request_finished(ctx)
    return n
