"""SGLang MHA and MLA host KV pools on CPU whose page methods are SGLang's own.

SGLang's MHATokenToKVPoolHost cannot be imported on a CPU torch:
`sglang.srt.mem_cache.pool_host` imports `sglang.srt.configs`, which imports
torchvision, whose PyPI wheel is a CUDA build that fails on torch+cpu
("operator torchvision::nms does not exist"). So this class holds the same
buffer (kv_buffer shaped as SGLang's init_kv_buffer shapes it per layout) and
takes the methods the backend calls -- get_page_buffer_meta, get_data_page,
get_dummy_flat_data_page, set_from_flat_data_page -- from the installed
sglang's pool_host/mha.py (MHATokenToKVPoolHost) and mla.py
(MLATokenToKVPoolHost) source, compiled as they are.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest
import torch

MHA_METHODS = ("get_page_buffer_meta", "get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page",
               "get_size_per_token")
MLA_METHODS = ("get_page_buffer_meta", "get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page",
               "_storage_page_index")


def _sglang_methods(module: str, class_name: str, names: tuple[str, ...]) -> dict:
    """Methods of an sglang class, compiled from the installed package's source."""
    path = Path(importlib.util.find_spec("sglang").origin).parent / "srt" / "mem_cache" / "pool_host" / module
    cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == class_name)
    found = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            scope = {"torch": torch}
            exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), scope)
            found[node.name] = scope[node.name]
    missing = set(names) - set(found)
    assert not missing, f"sglang's {class_name} lost {missing}"
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


class SGLangMLAHostPool:
    """SGLang's MLA host pool (one latent of kv_lora_rank + qk_rope_head_dim per token and layer, the same on
    every TP rank), without decode context parallelism."""

    def __init__(self, size: int, page_size: int, layer_num: int, kv_lora_rank: int = 64,
                 qk_rope_head_dim: int = 16, layout: str = "page_first", dtype=torch.bfloat16):
        self.size, self.page_size, self.layer_num, self.layout, self.dtype = size, page_size, layer_num, layout, dtype
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.device, self.pin_memory, self.dcp_size, self.logical_page_size = "cpu", False, 1, page_size
        self.page_num = size // page_size
        dims = {
            "layer_first": (layer_num, size, 1, self.kv_cache_dim),
            "page_first": (size, layer_num, 1, self.kv_cache_dim),
            "page_first_direct": (self.page_num, layer_num, page_size, 1, self.kv_cache_dim),
        }[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    fill_random = SGLangMHAHostPool.fill_random


if importlib.util.find_spec("sglang") is not None:
    for _cls, _mod, _name, _names in ((SGLangMHAHostPool, "mha.py", "MHATokenToKVPoolHost", MHA_METHODS),
                                      (SGLangMLAHostPool, "mla.py", "MLATokenToKVPoolHost", MLA_METHODS)):
        for _attr, _fn in _sglang_methods(_mod, _name, _names).items():
            setattr(_cls, _attr, _fn)
