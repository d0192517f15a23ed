"""Reference for the layout tests, written independently of the CopyRuns:
what a TP rank's engine tensor holds, cut from the TP=1 tensor with narrow()."""

import torch

from kvoffload.layout import MLA, LayerLayout, ParallelLayout, page_shape


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
