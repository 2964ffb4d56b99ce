"""Public import path kept for users (``from megatron_glm5.config import RuntimePolicy, parse_hf_config``): the
names live in :mod:`megatron_glm5.core` (runtime policy, HF config reading) and :mod:`megatron_glm5.glm5` (the
GLM-5.x architecture and its megatron-core fields). Code inside the package imports them from there."""

from .core.hf_config import INDEXER_K_NORM_EPS, GLM5ConfigError, load_hf_config, natural_key
from .core.policy import RuntimeEnvironment, RuntimePolicy, resolve_policy, runtime_kwargs
from .glm5.config import (
    SUPPORTED_MODEL_TYPES,
    GLM5Architecture,
    IndexerType,
    YarnParameters,
    parse_hf_config,
    resolve_indexer_types,
)
from .glm5.mcore_config import (
    architecture_kwargs,
    build_transformer_config,
    gpt_model_kwargs,
    indexer_share_schedule,
    mcore_kwargs,
)

__all__ = [
    "INDEXER_K_NORM_EPS", "GLM5Architecture", "GLM5ConfigError", "IndexerType", "RuntimeEnvironment",
    "RuntimePolicy", "SUPPORTED_MODEL_TYPES", "YarnParameters", "architecture_kwargs", "build_transformer_config",
    "gpt_model_kwargs", "indexer_share_schedule", "load_hf_config", "mcore_kwargs", "natural_key",
    "parse_hf_config", "resolve_indexer_types", "resolve_policy", "runtime_kwargs",
]
