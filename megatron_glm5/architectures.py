"""One entry point for every registered checkpoint family, dispatched on ``config.json``'s ``model_type`` through
the registry (:mod:`megatron_glm5.families`):

* ``glm_moe_dsa`` (GLM-5 / 5.1 / 5.2) -> :class:`~megatron_glm5.glm5.config.GLM5Architecture`;
* ``glm5_next`` / ``glm5_next_text`` (GLM-5.3-Flash) -> :class:`~megatron_glm5.glm5_next.config.GLM5NextArchitecture`.
"""

from __future__ import annotations

from typing import Any, Union

from .families import MODEL_TYPES, family_of_architecture, parse_architecture
from .glm5.config import GLM5Architecture
from .glm5_next.config import GLM5NextArchitecture

Architecture = Union[GLM5Architecture, GLM5NextArchitecture]


def mcore_kwargs(arch: Architecture, policy=None) -> dict[str, Any]:
    """megatron-core config kwargs of any family (architecture + runtime policy)."""
    return family_of_architecture(arch).mcore_kwargs(arch, policy)


__all__ = ["Architecture", "MODEL_TYPES", "mcore_kwargs", "parse_architecture"]
