"""The canonical page layout: KV blocks that do not depend on tensor parallelism.

Under tensor parallelism each rank holds a slice of every layer's KV page
(its share of the KV heads). The canonical page of a block is the page a
single rank (TP=1) would hold for the same layer format: all heads, in the
same axis order. A rank's CanonicalPageMapping lists the CopyRuns that place
its slice inside that page, so a block stored at TP=2 loads at TP=1 or TP=4.

Ranks that hold identical bytes (GQA with fewer KV heads than ranks, where
heads are replicated; MLA, where every rank holds the same latent) take
turns writing them, by block id (`is_writer`), so the canonical page is
written once, not once per rank. Before a mapping is trusted, the mappings
of every rank are derived and checked to tile the canonical page exactly
once for every block; a layout that cannot be mapped falls back to an
opaque per-rank page (parallelism_agnostic=False), which must then be kept
apart per rank (see `parallel_layout_id`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvoffload.abstractions import CanonicalKVCaches, CanonicalPageMapping, CopyRun
from kvoffload.layout.models import ATTENTION, MLA, refuse_unsupported

logger = logging.getLogger(__name__)


class LayoutError(ValueError):
    """A layer layout cannot be mapped to a canonical page (message says why)."""



@dataclass(frozen=True)
class LayerLayout:
    """How one layer's KV page is laid out, independent of parallelism.

    The local page of a block is, per axis order (outermost first):
      attention, kv="split":  NHD (2, T, h, D)   HND (2, h, T, D)
      attention, kv="packed": NHD (T, h, 2, D)   HND (h, T, 2, D)
      mla:                    (T, D)  with D = latent size (kv_lora_rank + rope dim)
    where T = block_size tokens, h = this rank's KV heads, D = head_dim.
    """

    block_size: int  # tokens per GPU block
    num_kv_heads: int  # total over all ranks (1 for mla)
    head_dim: int
    dtype: torch.dtype
    kind: str = ATTENTION
    kv: str = "split"  # "split": K half then V half; "packed": K,V adjacent per head
    order: str = "NHD"  # "NHD": tokens outside heads; "HND": heads outside tokens
    kv_heads_per_rank: int | None = None  # what the engine allocated; None: the TP rule
    name: str = ""  # layer name, for messages

    @property
    def layout_id(self) -> str:
        """What must match for two deployments' canonical pages to agree."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.kind == MLA:
            return f"mla:T{self.block_size}:D{self.head_dim}:{dtype}"
        return f"{self.kind}:{self.kv}:{self.order}:T{self.block_size}:H{self.num_kv_heads}:D{self.head_dim}:{dtype}"


@dataclass(frozen=True)
class ParallelLayout:
    """Where this worker sits in tensor parallelism."""

    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self):
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad parallel layout: tp_rank={self.tp_rank}, tp_size={self.tp_size}")


# ---------------------------------------------------------------- mappings


def opaque_mapping(local_page_size_bytes: int) -> CanonicalPageMapping:
    """This rank's page as is: every rank writes its own, never shared."""
    n = local_page_size_bytes
    run = CopyRun(0, 0, n, 1, n, n)
    return CanonicalPageMapping(n, n, (run,), num_writers=1, writer_index=0, parallelism_agnostic=False)


def heads_of_rank(layer: LayerLayout, par: ParallelLayout) -> tuple[int, int, int, int]:
    """(first head, heads held, num_writers, writer_index) of this rank,
    following the usual TP rule: heads are split evenly when there are at
    least as many as ranks, else each rank holds one head and tp/H ranks
    share (replicate) each head."""
    H, tp, r = layer.num_kv_heads, par.tp_size, par.tp_rank
    if H >= tp:
        if H % tp:
            raise LayoutError(f"{H} KV heads do not split evenly over {tp} ranks")
        h = H // tp
        return r * h, h, 1, 0
    if tp % H:
        raise LayoutError(f"{tp} ranks do not replicate {H} KV heads evenly")
    replicas = tp // H
    return r // replicas, 1, replicas, r % replicas


def page_shape(layer: LayerLayout, heads: int) -> tuple[int, ...]:
    """Shape of one block's page holding `heads` KV heads (see LayerLayout)."""
    T, D = layer.block_size, layer.head_dim
    if layer.kind == MLA:
        return (T, D)
    nhd = layer.order == "NHD"
    if layer.kv == "split":
        return (2, T, heads, D) if nhd else (2, heads, T, D)
    return (T, heads, 2, D) if nhd else (heads, T, 2, D)


