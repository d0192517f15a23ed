"""How KV pages are laid out, and which of them we may offload.

canonical.py  KV blocks that do not depend on tensor parallelism: per-layer
              page formats (LayerLayout), each TP rank's CanonicalPageMapping,
              the tiling check, and the namespace ids of a layout
models.py     refusal of model state the KV blocks do not capture (Mamba/SSM,
              indexer caches)
windows.py    which blocks and chunks a sliding-window group needs
"""

from kvoffload.layout.canonical import (
    LayerLayout,
    LayoutError,
    ParallelLayout,
    canonical_layout_id,
    check_layer,
    check_shareable,
    heads_of_rank,
    is_agnostic,
    layer_mapping,
    opaque_mapping,
    page_shape,
    parallel_layout_id,
    try_layer_mapping,
    verify_tiling,
)
from kvoffload.layout.models import (
    ATTENTION,
    MLA,
    UNSUPPORTED_KINDS,
    UnsupportedModelError,
    check_config_offloadable,
)
from kvoffload.layout.windows import window_block_indices, window_chunks, window_gpu_spec

__all__ = [
    "ATTENTION", "MLA", "UNSUPPORTED_KINDS", "LayerLayout", "LayoutError", "ParallelLayout",
    "UnsupportedModelError", "canonical_layout_id", "check_config_offloadable", "check_layer",
    "check_shareable", "heads_of_rank", "is_agnostic", "layer_mapping",
    "opaque_mapping", "page_shape", "parallel_layout_id", "try_layer_mapping", "verify_tiling",
    "window_block_indices", "window_chunks", "window_gpu_spec",
]
