"""`kvoffload vllm-demo-model DIR`: a random-weight Llama with a tokenizer,
made offline, so `vllm serve DIR` answers HTTP text prompts without a
download (a demo and test model: its outputs are noise, but deterministic).

The tokenizer is a byte-level BPE trained with `tokenizers` on a fixed list
of Python standard-library sources (present wherever Python is), saved with
PreTrainedTokenizerFast.save_pretrained so AutoTokenizer (and vLLM) load it.
Same seed, same Python version -> same weights and same tokenizer.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Training text: standard-library modules as files (fixed list, fixed order).
CORPUS_MODULES = (
    "argparse", "json/decoder", "json/encoder", "textwrap", "string", "csv",
    "difflib", "calendar", "heapq", "bisect", "functools", "pprint",
    "dataclasses", "shutil", "tempfile", "configparser", "fractions", "statistics",
)
SPECIALS = ("<s>", "</s>")  # ids 0, 1: bos, eos


def corpus_files() -> list[Path]:
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / f"{m}.py" for m in CORPUS_MODULES]
    return [f for f in files if f.is_file()]


def train_tokenizer(vocab_size: int):
    """A byte-level BPE as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = corpus_files()
    if not files:
        raise RuntimeError("no Python standard-library sources found to train the demo tokenizer on")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [f.read_text(encoding="utf-8") for f in files]
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1], pad_token=SPECIALS[1],
        model_max_length=1 << 20,
    )


def build_demo_model(path: str | Path, layers: int = 4, hidden: int = 512, vocab_size: int = 8192,
                     max_len: int = 8192, seed: int = 0) -> Path:
    """Write the model (bf16 safetensors, config) and its tokenizer to path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden % 64:
        raise ValueError(f"--hidden must be a multiple of 64 (head size 64), got {hidden}")
    path = Path(path)
    tokenizer = train_tokenizer(vocab_size)
    torch.manual_seed(seed)
    heads = hidden // 64
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_len,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _run(args) -> int:
    try:
        out = build_demo_model(args.dir, layers=args.layers, hidden=args.hidden,
                               vocab_size=args.vocab, max_len=args.max_len, seed=args.seed)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"kvoffload vllm-demo-model: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({args.layers} layers, hidden {args.hidden}, random weights, BPE tokenizer)")
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("vllm-demo-model", help="write a tiny random-weight Llama with a tokenizer")
    p.add_argument("dir", help="directory to write (config, weights, tokenizer)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512, help="hidden size (multiple of 64)")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    p.add_argument("--max-len", type=int, default=8192, help="max_position_embeddings")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)