def check_layer(layer: LayerLayout) -> None:
    """Raise UnsupportedModelError for state we must not offload, LayoutError
    for a layout we cannot describe."""
    refuse_unsupported(layer.kind, f"layer {layer.name or '?'}")
    if layer.kind not in (ATTENTION, MLA):
        raise LayoutError(f"unknown layer kind {layer.kind!r}")
    if layer.kind == ATTENTION:
        if layer.kv not in ("split", "packed"):
            raise LayoutError(f"kv must be 'split' or 'packed', got {layer.kv!r}")
        if layer.order not in ("NHD", "HND"):
            raise LayoutError(f"order must be 'NHD' or 'HND', got {layer.order!r}")
    for field in ("block_size", "num_kv_heads", "head_dim"):
        v = getattr(layer, field)
        if not isinstance(v, int) or v <= 0:
            raise LayoutError(f"{field} must be a positive integer, got {v!r}")


def try_layer_mapping(layer: LayerLayout, par: ParallelLayout) -> CanonicalPageMapping:
    """The mapping of this rank's page, or LayoutError saying why there is none.
    Raises UnsupportedModelError for state we must not offload at all."""
    check_layer(layer)
    elem = torch.empty((), dtype=layer.dtype).element_size()
    if layer.kind == MLA:
        n = math.prod(page_shape(layer, 1)) * elem
        run = CopyRun(0, 0, n, 1, n, n)
        return CanonicalPageMapping(n, n, (run,), num_writers=par.tp_size,
                                    writer_index=par.tp_rank, parallelism_agnostic=True)
    first, h, num_writers, writer_index = heads_of_rank(layer, par)
    if layer.kv_heads_per_rank is not None and layer.kv_heads_per_rank != h:
        raise LayoutError(f"engine holds {layer.kv_heads_per_rank} KV heads per rank, "
                          f"but {layer.num_kv_heads} heads over {par.tp_size} ranks give {h}")
    shape = page_shape(layer, h)
    if layer.kv == "split":
        head_axis = 2 if layer.order == "NHD" else 1
    else:
        head_axis = 1 if layer.order == "NHD" else 0
    outer = math.prod(shape[:head_axis])  # axes outside the heads flatten uniformly
    inner = math.prod(shape[head_axis + 1:]) * elem  # bytes of one head's contiguous part
    H = layer.num_kv_heads
    run = CopyRun(local_offset=0, canonical_offset=first * inner, fragment_size=h * inner,
                  num_fragments=outer, local_stride=h * inner, canonical_stride=H * inner)
    return CanonicalPageMapping(canonical_page_size_bytes=outer * H * inner,
                                local_page_size_bytes=outer * h * inner, runs=(run,),
                                num_writers=num_writers, writer_index=writer_index,
                                parallelism_agnostic=True)


@functools.lru_cache(maxsize=256)  # layers of a model share a few layouts
def _verify_all_ranks(layer: LayerLayout, tp_size: int) -> None:
    verify_tiling([try_layer_mapping(layer, ParallelLayout(r, tp_size)) for r in range(tp_size)])


def layer_mapping(layer: LayerLayout, par: ParallelLayout,
                  local_page_size_bytes: int | None = None) -> CanonicalPageMapping:
    """This rank's mapping for one layer, verified against every other rank's.
    Falls back to an opaque per-rank page (logged) when the layout cannot be
    mapped, or when its local page size is not what the engine holds."""
    try:
        mapping = try_layer_mapping(layer, par)
        _verify_all_ranks(dataclasses.replace(layer, name=""), par.tp_size)
        if local_page_size_bytes is not None and local_page_size_bytes != mapping.local_page_size_bytes:
            raise LayoutError(f"engine page is {local_page_size_bytes} bytes, "
                              f"layout gives {mapping.local_page_size_bytes}")
        return mapping
    except LayoutError as e:
        if local_page_size_bytes is None:
            raise
        logger.warning("layer %s: no canonical mapping (%s); storing an opaque per-rank page",
                       layer.name or "?", e)
        return opaque_mapping(local_page_size_bytes)


# ---------------------------------------------------------------- tiling check


