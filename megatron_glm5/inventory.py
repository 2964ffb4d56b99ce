"""The decoder layers of a built model, family-neutral: what features that reach into single layers (RL replay and
capture today; activation offload next) may touch on this rank.

Every decoder layer (``decoder.layers.<i>``) and MTP layer (``mtp.layers.<k>.mtp_model_layer``) of a model must be
an instance of a registered family's decoder-layer class (:mod:`megatron_glm5.families`): a layer of any other type
raises :class:`UnknownLayerError` naming it, so a feature never skips layers it does not know. Per layer the
inventory reads, from the layer's own modules (never re-derived from the config):

* the mixer: a DSA attention (it has ``computes_topk``; "full" layers run an indexer, "shared" ones reuse an
  earlier full layer's top-k) or another one (GLM-5.3-Flash's KDA), and a DSA layer's top-k width (the core
  attention's ``topk_width``: ``index_topk`` for GLM-5.x, ``index_topk + P - 1`` with GLM-5.3-Flash's KPool tail);
* the MoE router (``mlp.router``), if the layer is an MoE layer.

Keys: decoder layer ``i`` (0-based, global) is ``i``; MTP layer ``k`` is ``num_layers + k``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .families import family_of_layer

_DECODER_RE = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)$")
_MTP_RE = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.mtp_model_layer$")


class UnknownLayerError(TypeError):
    """A decoder or MTP layer of the model is of no registered family's layer class."""


@dataclass(frozen=True, slots=True)
class LayerEntry:
    """One decoder / MTP layer of this rank (module docstring)."""

    key: int
    name: str  # the module's qualified name in the model
    layer: torch.nn.Module
    family: str
    is_dsa: bool
    computes_topk: bool  # a "full" DSA layer (runs its indexer)
    topk_width: int | None  # columns of a DSA layer's top-k rows; None for other mixers
    router: torch.nn.Module | None  # megatron-core TopKRouter of an MoE layer

    @property
    def core_attention(self) -> torch.nn.Module | None:
        """The DSA core attention (holds ``compute_topk`` / ``check_topk``), or None."""
        return self.layer.self_attention.core_attention if self.is_dsa else None


@dataclass(frozen=True)
class LayerInventory:
    """The layers of a built GPTModel on this rank (this pipeline stage), sorted by key."""

    config: Any
    entries: tuple[LayerEntry, ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> "LayerInventory":
        config = model_config(model)
        entries = []
        for name, mod in model.named_modules():
            m_dec, m_mtp = _DECODER_RE.search(name), _MTP_RE.search(name)
            if m_dec is None and m_mtp is None:
                continue
            family = family_of_layer(mod)
            if family is None:
                raise UnknownLayerError(
                    f"{name} is a {type(mod).__module__}.{type(mod).__qualname__}, which no registered model family "
                    "builds (megatron_glm5.families): features that act per layer (RL replay, capture) cannot "
                    "reach it"
                )
            key = config.num_layers + int(m_mtp.group(1)) if m_mtp else mod.layer_number - 1
            attention = mod.self_attention
            is_dsa = hasattr(attention, "computes_topk")
            entries.append(LayerEntry(
                key=key, name=name, layer=mod, family=family.name, is_dsa=is_dsa,
                computes_topk=bool(is_dsa and attention.computes_topk),
                topk_width=int(attention.core_attention.topk_width) if is_dsa else None,
                router=getattr(mod.mlp, "router", None),
            ))
        keys = [e.key for e in entries]
        if len(keys) != len(set(keys)):
            raise UnknownLayerError(f"two layers share a layer key: {sorted(keys)}")
        return cls(config=config, entries=tuple(sorted(entries, key=lambda e: e.key)))

    def __iter__(self) -> Iterator[LayerEntry]:
        return iter(self.entries)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def mtp_layers(self) -> int:
        return self.config.mtp_num_layers or 0

    @property
    def full(self) -> dict[int, LayerEntry]:
        """Full (indexer) DSA layers."""
        return {e.key: e for e in self.entries if e.computes_topk}

    @property
    def shared_sources(self) -> dict[int, int]:
        """Shared DSA layer -> the nearest earlier full layer on this rank (-1: none here)."""
        full = [e.key for e in self.entries if e.computes_topk]
        return {e.key: max((f for f in full if f < e.key), default=-1)
                for e in self.entries if e.is_dsa and not e.computes_topk}

    @property
    def routers(self) -> dict[int, torch.nn.Module]:
        return {e.key: e.router for e in self.entries if e.router is not None}

    def topk_width(self) -> int | None:
        """The top-k width shared by this rank's full DSA layers (None without any); layers that disagree raise."""
        widths = {e.topk_width for e in self.entries if e.computes_topk}
        if len(widths) > 1:
            raise UnknownLayerError(f"full DSA layers with different top-k widths {sorted(widths)}: one payload "
                                    "width cannot serve them")
        return widths.pop() if widths else None

    def moe_layers(self) -> tuple[int, ...]:
        """Global decoder MoE layers (every pipeline stage), from megatron-core's ``moe_layer_freq``."""
        return moe_layer_pattern(self.config)


def moe_layer_pattern(config) -> tuple[int, ...]:
    """Decoder layers that are MoE layers, from megatron-core's ``moe_layer_freq`` (an int: every freq-th layer;
    a list: a 0/1 flag per layer); none without experts."""
    if not config.num_moe_experts:
        return ()
    freq = config.moe_layer_freq
    pattern = [1 if i % freq == 0 else 0 for i in range(config.num_layers)] if isinstance(freq, int) else list(freq)
    return tuple(i for i, f in enumerate(pattern) if f)


def model_config(model: torch.nn.Module):
    """The megatron-core config of a built model (the first module carrying one with ``num_layers``)."""
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and hasattr(cfg, "num_layers"):
            return cfg
    raise TypeError(f"{type(model).__name__} has no megatron-core config")
