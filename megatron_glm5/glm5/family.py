"""GLM-5.x as the registry sees it (:class:`megatron_glm5.families.FamilyEntry`): the config parser, imported with
the registry lookup (the command line checks a layout against ``config.json`` before megatron-core is imported),
and the model side (:mod:`.build`), imported on first use."""

from __future__ import annotations

from types import ModuleType

from .config import GLM5Architecture as ARCHITECTURE
from .config import parse_hf_config as parse_config


def build() -> ModuleType:
    from . import build as model_side

    return model_side


__all__ = ["ARCHITECTURE", "build", "parse_config"]
