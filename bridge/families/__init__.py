"""The bridge side of the family registry: one module per registered family (:mod:`megatron_glm5.families`), each
with the :class:`~.base.BridgeFamily` functions (mapping table, key accounting, HF layout, config truncation, layout
checks, pass-through). :func:`bridge_family` is the one place the bridge dispatches on a family; a new family is one
more module here and one more entry in :data:`BRIDGE_FAMILIES`. The parity references are
:data:`bridge.parity_reference.REFERENCES`, keyed the same way."""

from __future__ import annotations

from typing import Any

from megatron_glm5.families import family_of_architecture

from ..errors import BridgeError
from . import glm5, glm5_next
from .base import BridgeFamily, HFLayout

BRIDGE_FAMILIES: dict[str, BridgeFamily] = {m.name: m for m in (glm5, glm5_next)}  # type: ignore[misc]


def bridge_family(arch: Any) -> BridgeFamily:
    """The bridge functions of ``arch``'s family."""
    family = family_of_architecture(arch)
    if family.name not in BRIDGE_FAMILIES:
        raise BridgeError(f"the bridge has no mapping for {family.title} (bridge.families.BRIDGE_FAMILIES)")
    return BRIDGE_FAMILIES[family.name]


__all__ = ["BRIDGE_FAMILIES", "BridgeFamily", "HFLayout", "bridge_family"]
