"""GLM-5.3-Flash's model side as the registry sees it (:class:`megatron_glm5.families.FamilyBuild`): megatron-core's
GPTModel with this folder's block spec (KDA / NoPE-DSA mixers and dense / MoE MLPs in mHC streams, final norm over
the streams' mean) and MTP spec (plain NoPE-DSA + MoE layers), no position embedding (NoPE everywhere)."""

from __future__ import annotations

from typing import Any

from .config import GLM5NextArchitecture
from .layer import GLM5NextTransformerLayer as DECODER_LAYER
from .mcore_config import (
    architecture_kwargs,
    config_from_megatron_lm,
    config_only_fields,
    gpt_model_kwargs,
    mcore_kwargs,
)
from .mcore_config import build_transformer_config as transformer_config  # build option: kda_kernel
from .spec import build_glm5_next_block_spec, build_glm5_next_mtp_spec

PROVIDER_SETS_ARCHITECTURE = True  # KPool, KDA and mHC fields have no Megatron-LM argument


def block_spec(config, arch: GLM5NextArchitecture, *, indexer_warmup: bool = False, **kwargs: Any):
    """``indexer_warmup`` is refused before this is reached (``Family.unsupported``)."""
    return build_glm5_next_block_spec(config, layer_types=arch.layer_types, **kwargs)


def mtp_spec(config, arch: GLM5NextArchitecture, *, indexer_types=None, indexer_warmup: bool = False, **kwargs: Any):
    """Every MTP layer owns a full indexer: the decoder's IndexShare pattern does not reach it."""
    return build_glm5_next_mtp_spec(config, **kwargs)


__all__ = ["DECODER_LAYER", "PROVIDER_SETS_ARCHITECTURE", "architecture_kwargs", "block_spec",
           "config_from_megatron_lm", "config_only_fields", "gpt_model_kwargs", "mcore_kwargs", "mtp_spec",
           "transformer_config"]
