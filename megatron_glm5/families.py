"""The model families megatron-glm5 supports, in one table: everything a family-neutral feature needs to know.

A family is a kind of checkpoint (a set of ``config.json`` ``model_type`` values) with its own folder: GLM-5.x
(``glm_moe_dsa``) in :mod:`megatron_glm5.glm5`, GLM-5.3-Flash (``glm5_next``) in :mod:`megatron_glm5.glm5_next`.
Each folder's ``family`` module provides the same names (:class:`FamilyEntry`: the config parser, cheap to import;
:class:`FamilyBuild`: the model side, imported on first use); the model builder, the pretraining
entry point, RL, activation offload and the bridge reach a family only through its :class:`Family` row here, never
by testing for one family by name. A third family is one more folder plus one more row; a feature that meets a model
of no registered family, or a combination a family does not support (:attr:`Family.unsupported`), fails naming it.

The family modules are imported on first use, so this module stays cheap to import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType, ModuleType
from typing import Any, Callable, Mapping, Protocol

from .core.hf_config import GLM5ConfigError
from .glm5.config import SUPPORTED_MODEL_TYPES as _GLM5_MODEL_TYPES
from .glm5_next.config import SUPPORTED_MODEL_TYPES as _GLM5_NEXT_MODEL_TYPES


class UnknownFamilyError(ValueError):
    """A config, architecture or layer belongs to no registered family."""


class UnsupportedFeatureError(GLM5ConfigError, NotImplementedError):
    """A feature a family does not support (yet); the message names both and says why."""


class FamilyEntry(Protocol):
    """A family's ``megatron_glm5/<family>/family.py``: importing it loads no more than the config parser."""

    ARCHITECTURE: type  # the frozen parsed architecture

    def parse_config(self, raw: Mapping[str, Any]) -> Any: ...
    def build(self) -> "FamilyBuild": ...  # the model side, imported on first use


class FamilyBuild(Protocol):
    """A family's model side (``megatron_glm5/<family>/build.py``, imports megatron-core)."""

    DECODER_LAYER: type  # a subclass of megatron_glm5.core.layer.DSADecoderLayer
    # config_from_megatron_lm writes the whole architecture into the config, so an architecture field Megatron-LM
    # has no argument for is not an error (GLM-5.3-Flash); otherwise every field must be a Megatron-LM argument
    PROVIDER_SETS_ARCHITECTURE: bool

    def architecture_kwargs(self, arch: Any) -> dict[str, Any]: ...
    def mcore_kwargs(self, arch: Any, policy: Any = None) -> dict[str, Any]: ...
    def transformer_config(self, arch: Any, policy: Any = None, **options: Any) -> Any: ...
    def config_from_megatron_lm(self, config: Any, arch: Any, **options: Any) -> Any: ...
    def config_only_fields(self) -> frozenset[str]: ...
    def block_spec(self, config: Any, arch: Any, **kwargs: Any) -> Any: ...
    def mtp_spec(self, config: Any, arch: Any, **kwargs: Any) -> Any: ...
    def gpt_model_kwargs(self, arch: Any) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class Family:
    """One registered family (module docstring). ``unsupported`` maps a feature to why the family lacks it."""

    name: str
    title: str
    model_types: tuple[str, ...]
    load: Callable[[], ModuleType]
    unsupported: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def entry(self) -> FamilyEntry:
        return self.load()  # type: ignore[return-value]

    @property
    def build(self) -> FamilyBuild:
        return self.entry.build()

    def architecture(self) -> type:
        return self.entry.ARCHITECTURE

    def parse_config(self, raw: Mapping[str, Any]) -> Any:
        return self.entry.parse_config(raw)

    def decoder_layer(self) -> type:
        return self.build.DECODER_LAYER

    def architecture_kwargs(self, arch: Any) -> dict[str, Any]:
        """megatron-core config kwargs that describe the checkpoint (no runtime policy)."""
        return self.build.architecture_kwargs(arch)

    def mcore_kwargs(self, arch: Any, policy: Any = None) -> dict[str, Any]:
        return self.build.mcore_kwargs(arch, policy)

    def transformer_config(self, arch: Any, policy: Any = None, **options: Any) -> Any:
        """The family's megatron-core config built from ``arch`` and ``policy`` (``options``: the family's own build
        options, e.g. GLM-5.3-Flash's ``kda_kernel``)."""
        return self.build.transformer_config(arch, policy, **options)

    def config_from_megatron_lm(self, config: Any, arch: Any, **options: Any) -> Any:
        """Megatron-LM's ``MLATransformerConfig`` (built from its flags) as the family's config, with the
        architecture fields Megatron-LM has no flags for and the family's own build ``options``."""
        return self.build.config_from_megatron_lm(config, arch, **options)

    def config_only_fields(self) -> frozenset[str]:
        """Config fields with no Megatron-LM argument (they reach the model config in the model provider)."""
        return self.build.config_only_fields()

    @property
    def provider_sets_architecture(self) -> bool:
        return bool(self.build.PROVIDER_SETS_ARCHITECTURE)

    def block_spec(self, config: Any, arch: Any, **kwargs: Any) -> Any:
        """This stage's decoder block spec (``backend``, ``vp_stage``, ``indexer_types``, ``activation_offload``,
        ``indexer_warmup``)."""
        return self.build.block_spec(config, arch, **kwargs)

    def mtp_spec(self, config: Any, arch: Any, **kwargs: Any) -> Any:
        return self.build.mtp_spec(config, arch, **kwargs)

    def gpt_model_kwargs(self, arch: Any) -> dict[str, Any]:
        return self.build.gpt_model_kwargs(arch)

    def refuse(self, feature: str) -> None:
        """Raise :class:`UnsupportedFeatureError` if this family does not support ``feature``."""
        if feature in self.unsupported:
            raise UnsupportedFeatureError(f"{self.title} does not support {feature} yet: {self.unsupported[feature]}")

    def refuse_config(self, config: Any, *, indexer_warmup: bool = False) -> None:
        """Refuse, by name, every feature a megatron-core config (or a warm-up request) asks of this family that the
        family lacks (before anything is built)."""
        if getattr(config, "context_parallel_size", 1) > 1:
            self.refuse("context parallelism")
        if (getattr(config, "virtual_pipeline_model_parallel_size", None) or 1) > 1:
            self.refuse("virtual pipeline parallelism")
        if indexer_warmup:
            self.refuse("the indexer warm-up")
        if (getattr(config, "dsa_indexer_loss_coeff", None) or 0) > 0:
            self.refuse("the indexer loss")


