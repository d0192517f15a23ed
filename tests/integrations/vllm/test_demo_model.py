"""`kvoffload vllm-demo-model`: a random-weight Llama with a tokenizer,
made offline, identical from run to run (the serving test and benchmark
compare outputs across server restarts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

SRC = str(Path(__file__).resolve().parents[3] / "src")
SMALL = ["--layers", "1", "--hidden", "64", "--vocab", "400", "--max-len", "512"]


def _build(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvoffload.cli", "vllm-demo-model", str(out), *SMALL, *extra],
                          env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=300)


def test_demo_model_is_deterministic_and_its_tokenizer_loads(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        done = _build(d)
        assert done.returncode == 0, done.stderr[-2000:]
    files = sorted(p.name for p in a.iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name

    tok = AutoTokenizer.from_pretrained(a)
    config = AutoConfig.from_pretrained(a)
    text = "def hello(world):\n    return {'x': 42}  # ünïcode"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text  # byte-level: any text round-trips
    assert len(ids) < len(text.encode())  # merges learned
    assert config.vocab_size == len(tok) and max(ids) < config.vocab_size
    assert config.eos_token_id == tok.eos_token_id and config.num_hidden_layers == 1


def test_a_bad_size_is_one_line(tmp_path):
    done = _build(tmp_path / "m", "--hidden", "100")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "kvoffload vllm-demo-model: --hidden must be a multiple of 64 (head size 64), got 100"]
