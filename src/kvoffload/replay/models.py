"""Model presets: what `--model` sets, so a replay models a GPU and a model.

Per preset: the KV bytes per token (K and V, all layers, bf16), the
engine's prefill throughput (prompt tokens computed per second, the batch
together) and its decode throughput (output tokens per second, the batch
together). The engine-time model (replay/engine_time.py) charges a step the
tokens it computes at these rates, and a tier the KV bytes it moves at its
bandwidth.

The rates are round figures for vLLM-class engines at long prompts (the
agentic and chat traces' prompts are 10k-100k tokens, where attention
halves the short-prompt throughput): an 8B model at 16 GFLOP per token on
an H100 (~990 dense bf16 TFLOP/s) at ~40% utilisation would prefill ~25k
tokens/s on short prompts and ~10k at 32k+ tokens of context; decode is
memory-bound, ~3k tokens/s for a batch of ~64 at ~20 ms per step. A 70B
model costs ~9x the FLOPs per token: on 4 H100s (tensor parallel) ~4k
prefill tokens/s. A user with measured figures passes
--prefill-tokens-per-s / --decode-tokens-per-s, which override the preset's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPreset:
    kv_bytes_per_token: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    about: str


_8B = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head dims x (K, V) x bf16 bytes = 128 KiB
_70B = 80 * 8 * 128 * 2 * 2  # 320 KiB
_QWEN7B = 28 * 4 * 128 * 2 * 2  # 56 KiB

MODEL_PRESETS: dict[str, ModelPreset] = {
    "llama-8b-h100": ModelPreset(_8B, 10_000.0, 3_000.0, "Llama-3.1-8B on one H100"),
    "llama-8b-a100": ModelPreset(_8B, 5_000.0, 1_500.0, "Llama-3.1-8B on one A100"),
    "llama-70b-h100x4": ModelPreset(_70B, 4_000.0, 1_000.0, "Llama-3.1-70B on 4 H100s (TP4)"),
    "llama-70b-h100x8": ModelPreset(_70B, 8_000.0, 2_000.0, "Llama-3.1-70B on 8 H100s (TP8)"),
    "qwen2.5-7b-h100": ModelPreset(_QWEN7B, 11_000.0, 3_000.0, "Qwen2.5-7B on one H100"),
    # earlier names (KV size only, then): the one-GPU H100 rates
    "llama-3.1-8b": ModelPreset(_8B, 10_000.0, 3_000.0, "= llama-8b-h100"),
    "llama-3.1-70b": ModelPreset(_70B, 4_000.0, 1_000.0, "= llama-70b-h100x4"),
    "mistral-7b": ModelPreset(_8B, 10_000.0, 3_000.0, "Mistral-7B on one H100 (Llama-8B's KV shape)"),
    "qwen2.5-7b": ModelPreset(_QWEN7B, 11_000.0, 3_000.0, "= qwen2.5-7b-h100"),
    "tiny": ModelPreset(16, 10_000.0, 3_000.0, "= a toy model of 16 B/token"),
}
DEFAULT_MODEL = "llama-8b-h100"
# Bytes actually copied per token when neither --model nor --kv-bytes-per-token
# is given: small, so replays are fast; the time model still moves the
# default model's KV bytes through the tiers.
FAST_KV_BYTES_PER_TOKEN = 16


def preset_table() -> str:
    """The presets as --help text: name: KV/token, prefill, decode."""
    return "; ".join(f"{n} ({p.kv_bytes_per_token // 1024} KiB/token, {p.prefill_tokens_per_s:,.0f} prefill "
                     f"and {p.decode_tokens_per_s:,.0f} decode tok/s)" for n, p in MODEL_PRESETS.items()
                     if not p.about.startswith("="))