def _coverage(page_size: int, ranges: list[tuple[int, int, int, int]]) -> np.ndarray:
    """How many times each byte of a page is covered by (offset, size, n, stride) runs."""
    diff = np.zeros(page_size + 1, dtype=np.int32)
    for offset, size, n, stride in ranges:
        starts = offset + np.arange(n, dtype=np.int64) * stride
        if n and (starts.min() < 0 or size < 0 or starts.max() + size > page_size):
            raise LayoutError(f"run at offset {offset} (size {size} x {n}, stride {stride}) "
                              f"leaves the {page_size}-byte page")
        np.add.at(diff, starts, 1)
        np.add.at(diff, starts + size, -1)
    return np.cumsum(diff[:-1])


def _expect_once(counts: np.ndarray, what: str) -> None:
    bad = np.flatnonzero(counts != 1)
    if bad.size:
        i = int(bad[0])
        kind = "gap" if counts[i] == 0 else "overlap"
        raise LayoutError(f"{what}: {kind} at byte {i} (covered {int(counts[i])} times)")


def verify_tiling(mappings: Sequence[CanonicalPageMapping]) -> None:
    """Check the mappings of all ranks of one layer: each rank's runs cover its
    own page exactly once, and for every block the writers of that block
    cover the canonical page exactly once (no gap, no overlap)."""
    if not mappings:
        raise LayoutError("no mappings to verify")
    size = mappings[0].canonical_page_size_bytes
    for rank, m in enumerate(mappings):
        if m.canonical_page_size_bytes != size:
            raise LayoutError(f"rank {rank}: canonical page is {m.canonical_page_size_bytes} bytes, "
                              f"rank 0 says {size}")
        if not 0 <= m.writer_index < m.num_writers:
            raise LayoutError(f"rank {rank}: writer_index {m.writer_index} of {m.num_writers} writers")
        local = [(r.local_offset, r.fragment_size, r.num_fragments, r.local_stride) for r in m.runs]
        _expect_once(_coverage(m.local_page_size_bytes, local), f"rank {rank} local page")
    period = math.lcm(*(m.num_writers for m in mappings))
    for block in range(period):
        ranges = [(r.canonical_offset, r.fragment_size, r.num_fragments, r.canonical_stride)
                  for m in mappings if m.is_writer(block) for r in m.runs]
        _expect_once(_coverage(size, ranges), f"canonical page of block {block}")


# ---------------------------------------------------------------- ids


def is_agnostic(kv_caches: CanonicalKVCaches) -> bool:
    """True when every ref has a canonical, parallelism-free mapping."""
    refs = [r for g in kv_caches.group_data_refs for r in g]
    return bool(refs) and all(r.mapping is not None and r.mapping.parallelism_agnostic for r in refs)


def check_shareable(kv_caches: CanonicalKVCaches) -> None:
    """Raise ValueError unless the TP ranks may share one host pool: every
    ref must be canonical, else ranks would overwrite each other's pages."""
    for g, refs in enumerate(kv_caches.group_data_refs):
        for i, ref in enumerate(refs):
            if ref.mapping is None or not ref.mapping.parallelism_agnostic:
                raise ValueError(f"group {g} ref {i} (tensor {ref.tensor_idx}) has no canonical mapping: "
                                 "TP ranks cannot share a host pool; give each rank its own")


def parallel_layout_id(kv_caches: CanonicalKVCaches, par: ParallelLayout, shared_pool: bool = False) -> str:
    """Namespace.parallel_layout of the chunks this rank's pool holds:
    "agnostic" when any TP layout may read them, else an id that keeps each
    rank's pages apart. Chunks are whole canonical pages only if every ref
    is canonical and either the pool is shared by all TP ranks or this rank
    alone holds every byte of the page (TP=1, MLA)."""
    complete = shared_pool or all(r.mapping is not None and r.mapping.local_page_size_bytes
                                  == r.mapping.canonical_page_size_bytes
                                  for g in kv_caches.group_data_refs for r in g)
    if is_agnostic(kv_caches) and complete:
        return "agnostic"
    return f"tp{par.tp_size}-rank{par.tp_rank}"


def canonical_layout_id(layers: Sequence[LayerLayout]) -> str:
    """Namespace.layout: a short id of every layer's canonical page format."""
    blob = "|".join(layer.layout_id for layer in layers).encode()
    return "canon-" + hashlib.sha256(blob).hexdigest()[:12]
