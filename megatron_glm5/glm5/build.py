"""GLM-5.x's model side as the registry sees it (:class:`megatron_glm5.families.FamilyBuild`)."""

from __future__ import annotations

from typing import Any

from .config import GLM5Architecture
from .layer import GLMTransformerLayer as DECODER_LAYER
from .mcore_config import architecture_kwargs, gpt_model_kwargs, mcore_kwargs
from .mcore_config import build_transformer_config as transformer_config  # no build options
from .spec import build_glm5_block_spec, build_glm5_mtp_spec

PROVIDER_SETS_ARCHITECTURE = False  # every GLM-5.x field is a Megatron-LM argument


def config_from_megatron_lm(config, arch: GLM5Architecture):
    """Megatron-LM's ``MLATransformerConfig`` already carries every GLM-5.x field (from the written arguments)."""
    return config


def config_only_fields() -> frozenset[str]:
    return frozenset()


def block_spec(config, arch: GLM5Architecture, **kwargs: Any):
    return build_glm5_block_spec(config, **kwargs)


def mtp_spec(config, arch: GLM5Architecture, **kwargs: Any):
    return build_glm5_mtp_spec(config, **kwargs)


__all__ = ["DECODER_LAYER", "PROVIDER_SETS_ARCHITECTURE", "architecture_kwargs", "block_spec",
           "config_from_megatron_lm", "config_only_fields", "gpt_model_kwargs", "mcore_kwargs", "mtp_spec",
           "transformer_config"]
