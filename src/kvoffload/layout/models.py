"""Which models we may offload: refusal of state the KV blocks do not capture.

Mamba/SSM and linear-attention layers keep a recurrent state, and
sparse-attention indexer caches are not restored by the KV blocks:
serving them from offloaded blocks would give wrong results, so such a
model is refused (UnsupportedModelError, a ConfigError) by KV group kind
(check_config_offloadable, what the spec and the worker call) or by layer
(canonical.check_layer, through refuse_unsupported here).
"""

from __future__ import annotations

from kvoffload.config import ConfigError, OffloadingConfig

ATTENTION = "attention"  # K and V per head
MLA = "mla"  # one compressed latent per token, identical on every rank
UNSUPPORTED_KINDS = {
    "mamba": "Mamba/SSM layers keep a recurrent state, not per-token KV blocks",
    "ssm": "Mamba/SSM layers keep a recurrent state, not per-token KV blocks",
    "linear_attention": "linear-attention layers keep a recurrent state, not per-token KV blocks",
    "indexer": "sparse-attention indexer caches are not restored by the KV blocks",
}


class UnsupportedModelError(ConfigError):
    """The model has state we cannot offload correctly; offloading is refused."""


def refuse_unsupported(kind: str, where: str) -> None:
    """Raise UnsupportedModelError if `kind` is state we must not offload."""
    if kind in UNSUPPORTED_KINDS:
        raise UnsupportedModelError(
            f"{where} has kind {kind!r}: {UNSUPPORTED_KINDS[kind]}; KV offloading "
            "would serve wrong state, so it is refused for this model")


def check_config_offloadable(config: OffloadingConfig) -> None:
    """Refuse (UnsupportedModelError) a config whose KV groups hold state we
    cannot offload; ConfigError for a kind we do not know."""
    for i, g in enumerate(config.groups):
        names = ", ".join(g.layer_names[:3]) + (", ..." if len(g.layer_names) > 3 else "")
        where = f"groups[{i}]" + (f" (layers {names})" if names else "")
        refuse_unsupported(g.kind, where)
        if g.kind not in (ATTENTION, MLA):
            raise ConfigError(f"{where}: unknown kind {g.kind!r}; known kinds: "
                              f"{sorted([ATTENTION, MLA, *UNSUPPORTED_KINDS])}")
