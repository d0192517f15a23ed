"""A tiny random-weight Llama saved locally, so vLLM tests need no download."""

from __future__ import annotations

from pathlib import Path

VOCAB = 512


def build_tiny_llama(path: str | Path, seed: int = 0) -> Path:
    """Write a 2-layer Llama with random weights (and no tokenizer) to path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path
