"""GLM-5.3-Flash as the registry sees it (:class:`megatron_glm5.families.FamilyEntry`): the config parser, imported
with the registry lookup, and the model side (:mod:`.build`), imported on first use."""

from __future__ import annotations

from types import ModuleType

from .config import GLM5NextArchitecture as ARCHITECTURE
from .config import parse_glm5_next_config as parse_config


def build() -> ModuleType:
    from . import build as model_side

    return model_side


__all__ = ["ARCHITECTURE", "build", "parse_config"]
