"""An SGLang MHA host KV pool on CPU whose page methods are SGLang's own.

SGLang's MHATokenToKVPoolHost cannot be imported on a CPU torch:
`sglang.srt.mem_cache.pool_host` imports `sglang.srt.configs`, which imports
torchvision, whose PyPI wheel is a CUDA build that fails on torch+cpu
("operator torchvision::nms does not exist"). So this class holds the same
buffer (kv_buffer shaped as SGLang's init_kv_buffer shapes it per layout) and
takes the methods the backend calls -- get_page_buffer_meta, get_data_page,
get_dummy_flat_data_page, set_from_flat_data_page, get_size_per_token --
from the installed sglang's pool_host/mha.py source, compiled as they are.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest
import torch

METHODS = ("get_page_buffer_meta", "get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page",
           "get_size_per_token")


def _sglang_methods() -> dict:
    root = Path(importlib.util.find_spec("sglang").origin).parent
    src = (root / "srt" / "mem_cache" / "pool_host" / "mha.py").read_text()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "MHATokenToKVPoolHost")
    found = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in METHODS:
            node.decorator_list = []
            mod = ast.Module(body=[node], type_ignores=[])
            scope = {"torch": torch}
            exec(compile(mod, str(root / "srt/mem_cache/pool_host/mha.py"), "exec"), scope)
            found[node.name] = scope[node.name]
    missing = set(METHODS) - set(found)
    assert not missing, f"sglang's MHATokenToKVPoolHost lost {missing}"
    return found


def need_sglang():
    """Call at a test module's top: skip it locally when sglang is missing, fail under CI."""
    try:
        import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    except ImportError as e:
        msg = f"sglang is not importable ({e}); scripts/setup.sh installs sglang==0.5.23 --no-deps"
        if os.environ.get("CI"):
            raise
        pytest.skip(msg, allow_module_level=True)


class SGLangMHAHostPool:
    """size tokens of layer_num layers, head_num heads of head_dim, in one of SGLang's host layouts."""

    def __init__(self, size: int, page_size: int, layer_num: int, head_num: int, head_dim: int,
                 layout: str = "page_first", dtype=torch.bfloat16):
        self.size, self.page_size, self.layer_num = size, page_size, layer_num
        self.head_num, self.head_dim, self.v_head_dim = head_num, head_dim, head_dim
        self.layout, self.dtype, self.device, self.pin_memory = layout, dtype, "cpu", False
        self.page_num = size // page_size
        dims = {
            "layer_first": (2, layer_num, size, head_num, head_dim),
            "page_first": (2, size, layer_num, head_num, head_dim),
            "page_first_direct": (2, self.page_num, layer_num, page_size, head_num, head_dim),
            "page_head": (2, self.page_num, head_num, page_size, layer_num, head_dim),
        }[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, self.kv_buffer.shape, generator=g,
                                                             dtype=torch.int16))


if importlib.util.find_spec("sglang") is not None:
    for _name, _fn in _sglang_methods().items():
        setattr(SGLangMHAHostPool, _name, _fn)
