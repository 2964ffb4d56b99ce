"""Megatron-LM's ``--spec megatron_glm5.spec <fn>`` path (and slime / miles, and Python users): the GLM-5.x block
spec functions, kept at this import path. They live in :mod:`megatron_glm5.glm5.spec`.

* ``get_glm5_spec``: the ``megatron`` attention backend (also ``fn(args, config, vp_stage)`` for slime / miles);
* ``get_glm5_tilelang_spec``: the fused ``tilelang`` backend;
* ``get_glm5_warmup_spec`` / ``get_glm5_tilelang_warmup_spec``: the indexer warm-up stage on either backend.
"""

from .core.mla_spec import check_runtime_dependencies
from .glm5.spec import (
    BACKENDS,
    AttentionBackend,
    IndexerTraining,
    build_glm5_block_spec,
    build_glm5_mtp_spec,
    check_document_masking,
    check_glm5_numerics,
    check_indexer_training,
    get_backend,
    get_glm5_spec,
    get_glm5_tilelang_spec,
    get_glm5_tilelang_warmup_spec,
    get_glm5_warmup_spec,
    indexer_types_from_config,
    validate_stage_layers,
)

__all__ = [
    "AttentionBackend", "BACKENDS", "IndexerTraining", "build_glm5_block_spec", "build_glm5_mtp_spec",
    "check_document_masking", "check_glm5_numerics", "check_indexer_training", "check_runtime_dependencies",
    "get_backend", "get_glm5_spec", "get_glm5_tilelang_spec", "get_glm5_tilelang_warmup_spec", "get_glm5_warmup_spec",
    "indexer_types_from_config", "validate_stage_layers",
]
