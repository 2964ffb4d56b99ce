"""GLM-5.x as the registry sees it (:class:`megatron_glm5.families.FamilyModule`). Importing it loads only the
config parser (the command line checks a layout against ``config.json`` before megatron-core is imported); every
other function imports its module on first call."""

from __future__ import annotations

from typing import Any, Sequence

from .config import GLM5Architecture
from .config import parse_hf_config as parse_config

ARCHITECTURE = GLM5Architecture
PROVIDER_SETS_ARCHITECTURE = False  # every GLM-5.x field is a Megatron-LM argument


def decoder_layer() -> type:
    from .layer import GLMTransformerLayer

    return GLMTransformerLayer


def architecture_kwargs(arch: GLM5Architecture) -> dict[str, Any]:
    from .mcore_config import architecture_kwargs as kwargs

    return kwargs(arch)


def mcore_kwargs(arch: GLM5Architecture, policy=None) -> dict[str, Any]:
    from .mcore_config import mcore_kwargs as kwargs

    return kwargs(arch, policy)


def transformer_config(arch: GLM5Architecture, policy=None, **options: Any):
    from .mcore_config import build_transformer_config

    if options:
        raise TypeError(f"GLM-5.x models take no build options {sorted(options)}")
    return build_transformer_config(arch, policy)


def config_from_megatron_lm(config, arch: GLM5Architecture):
    """Megatron-LM's ``MLATransformerConfig`` already carries every GLM-5.x field (from the written arguments)."""
    return config


def config_only_fields() -> frozenset[str]:
    return frozenset()


def block_spec(config, arch: GLM5Architecture | None, *, backend: str = "megatron", vp_stage: int | None = None,
               indexer_types: Sequence[str] | None = None, activation_offload=None, indexer_warmup: bool = False):
    from .spec import build_glm5_block_spec

    types = indexer_types if indexer_types is not None else (arch.indexer_types if arch is not None else None)
    return build_glm5_block_spec(config, backend=backend, vp_stage=vp_stage, indexer_types=types,
                                 activation_offload=activation_offload, indexer_warmup=indexer_warmup)


def mtp_spec(config, arch: GLM5Architecture | None, *, backend: str = "megatron", activation_offload=None,
             indexer_types: Sequence[str] | None = None, indexer_warmup: bool = False):
    from .spec import build_glm5_mtp_spec

    types = indexer_types if indexer_types is not None else (arch.indexer_types if arch is not None else None)
    return build_glm5_mtp_spec(config, backend=backend, activation_offload=activation_offload, indexer_types=types,
                               indexer_warmup=indexer_warmup)


def gpt_model_kwargs(arch: GLM5Architecture) -> dict[str, Any]:
    from .mcore_config import gpt_model_kwargs as kwargs

    return kwargs(arch)
