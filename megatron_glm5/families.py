"""The model families megatron-glm5 supports, in one table: what a feature needs to know to serve each of them.

A family is a kind of checkpoint (a set of ``config.json`` ``model_type`` values) with its own parsed architecture
class and its own decoder-layer class. Everything family-neutral (RL replay, the parity harness, later the model
builder and the bridge) asks this table instead of testing for one family by name, so that a third family is one
more row here plus its own folder, and a feature that meets a model of no registered family fails naming it.

Registered now (phase 1 of issue 21, see ``docs/design/families.md``): GLM-5.x (``glm_moe_dsa``) and GLM-5.3-Flash
(``glm5_next``). Each row holds only what its users read today: the names, the ``model_type`` values, and the
architecture and decoder-layer classes (imported on first use, so this module stays cheap to import).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .config import SUPPORTED_MODEL_TYPES as _GLM5_MODEL_TYPES
from .glm5_next.config import SUPPORTED_MODEL_TYPES as _GLM5_NEXT_MODEL_TYPES


class UnknownFamilyError(ValueError):
    """A config, architecture or layer belongs to no registered family."""


@dataclass(frozen=True, slots=True)
class Family:
    """One registered family (module docstring). ``architecture`` / ``decoder_layer`` return the classes."""

    name: str
    title: str
    model_types: tuple[str, ...]
    architecture: Callable[[], type]
    decoder_layer: Callable[[], type]


def _glm5_architecture() -> type:
    from .config import GLM5Architecture

    return GLM5Architecture


def _glm5_layer() -> type:
    from .layer import GLMTransformerLayer

    return GLMTransformerLayer


def _glm5_next_architecture() -> type:
    from .glm5_next.config import GLM5NextArchitecture

    return GLM5NextArchitecture


def _glm5_next_layer() -> type:
    from .glm5_next.layer import GLM5NextTransformerLayer

    return GLM5NextTransformerLayer


FAMILIES: tuple[Family, ...] = (
    Family(name="glm5", title="GLM-5.x", model_types=tuple(_GLM5_MODEL_TYPES),
           architecture=_glm5_architecture, decoder_layer=_glm5_layer),
    Family(name="glm5_next", title="GLM-5.3-Flash", model_types=tuple(_GLM5_NEXT_MODEL_TYPES),
           architecture=_glm5_next_architecture, decoder_layer=_glm5_next_layer),
)
_by_name = {f.name: f for f in FAMILIES}
assert len(_by_name) == len(FAMILIES), "duplicate family name"
_types = [t for f in FAMILIES for t in f.model_types]
assert len(_types) == len(set(_types)), "a model_type registered by two families"


def family_named(name: str) -> Family:
    if name not in _by_name:
        raise UnknownFamilyError(f"family {name!r}: expected one of {sorted(_by_name)}")
    return _by_name[name]


def family_of_model_type(model_type: Any) -> Family:
    """The family of a ``config.json`` ``model_type``."""
    for f in FAMILIES:
        if model_type in f.model_types:
            return f
    raise UnknownFamilyError(f"model_type {model_type!r}: expected one of {_types}")


def family_of_architecture(arch: Any) -> Family:
    """The family of a parsed architecture (``parse_architecture``'s result)."""
    for f in FAMILIES:
        if isinstance(arch, f.architecture()):
            return f
    raise UnknownFamilyError(f"{type(arch).__name__} is the architecture of no registered family "
                             f"({[f.title for f in FAMILIES]})")


def family_of_layer(layer: Any) -> Family | None:
    """The family whose decoder-layer class ``layer`` is an instance of, or None."""
    for f in FAMILIES:
        if isinstance(layer, f.decoder_layer()):
            return f
    return None
