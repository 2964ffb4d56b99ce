"""GLM-5.3-Flash as the registry sees it (:class:`megatron_glm5.families.FamilyModule`). The model is megatron-core's
GPTModel with this folder's block spec (KDA / NoPE-DSA mixers and dense / MoE MLPs in mHC streams, final norm over
the streams' mean) and MTP spec (plain NoPE-DSA + MoE layers). Position embeddings: none (NoPE everywhere;
megatron-core's MLA builds a width-0 rotary embedding of its own, a no-op). Importing it loads only the config
parser; every other function imports its module on first call."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from .config import GLM5NextArchitecture
from .config import parse_glm5_next_config as parse_config

ARCHITECTURE = GLM5NextArchitecture
PROVIDER_SETS_ARCHITECTURE = True  # KPool, KDA and mHC fields have no Megatron-LM argument


def decoder_layer() -> type:
    from .layer import GLM5NextTransformerLayer

    return GLM5NextTransformerLayer


def architecture_kwargs(arch: GLM5NextArchitecture) -> dict[str, Any]:
    from .mcore_config import architecture_kwargs as kwargs

    return kwargs(arch)


def mcore_kwargs(arch: GLM5NextArchitecture, policy=None) -> dict[str, Any]:
    from .mcore_config import mcore_kwargs as kwargs

    return kwargs(arch, policy)


def transformer_config(arch: GLM5NextArchitecture, policy=None, *, kda_kernel: str = "auto"):
    """``kda_kernel`` picks the KDA recurrence kernel (``"auto"``, ``"torch"``, ``"fla"``)."""
    from .mcore_config import build_transformer_config

    return build_transformer_config(arch, policy, kda_kernel=kda_kernel)


def config_only_fields() -> frozenset[str]:
    """KPool, KDA and mHC fields: Megatron-LM has no arguments for them."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from .mcore_config import GLM5NextTransformerConfig

    base = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    return frozenset(f.name for f in dataclasses.fields(GLM5NextTransformerConfig)) - base


def config_from_megatron_lm(config, arch: GLM5NextArchitecture):
    """Megatron-LM's ``MLATransformerConfig`` (parallelism, precision, recompute, ...) as a
    ``GLM5NextTransformerConfig`` with the whole GLM-5.3-Flash architecture (KPool, KDA, mHC included)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from .mcore_config import GLM5NextTransformerConfig
    from .mcore_config import architecture_kwargs as kwargs

    kw = {f.name: getattr(config, f.name) for f in dataclasses.fields(MLATransformerConfig) if f.init}
    kw.update(kwargs(arch))
    return GLM5NextTransformerConfig(**kw)


def block_spec(config, arch: GLM5NextArchitecture, *, backend: str = "megatron", vp_stage: int | None = None,
               indexer_types: Sequence[str] | None = None, activation_offload=None, indexer_warmup: bool = False):
    from .spec import build_glm5_next_block_spec

    types = tuple(indexer_types) if indexer_types is not None else arch.indexer_types
    return build_glm5_next_block_spec(config, layer_types=arch.layer_types, indexer_types=types, backend=backend,
                                      vp_stage=vp_stage, activation_offload=activation_offload)


def mtp_spec(config, arch: GLM5NextArchitecture, *, backend: str = "megatron", activation_offload=None,
             indexer_types: Sequence[str] | None = None, indexer_warmup: bool = False):
    from .spec import build_glm5_next_mtp_spec

    return build_glm5_next_mtp_spec(config, backend=backend, activation_offload=activation_offload)


def gpt_model_kwargs(arch: GLM5NextArchitecture) -> dict[str, Any]:
    """Kwargs for megatron-core ``GPTModel`` that come from the checkpoint."""
    return dict(
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="none",
    )
