"""One entry point for every supported checkpoint family, dispatched on ``config.json``'s ``model_type``:

* ``glm_moe_dsa`` (GLM-5 / 5.1 / 5.2): :func:`megatron_glm5.config.parse_hf_config` -> ``GLM5Architecture``;
* ``glm5_next`` / ``glm5_next_text`` (GLM-5.3-Flash): :func:`megatron_glm5.glm5_next.config.parse_glm5_next_config`
  -> ``GLM5NextArchitecture``.

Everything downstream (model building, megatron-core kwargs, the bridge's tables) dispatches on the architecture's
type; this module is where the type is chosen.
"""

from __future__ import annotations

from typing import Any, Mapping, Union

from .config import SUPPORTED_MODEL_TYPES as GLM5_MODEL_TYPES
from .config import GLM5Architecture, GLM5ConfigError, parse_hf_config
from .glm5_next.config import SUPPORTED_MODEL_TYPES as GLM5_NEXT_MODEL_TYPES
from .glm5_next.config import GLM5NextArchitecture, parse_glm5_next_config

Architecture = Union[GLM5Architecture, GLM5NextArchitecture]
MODEL_TYPES = (*GLM5_MODEL_TYPES, *GLM5_NEXT_MODEL_TYPES)


def parse_architecture(raw: Mapping[str, Any]) -> Architecture:
    """Parse a raw ``config.json`` dict of any supported family; an unknown ``model_type`` is refused naming all."""
    if not isinstance(raw, Mapping):
        raise GLM5ConfigError(f"config: expected a JSON object, found {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type in GLM5_NEXT_MODEL_TYPES:
        return parse_glm5_next_config(raw)
    if model_type in GLM5_MODEL_TYPES:
        return parse_hf_config(raw)
    raise GLM5ConfigError(f"config field 'model_type': expected one of {list(MODEL_TYPES)}, found {model_type!r}")


def is_glm5_next(arch) -> bool:
    return isinstance(arch, GLM5NextArchitecture)


def mcore_kwargs(arch: Architecture, policy=None) -> dict[str, Any]:
    """megatron-core config kwargs of either family (architecture + runtime policy)."""
    if is_glm5_next(arch):
        from .glm5_next.mcore_config import mcore_kwargs as next_kwargs

        return next_kwargs(arch, policy)
    from .config import mcore_kwargs as glm5_kwargs

    return glm5_kwargs(arch, policy)
