"""Pipeline stages, for every family: the decoder layers this rank builds, and the IndexShare rule on stage
boundaries (a stage starts without a top-k, so its first DSA layer must run its own indexer).

The layers that are not DSA layers (GLM-5.3-Flash's KDA layers) pass the top-k through unchanged, so the source of
a "shared" layer is the nearest earlier "full" DSA layer, wherever non-DSA layers stand between them.
"""

from __future__ import annotations

from typing import Any, Sequence

from .hf_config import GLM5ConfigError


def local_layer_ids(config: Any, vp_stage: int | None, pp_rank: int | None = None) -> list[int]:
    """Global (0-indexed) decoder layers of this pipeline rank / virtual stage (megatron-core's split)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if pp_rank is None:
        pp_rank = ps.get_pipeline_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        from megatron.core.transformer.enums import LayerType

        return list(layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)))


def topk_sources(indexer_types: Sequence[str], is_dsa: Sequence[bool] | None = None) -> tuple[int | None, ...]:
    """Per layer: the DSA layer whose top-k it attends with (itself when "full", the nearest earlier full DSA layer
    when "shared"), None for a non-DSA layer. ``is_dsa`` defaults to every layer. A shared layer with no full DSA
    layer before it raises, naming ``indexer_types[i]``."""
    is_dsa = [True] * len(indexer_types) if is_dsa is None else list(is_dsa)
    if len(is_dsa) != len(indexer_types):
        raise GLM5ConfigError(f"layer_types ({len(is_dsa)} entries) and indexer_types ({len(indexer_types)}) "
                              "differ in length")
    sources: list[int | None] = []
    last_full = None
    for i, (dsa, it) in enumerate(zip(is_dsa, indexer_types)):
        if it not in ("full", "shared"):
            raise ValueError(f"indexer_types[{i}]: expected one of ['full', 'shared'], got {it!r}")
        if not dsa:
            sources.append(None)
        elif it == "full":
            last_full = i
            sources.append(i)
        elif last_full is None:
            raise GLM5ConfigError(
                f"indexer_types[{i}]: DSA layer {i} is 'shared' but no 'full' DSA layer comes before it to take the "
                "top-k from; expected 'full'"
            )
        else:
            sources.append(last_full)
    return tuple(sources)


def valid_stage_starts(indexer_types: Sequence[str], is_dsa: Sequence[bool] | None = None) -> tuple[int, ...]:
    """The layers a pipeline stage (or virtual chunk) may start on, whatever its end: those whose first DSA layer
    from there on is "full" (or that have no DSA layer after them). With every layer DSA (GLM-5.x) these are the full
    layers; a non-DSA layer (GLM-5.3-Flash's KDA) is a valid start when the next DSA layer is full."""
    sources = topk_sources(indexer_types, is_dsa)
    starts, next_dsa_full = [], True
    for i in reversed(range(len(sources))):
        if sources[i] is not None:
            next_dsa_full = sources[i] == i
        if next_dsa_full:
            starts.append(i)
    return tuple(reversed(starts))


def validate_stage_layers(indexer_types: Sequence[str], local_layer_ids: Sequence[int], *,
                          is_dsa: Sequence[bool] | None = None, stages: int = 1) -> None:
    """The first DSA layer of a pipeline stage (or virtual chunk) must be "full": a stage starts without a top-k
    (none crosses a stage boundary). ``stages`` (pipeline x virtual stages), when more than one, adds a valid split
    to the error."""
    sources = topk_sources(indexer_types, is_dsa)
    first = next((i for i in local_layer_ids if sources[i] is not None), None)
    if first is None or sources[first] == first:
        return
    full = [j for j, s in enumerate(sources) if s == j]
    where = "a stage starts on" if first == local_layer_ids[0] else "the first DSA layer of a stage is"
    raise GLM5ConfigError(
        f"pipeline split is invalid for IndexShare: {where} decoder layer {first} (0-indexed), a 'shared' layer "
        f"that reuses the top-k of layer {sources[first]} on an earlier stage. Every stage's first DSA layer must "
        f"be 'full'; full DSA layers are {full}." + (
            _valid_split_suggestion(valid_stage_starts(indexer_types, is_dsa), len(sources), stages)
            if stages > 1 else "")
    )


def _valid_split_suggestion(starts_ok: Sequence[int], n: int, stages: int) -> str:
    """Stage sizes close to even whose every stage starts on a valid start (:func:`valid_stage_starts`; greedy on
    their positions)."""
    starts = [0]
    for s in range(1, stages):
        ideal = round(s * n / stages)
        candidates = [i for i in starts_ok if i > starts[-1]]
        if not candidates:
            return ""
        starts.append(min(candidates, key=lambda i: (abs(i - ideal), i)))
    sizes = [b - a for a, b in zip(starts, starts[1:] + [n])]
    if any(sz <= 0 for sz in sizes):
        return ""
    return f" A valid split: stage sizes {sizes} (e.g. --decoder-first-pipeline-num-layers {sizes[0]} " \
           f"--decoder-last-pipeline-num-layers {sizes[-1]} when the middle stages are even)."


def pipeline_stages(config: Any) -> int:
    """Pipeline stages times virtual stages of a megatron-core config."""
    return config.pipeline_model_parallel_size * (config.virtual_pipeline_model_parallel_size or 1)
