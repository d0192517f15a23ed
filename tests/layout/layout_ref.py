"""Reference for the layout tests, written independently of the CopyRuns:
what a TP rank's engine tensor holds, cut from the TP=1 tensor with narrow();
a reference copier through a mapping's runs (store_pages / load_pages); and
CanonicalKVCaches of per-layer engine tensors with their mappings
(canonical_kv_caches), as an engine of our own would build them."""

import logging
import math
from collections.abc import Sequence

import torch

from kvoffload.abstractions import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CanonicalPageMapping,
    CopyRun,
)
from kvoffload.layout import (
    MLA,
    LayerLayout,
    LayoutError,
    ParallelLayout,
    check_layer,
    heads_of_rank,
    layer_mapping,
    opaque_mapping,
    page_shape,
)
from kvoffload.layout.models import refuse_unsupported

logger = logging.getLogger(__name__)


def head_dim_of_page(layer: LayerLayout) -> int:
    """Index of the heads axis in a page of page_shape(layer, ...)."""
    if layer.kv == "split":
        return 2 if layer.order == "NHD" else 1
    return 1 if layer.order == "NHD" else 0


def full_cache(layer: LayerLayout, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """A TP=1 engine tensor (num_blocks, *page) of random bytes."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, *page_shape(layer, 1 if layer.kind == MLA else layer.num_kv_heads))
    nbytes = torch.empty((), dtype=layer.dtype).element_size()
    raw = torch.randint(0, 256, (num_blocks * int(torch.tensor(shape[1:]).prod()) * nbytes,),
                        dtype=torch.uint8, generator=g)
    return raw.view(layer.dtype).reshape(shape)


def shard(full: torch.Tensor, layer: LayerLayout, par: ParallelLayout) -> torch.Tensor:
    """The engine tensor rank par.tp_rank holds (a contiguous copy)."""
    if layer.kind == MLA:
        return full.clone()
    H, tp, r = layer.num_kv_heads, par.tp_size, par.tp_rank
    if H >= tp:
        start, n = r * (H // tp), H // tp
    else:
        start, n = r // (tp // H), 1  # heads replicated over tp/H ranks
    return full.narrow(1 + head_dim_of_page(layer), start, n).clone(memory_format=torch.contiguous_format)


def rows(t: torch.Tensor) -> torch.Tensor:
    """An engine tensor as uint8 rows, one page per block."""
    return t.reshape(t.shape[0], -1).view(torch.uint8)


# ---------------------------------------------------------------- reference copies (not the worker's path)


def _common_width(mapping: CanonicalPageMapping, *rows: torch.Tensor) -> int:
    """The widest integer size (8, 4, 2, 1 bytes) every run offset, stride and
    size and every row address is a multiple of: wide elements copy faster."""
    g = 8
    for t in rows:
        if t.dtype != torch.uint8 or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"pages must be uint8 rows (n, bytes), each contiguous; got "
                             f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
        g = math.gcd(g, t.stride(0), t.shape[1], t.data_ptr())
    for r in mapping.runs:
        g = math.gcd(g, r.local_offset, r.canonical_offset, r.fragment_size, r.local_stride,
                     r.canonical_stride)
    return g


_INT_OF_WIDTH = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _run_view(rows: torch.Tensor, offset: int, stride: int, run: CopyRun, width: int) -> torch.Tensor:
    """The (n, num_fragments, fragment) strided view of one run in every row."""
    rows = rows.view(_INT_OF_WIDTH[width])
    return rows.as_strided((rows.shape[0], run.num_fragments, run.fragment_size // width),
                           (rows.stride(0), stride // width, 1),
                           rows.storage_offset() + offset // width)


def _check_rows(mapping: CanonicalPageMapping, local: torch.Tensor, canonical: torch.Tensor) -> int:
    if local.shape[0] != canonical.shape[0]:
        raise ValueError(f"{local.shape[0]} local pages but {canonical.shape[0]} canonical pages")
    if local.shape[1] < mapping.local_page_size_bytes or canonical.shape[1] < mapping.canonical_page_size_bytes:
        raise ValueError(f"pages too small: local {local.shape[1]} bytes (need {mapping.local_page_size_bytes}),"
                         f" canonical {canonical.shape[1]} (need {mapping.canonical_page_size_bytes})")
    return _common_width(mapping, local, canonical)


def store_pages(mapping: CanonicalPageMapping, local: torch.Tensor, canonical: torch.Tensor) -> None:
    """Copy local pages into their canonical pages (row i -> row i). Rows are
    uint8 (n, bytes) views with any row stride (e.g. a pool chunk's pages).
    One strided copy per run for the whole batch, no temporaries. Choosing
    which blocks this rank writes (`is_writer`) is the caller's."""
    w = _check_rows(mapping, local, canonical)
    for r in mapping.runs:
        _run_view(canonical, r.canonical_offset, r.canonical_stride, r, w).copy_(
            _run_view(local, r.local_offset, r.local_stride, r, w))


def load_pages(mapping: CanonicalPageMapping, canonical: torch.Tensor, local: torch.Tensor) -> None:
    """Copy this rank's part of canonical pages into local pages (row i -> row i)."""
    w = _check_rows(mapping, local, canonical)
    for r in mapping.runs:
        _run_view(local, r.local_offset, r.local_stride, r, w).copy_(
            _run_view(canonical, r.canonical_offset, r.canonical_stride, r, w))


# ---------------------------------------------------------------- CanonicalKVCaches of engine tensors


def block_rows(tensor: torch.Tensor) -> torch.Tensor:
    """An engine KV tensor (num_blocks, ...) as uint8 rows, one (possibly
    padded) page per block, sharing its memory."""
    if tensor.dim() < 1 or tensor.shape[0] == 0:
        raise LayoutError(f"KV tensor must have a leading num_blocks dimension, got {tuple(tensor.shape)}")
    per_block = tensor[0]
    if not per_block.is_contiguous():
        raise LayoutError(f"a block's page is not contiguous (shape {tuple(tensor.shape)}, "
                          f"strides {tensor.stride()}): num_blocks must be the outermost dimension")
    nb, elem = tensor.shape[0], tensor.element_size()
    page = per_block.numel() * elem
    stride = tensor.stride(0) * elem if nb > 1 else page
    if stride < page:
        raise LayoutError(f"KV tensor blocks overlap: stride {stride} bytes < page {page} bytes")
    start = tensor.storage_offset() * elem
    room = tensor.untyped_storage().nbytes() - start - (nb - 1) * stride  # bytes the last row may use
    if room < page:
        raise LayoutError("KV tensor rows run past its storage")
    width = min(stride, room)  # padded page, unless the last block's padding is not allocated
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
    return flat.as_strided((nb, width), (stride, 1), start)


def layer_ref_mapping(tensor: torch.Tensor, layer: LayerLayout, par: ParallelLayout) -> CanonicalPageMapping:
    """The mapping of an engine tensor's layer, checked against its shape:
    falls back to opaque when the tensor does not hold the layout it claims."""
    page_bytes = tensor[0].numel() * tensor.element_size()
    try:
        check_layer(layer)
        if tensor.dtype != layer.dtype and tensor.dtype not in (torch.uint8, torch.int8):
            raise LayoutError(f"tensor dtype {tensor.dtype} is not the layer's {layer.dtype}")
        if tensor.dim() > 2 and tensor.dtype == layer.dtype:
            heads = 1 if layer.kind == MLA else heads_of_rank(layer, par)[1]
            expected = page_shape(layer, heads)
            if tuple(tensor.shape[1:]) != expected:
                raise LayoutError(f"tensor block shape {tuple(tensor.shape[1:])} is not the "
                                  f"{layer.layout_id} page shape {expected}")
    except LayoutError as e:
        logger.warning("layer %s: no canonical mapping (%s); storing an opaque per-rank page",
                       layer.name or "?", e)
        return opaque_mapping(page_bytes)
    return layer_mapping(layer, par, page_bytes)


def canonical_kv_caches(layers: Sequence[tuple[torch.Tensor, LayerLayout]],
                        groups: Sequence[Sequence[int]], par: ParallelLayout) -> CanonicalKVCaches:
    """CanonicalKVCaches from per-layer engine tensors (num_blocks, ...) and
    the layer indices of each KV group, with each ref's mapping filled in.
    Layers sharing one tensor share its CanonicalKVCacheTensor. Refuses
    (UnsupportedModelError) models with state we cannot offload."""
    for _, layer in layers:
        refuse_unsupported(layer.kind, f"layer {layer.name or '?'}")
    tensors: list[CanonicalKVCacheTensor] = []
    index_of: dict[tuple[int, tuple[int, ...]], int] = {}
    refs: list[CanonicalKVCacheRef] = []
    for tensor, layer in layers:
        ident = (tensor.data_ptr(), tuple(tensor.shape))
        if ident not in index_of:
            rows = block_rows(tensor)
            index_of[ident] = len(tensors)
            tensors.append(CanonicalKVCacheTensor(rows, rows.shape[1]))
        mapping = layer_ref_mapping(tensor, layer, par)
        refs.append(CanonicalKVCacheRef(index_of[ident], mapping.local_page_size_bytes, mapping))
    return CanonicalKVCaches(tensors, [[refs[i] for i in g] for g in groups])
