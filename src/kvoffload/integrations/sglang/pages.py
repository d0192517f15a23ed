"""SGLang host-pool pages as kvoffload chunks: what a page's bytes are, the
namespace that says so, and the copies between SGLang's host pool and the
backend's staging slots.

A stored page is the concatenation of the byte ranges SGLang's own
`get_page_buffer_meta(indices)` gives for it, in that order: for MHA
page_first / page_first_direct / page_head that is the K half of the page
then the V half, for MLA page_first / page_first_direct the page's latents:
exactly `get_data_page(index, flat=True)` in both cases, so the
zero-copy calls (interface_v1) and the generic ones (flat tensors) store
the same bytes. layer_first is refused: there the two orders differ.

Sharing with vLLM. kvoffload's vLLM chunks are canonical pages, per layer
K then V (README "Canonical layout"), keyed by vLLM's block hashes; an
SGLang page puts all layers' K before any V, in an order that depends on
the host layout, and is keyed by SGLang's chained SHA-256 of the page's
tokens. Neither the bytes nor the keys agree, so the namespace's layout
starts with "sglang-" and never equals a vLLM one: the two engines share a
directory or server but never a block. Two SGLang engines share pages when
model, dtype, host layout, page size and shard agree.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvoffload.config import ConfigError
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool

# host layouts whose zero-copy ranges, concatenated, are the flat data page
SUPPORTED_LAYOUTS = ("page_first", "page_first_direct", "page_head")
# host-pool attributes that change what a page's bytes mean (those a pool has)
_GEOMETRY_ATTRS = ("layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim",
                   "kv_cache_dim")
_HEX = frozenset("0123456789abcdef")


def key_bytes(key: str) -> bytes:
    """An SGLang page key as an offload key: its 32 bytes when it is SGLang's
    64-hex-digit SHA-256, else its UTF-8 (lengthened to 33 bytes if it has
    exactly 32, so it can never equal a hash's bytes)."""
    if len(key) == 64 and _HEX.issuperset(key):
        return bytes.fromhex(key)
    if "\0" in key:
        raise ValueError(f"SGLang page key {key!r}: NUL is not allowed in a key")
    b = key.encode()
    return b + b"\0" if len(b) == 32 else b


@dataclass(frozen=True)
class PageFormat:
    pool_class: str
    layout: str
    page_size: int  # tokens per page
    page_bytes: int
    ranges_per_page: int  # byte ranges get_page_buffer_meta gives per page
    dtype: str
    geometry: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, pool) -> PageFormat:
        """Read the format of an SGLang host pool (HostKVCache) through its public attributes."""
        layout = getattr(pool, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise ConfigError(f"kvoffload SGLang backend: host layout {layout!r} is not supported; "
                              f"use --hicache-mem-layout one of {list(SUPPORTED_LAYOUTS)}")
        page_size = int(pool.page_size)
        try:
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
        except (ValueError, NotImplementedError, AssertionError) as e:  # e.g. MLA has no page_head
            raise ConfigError(f"kvoffload SGLang backend: {type(pool).__name__} with host layout {layout!r} "
                              f"gives no page byte ranges ({e})") from None
        if not ptrs or len(ptrs) != len(sizes) or any(isinstance(p, (list, tuple)) for p in ptrs):
            raise ConfigError(f"kvoffload SGLang backend: {type(pool).__name__} gives no flat page "
                              f"byte ranges; only KV host pools (MHA/MLA) are supported")
        geometry = tuple((a, int(getattr(pool, a))) for a in _GEOMETRY_ATTRS if getattr(pool, a, None) is not None)
        return cls(type(pool).__name__, layout, page_size, int(sum(sizes)), len(ptrs), str(pool.dtype), geometry)

    @property
    def layout_id(self) -> str:
        shape = "-".join(f"{a}{v}" for a, v in self.geometry)
        return f"sglang-{self.pool_class}-{self.layout}-{shape}"

    def namespace(self, model: str, parallel_layout: str) -> Namespace:
        return Namespace(model=model, dtype=self.dtype, layout=self.layout_id, block_size=self.page_size,
                         parallel_layout=parallel_layout, chunk_bytes=self.page_bytes)


class PageCopier:
    """Copies whole pages between SGLang's host pool and staging slots."""

    def __init__(self, pool, fmt: PageFormat, staging: HostPool):
        self.pool = pool
        self.fmt = fmt
        self.staging = staging
        self._base = staging.tensor.data_ptr()
        self._slot_bytes = staging.chunk_bytes

    def _ranges(self, host_indices: torch.Tensor, n_pages: int):
        if host_indices.numel() != n_pages * self.fmt.page_size:
            raise ValueError(f"{n_pages} keys need {n_pages * self.fmt.page_size} host indices, "
                             f"got {host_indices.numel()}")
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != n_pages * self.fmt.ranges_per_page or sum(sizes) != n_pages * self.fmt.page_bytes:
            raise ValueError(f"host pool gave {len(ptrs)} ranges of {sum(sizes)} bytes for {n_pages} pages")
        return ptrs, sizes

    def to_slots(self, host_indices: torch.Tensor, pages: range, slots: list[int]) -> None:
        """Pages (positions in host_indices, page units) -> staging slots."""
        self._copy(host_indices, pages, slots, to_slots=True)

    def from_slots(self, host_indices: torch.Tensor, pages: range, slots: list[int]) -> None:
        self._copy(host_indices, pages, slots, to_slots=False)

    def _copy(self, host_indices, pages: range, slots: list[int], to_slots: bool) -> None:
        ps, r = self.fmt.page_size, self.fmt.ranges_per_page
        idx = host_indices[pages.start * ps : pages.stop * ps]
        ptrs, sizes = self._ranges(idx, len(pages))
        memmove, base, slot_bytes = ctypes.memmove, self._base, self._slot_bytes
        for p, slot in enumerate(slots):
            at = base + slot * slot_bytes
            for j in range(p * r, p * r + r):
                if to_slots:
                    memmove(at, ptrs[j], sizes[j])
                else:
                    memmove(ptrs[j], at, sizes[j])
                at += sizes[j]

    # -- the generic (non zero-copy) calls hand flat page tensors --------
    def tensor_to_slot(self, value: torch.Tensor, slot: int) -> None:
        src = _bytes_of(value)
        if src.numel() != self.fmt.page_bytes:
            raise ValueError(f"a page has {self.fmt.page_bytes} bytes, got a value of {src.numel()}")
        self.staging.tensor[slot, : src.numel()].copy_(src)

    def slot_to_tensor(self, slot: int, target: torch.Tensor) -> torch.Tensor:
        dst = _bytes_of(target)
        if dst.numel() != self.fmt.page_bytes:
            raise ValueError(f"a page has {self.fmt.page_bytes} bytes, target holds {dst.numel()}")
        dst.copy_(self.staging.tensor[slot, : dst.numel()])
        return target


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("page tensors must be contiguous CPU tensors")
    return t.view(-1).view(torch.uint8)
