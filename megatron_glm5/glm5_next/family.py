"""GLM-5.3-Flash as the registry sees it (:class:`megatron_glm5.families.FamilyModule`). The model is megatron-core's
GPTModel with this folder's block spec (KDA / NoPE-DSA mixers and dense / MoE MLPs in mHC streams, final norm over
the streams' mean) and MTP spec (plain NoPE-DSA + MoE layers). Position embeddings: none (NoPE everywhere;
megatron-core's MLA builds a width-0 rotary embedding of its own, a no-op)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from .config import GLM5NextArchitecture
from .config import parse_glm5_next_config as parse_config
from .layer import GLM5NextTransformerLayer
from .mcore_config import GLM5NextTransformerConfig, architecture_kwargs, build_transformer_config, mcore_kwargs
from .spec import build_glm5_next_block_spec, build_glm5_next_mtp_spec

ARCHITECTURE = GLM5NextArchitecture
DECODER_LAYER = GLM5NextTransformerLayer
PROVIDER_SETS_ARCHITECTURE = True


def transformer_config(arch: GLM5NextArchitecture, policy=None, *, kda_kernel: str = "auto"):
    """``kda_kernel`` picks the KDA recurrence kernel (``"auto"``, ``"torch"``, ``"fla"``)."""
    return build_transformer_config(arch, policy, kda_kernel=kda_kernel)


def config_only_fields() -> frozenset[str]:
    """KPool, KDA and mHC fields: Megatron-LM has no arguments for them."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    base = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    return frozenset(f.name for f in dataclasses.fields(GLM5NextTransformerConfig)) - base


def config_from_megatron_lm(config, arch: GLM5NextArchitecture) -> GLM5NextTransformerConfig:
    """Megatron-LM's ``MLATransformerConfig`` (parallelism, precision, recompute, ...) as a
    ``GLM5NextTransformerConfig`` with the whole GLM-5.3-Flash architecture (KPool, KDA, mHC included)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kw = {f.name: getattr(config, f.name) for f in dataclasses.fields(MLATransformerConfig) if f.init}
    kw.update(architecture_kwargs(arch))
    return GLM5NextTransformerConfig(**kw)


def block_spec(config, arch: GLM5NextArchitecture, *, backend: str = "megatron", vp_stage: int | None = None,
               indexer_types: Sequence[str] | None = None, activation_offload=None, indexer_warmup: bool = False):
    types = tuple(indexer_types) if indexer_types is not None else arch.indexer_types
    return build_glm5_next_block_spec(config, layer_types=arch.layer_types, indexer_types=types, backend=backend,
                                      vp_stage=vp_stage, activation_offload=activation_offload)


def mtp_spec(config, arch: GLM5NextArchitecture, *, backend: str = "megatron", activation_offload=None,
             indexer_types: Sequence[str] | None = None, indexer_warmup: bool = False):
    return build_glm5_next_mtp_spec(config, backend=backend, activation_offload=activation_offload)


def gpt_model_kwargs(arch: GLM5NextArchitecture) -> dict[str, Any]:
    """Kwargs for megatron-core ``GPTModel`` that come from the checkpoint."""
    return dict(
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="none",
    )


__all__ = ["ARCHITECTURE", "DECODER_LAYER", "PROVIDER_SETS_ARCHITECTURE", "architecture_kwargs", "block_spec", "config_from_megatron_lm",
           "config_only_fields", "gpt_model_kwargs", "mcore_kwargs", "mtp_spec", "parse_config",
           "transformer_config"]
