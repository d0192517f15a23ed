"""Build CanonicalKVCaches from plain engine KV tensors.

An engine hands over one tensor per layer whose first dimension is
num_blocks (any dtype, any trailing shape). A worker only needs bytes:
each tensor becomes an int8 (num_blocks, page bytes) view of the same
memory, and each KV group lists the layers it owns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvoffload.abstractions import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor


def as_page_view(tensor: torch.Tensor) -> torch.Tensor:
    """An int8 (num_blocks, page bytes) view of a (num_blocks, ...) tensor
    whose blocks are each contiguous (the block stride may be padded)."""
    if tensor.dim() < 1 or tensor.shape[0] == 0:
        raise ValueError(f"a KV tensor needs a leading num_blocks dimension, got shape {tuple(tensor.shape)}")
    if not tensor[0].is_contiguous():
        raise ValueError(f"each block of a KV tensor must be contiguous, got strides {tensor.stride()}")
    page = tensor[0].numel() * tensor.element_size()
    stride = tensor.stride(0) * tensor.element_size()
    # view(int8) reinterprets the (contiguous) last dim; as_strided keeps the storage offset
    view = tensor.view(torch.int8).as_strided((tensor.shape[0], page), (stride, 1))
    if view.data_ptr() != tensor.data_ptr():
        raise ValueError("cannot take a byte view of this KV tensor")
    return view


def make_kv_caches(
    tensors: Sequence[torch.Tensor], groups: Sequence[Sequence[int]] | None = None
) -> CanonicalKVCaches:
    """CanonicalKVCaches over the given per-layer tensors. `groups[g]` lists
    the layer indices of KV group g (default: one group of all layers).
    Layers that share one tensor object are stored once in `tensors`."""
    if groups is None:
        groups = [list(range(len(tensors)))]
    unique: list[CanonicalKVCacheTensor] = []
    index_of: dict[int, int] = {}  # id(tensor) -> index in unique
    for t in tensors:
        if id(t) not in index_of:
            view = as_page_view(t)
            index_of[id(t)] = len(unique)
            unique.append(CanonicalKVCacheTensor(view, view.shape[1]))
    refs = []
    for g, layers in enumerate(groups):
        group_refs = []
        for layer in layers:
            if not 0 <= layer < len(tensors):
                raise ValueError(f"groups[{g}] names layer {layer}, but there are {len(tensors)} layers")
            i = index_of[id(tensors[layer])]
            group_refs.append(CanonicalKVCacheRef(i, unique[i].page_size_bytes))
        refs.append(group_refs)
    return CanonicalKVCaches(unique, refs)


def random_kv_caches(
    num_blocks: int,
    page_bytes: Sequence[int] | int,
    groups: Sequence[Sequence[int]] | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    """Per-layer int8 tensors of random bytes (one per entry of page_bytes)
    and their CanonicalKVCaches: a stand-in engine for tests and demos."""
    if isinstance(page_bytes, int):
        page_bytes = [page_bytes]
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randint(-128, 128, (num_blocks, p), dtype=torch.int8, generator=gen).to(device)
        for p in page_bytes
    ]
    return tensors, make_kv_caches(tensors, groups)
