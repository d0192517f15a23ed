import importlib.util
import json
from pathlib import Path

import pytest


def _shared_traces():
    """benchmarks/shared_traces.py: the one place that knows where this
    repository's shared traces live (they are not part of the package)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "shared_traces.py"
    spec = importlib.util.spec_from_file_location("kvoffload_shared_traces", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


shared_trace_path = _shared_traces().shared_trace_path
MOONCAKE = shared_trace_path()
AGENTIC = shared_trace_path("agentic")


@pytest.fixture
def mooncake_path() -> Path:
    if not MOONCAKE.exists():
        pytest.skip(f"shared trace not found at {MOONCAKE}")
    return MOONCAKE


@pytest.fixture
def agentic_dir() -> Path:
    if not AGENTIC.is_dir():
        pytest.skip(f"shared agentic traces not found at {AGENTIC}")
    return AGENTIC


@pytest.fixture
def mooncake_file(tmp_path):
    """Write a tiny Mooncake-format trace from lists of block ids."""
    def make(requests, block_size=4, name="t.jsonl"):
        return write_mooncake(tmp_path / name, requests, block_size)
    return make


def write_mooncake(path: Path, requests: list[list[int]], block_size: int = 4, step_ms: int = 10) -> Path:
    """A tiny Mooncake-format trace: full blocks of block_size tokens."""
    with path.open("w") as f:
        for i, ids in enumerate(requests):
            f.write(json.dumps({"timestamp": i * step_ms, "input_length": len(ids) * block_size,
                                "output_length": 3, "hash_ids": ids}) + "\n")
    return path