def _glm5() -> ModuleType:
    from .glm5 import family

    return family


def _glm5_next() -> ModuleType:
    from .glm5_next import family

    return family


_FLASH_NO_INDEXER_LOSS = ("the KPool indexer's (pooled) KL loss is not implemented; train with "
                          "dsa_indexer_loss_coeff=0 (no --dsa-indexer-loss-coeff, no --dsa-indexer-warmup)")

FAMILIES: tuple[Family, ...] = (
    Family(name="glm5", title="GLM-5.x", model_types=_GLM5_MODEL_TYPES, load=_glm5),
    Family(name="glm5_next", title="GLM-5.3-Flash", model_types=_GLM5_NEXT_MODEL_TYPES, load=_glm5_next,
           unsupported=MappingProxyType({
               "context parallelism": "its KDA (linear attention) layers run whole sequences; use CP=1",
               "virtual pipeline parallelism": "its pipeline stages exchange the mHC streams (hc_mult x hidden_size "
                                               "wide), and megatron-core's interleaved schedule sends [s, b, "
                                               "hidden_size]; use pipeline parallelism without virtual stages",
               "the indexer loss": _FLASH_NO_INDEXER_LOSS,
               "the indexer warm-up": _FLASH_NO_INDEXER_LOSS,
           })),
)
_by_name = {f.name: f for f in FAMILIES}
assert len(_by_name) == len(FAMILIES), "duplicate family name"
_types = [t for f in FAMILIES for t in f.model_types]
assert len(_types) == len(set(_types)), "a model_type registered by two families"
MODEL_TYPES: tuple[str, ...] = tuple(_types)


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


def parse_architecture(raw: Mapping[str, Any]) -> Any:
    """Parse a raw ``config.json`` dict of any registered family; an unknown ``model_type`` is refused naming all."""
    if not isinstance(raw, Mapping):
        raise GLM5ConfigError(f"config: expected a JSON object, found {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in _types:
        raise GLM5ConfigError(f"config field 'model_type': expected one of {list(_types)}, found {model_type!r}")
    return family_of_model_type(model_type).parse_config(raw)

