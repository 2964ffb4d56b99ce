"""Per-layer patterns, one rule each, for every family: which layers run their own DSA indexer (IndexShare) and
which layers are MoE layers, read from an HF config's fields or from megatron-core's config."""

from __future__ import annotations

from typing import Any, Sequence

IndexerType = str  # "full" | "shared"
MlpType = str  # "dense" | "sparse"


def indexshare_types(num_layers: int, freq: int, offset: int) -> tuple[IndexerType, ...]:
    """HF's IndexShare rule (transformers' ``index_topk_freq`` / ``index_skip_topk_offset``): 0-indexed layer ``i``
    is "full" iff ``max(i - offset + 1, 0) % freq == 0``, else "shared" (it reuses the previous full layer's top-k).
    megatron-core's ``dsa_indexer_topk_freq`` / ``dsa_indexer_skip_topk_offset`` is the same rule on 1-indexed
    layers with the offset raised to at least 1 (:func:`indexer_types_from_mcore`)."""
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


def indexer_types_from_mcore(config: Any) -> tuple[IndexerType, ...]:
    """The per-layer pattern megatron-core's config describes (Megatron-LM's ``--dsa-indexer-topk-freq`` /
    ``--dsa-indexer-skip-topk-offset``)."""
    freq = getattr(config, "dsa_indexer_topk_freq", 1) or 1
    offset = max(getattr(config, "dsa_indexer_skip_topk_offset", 0) or 0, 1)
    return indexshare_types(config.num_layers, freq, offset)


def indexshare_schedule(indexer_types: Sequence[IndexerType]) -> tuple[int, int] | None:
    """``(freq, offset)`` in megatron-core's convention when the pattern is expressible that way, else None."""
    n = len(indexer_types)
    types = tuple(indexer_types)
    if all(t == "full" for t in types):
        return 1, 0
    for freq in range(2, n + 1):
        for offset in range(0, n + 1):
            if indexshare_types(n, freq, max(offset, 1)) == types:
                return freq, offset
    return None


def moe_pattern(num_layers: int, first_k_dense: int, freq: int) -> tuple[MlpType, ...]:
    """HF's rule (``first_k_dense_replace`` / ``moe_layer_freq``): layer ``i`` is "sparse" (MoE) iff
    ``i >= first_k_dense`` and ``(i - first_k_dense) % freq == 0``, else "dense"."""
    return tuple("sparse" if i >= first_k_dense and (i - first_k_dense) % freq == 0 else "dense"
                 for i in range(num_layers))


def mlp_types_from_mcore(config: Any) -> tuple[MlpType, ...]:
    """Per decoder layer "dense" / "sparse" from megatron-core's ``moe_layer_freq`` (an int: every freq-th layer;
    a list: a 0/1 flag per layer); all dense without experts."""
    if not config.num_moe_experts:
        return ("dense",) * config.num_layers
    freq = config.moe_layer_freq
    flags = [i % freq == 0 for i in range(config.num_layers)] if isinstance(freq, int) else [bool(f) for f in freq]
    return tuple("sparse" if f else "dense" for f in flags)


def moe_layer_flags(mlp_types: Sequence[MlpType]) -> list[int]:
    """megatron-core's ``moe_layer_freq`` list for a per-layer pattern."""
    return [1 if t == "sparse" else 0 for t in mlp_types]
