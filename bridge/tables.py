"""Which mapping table a checkpoint uses, and how its HF tensors are laid out: the one place the bridge dispatches
on the model family (:func:`megatron_glm5.architectures.parse_architecture`).

* GLM-5.x (``glm_moe_dsa``): :mod:`bridge.mapping`; the layout is the expert layout only.
* GLM-5.3-Flash (``glm5_next``): :mod:`bridge.glm5_next_mapping`; the layout adds transformers' naming (on-disk or
  in-memory) and the text model's prefix, and the vision tower is carried through (``passthrough``).

An :class:`HFLayout` is detected from a source checkpoint's names, recorded in the Megatron checkpoint's bridge
metadata and used again on export, so a round trip writes the names it read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from megatron_glm5.architectures import is_glm5_next

from . import glm5_next_mapping as nxt
from .errors import BridgeError
from .mapping import Expansion, ExpertLayout, account_hf_names, detect_expert_layout, expand


@dataclass(frozen=True, slots=True)
class HFLayout:
    """How a checkpoint names its HF tensors: expert layout (both families), naming and text prefix (GLM-5.3-Flash)."""

    expert_layout: ExpertLayout = "per_expert"
    naming: str | None = None  # GLM-5.3-Flash: "disk" / "memory" (None: follows the expert layout)
    prefix: str = nxt.DEFAULT_PREFIX  # GLM-5.3-Flash text model prefix

    def meta(self) -> dict[str, str | None]:
        return {"expert_layout": self.expert_layout, "hf_naming": self.naming, "hf_prefix": self.prefix}

    @classmethod
    def from_meta(cls, meta: Mapping, *, expert_layout: str | None = None) -> "HFLayout":
        """The layout a checkpoint recorded; ``expert_layout`` overrides it (and then the naming follows it unless
        recorded)."""
        layout = expert_layout or meta.get("expert_layout") or "per_expert"
        naming = meta.get("hf_naming") if expert_layout is None else None
        return cls(layout, naming, meta.get("hf_prefix") or nxt.DEFAULT_PREFIX)


def detect_layout(arch, hf_names: Iterable[str]) -> HFLayout:
    names = list(hf_names)
    layout = detect_expert_layout(names)
    if not is_glm5_next(arch):
        return HFLayout(layout)
    return HFLayout(layout, nxt.detect_naming(names), nxt.detect_prefix(names))


def expand_for(arch, layout: HFLayout = HFLayout(), *, fp8_names: Iterable[str] = (),
               fp8_block: Sequence[int] = (128, 128)) -> Expansion:
    """The concrete table for ``arch`` in ``layout``."""
    if is_glm5_next(arch):
        return nxt.expand_glm5_next(arch, expert_layout=layout.expert_layout, naming=layout.naming,
                                    hf_prefix=layout.prefix, fp8_names=fp8_names, fp8_block=fp8_block)
    return expand(arch, expert_layout=layout.expert_layout, fp8_names=fp8_names, fp8_block=fp8_block)


def account_for(arch, expansion: Expansion, hf_names: Iterable[str], *, source: str,
                layout: HFLayout = HFLayout()) -> tuple[dict[str, str], tuple[str, ...]]:
    """Exact key accounting: ``({ignored name: reason}, passthrough names)``; raises naming the differences."""
    if is_glm5_next(arch):
        return nxt.account_glm5_next(arch, expansion, hf_names, source=source, hf_prefix=layout.prefix)
    return account_hf_names(arch, expansion, hf_names, source=source), ()


def truncate_config(raw: Mapping, num_layers: int) -> dict:
    """``config.json`` of the first ``num_layers`` decoder layers without MTP (per-layer lists cut and explicit).
    The caller has checked ``num_layers``."""
    from megatron_glm5.architectures import parse_architecture

    arch = parse_architecture(raw)
    cut = dict(num_hidden_layers=num_layers, indexer_types=list(arch.indexer_types[:num_layers]),
               mlp_layer_types=list(arch.mlp_layer_types[:num_layers]), num_nextn_predict_layers=0)
    if not is_glm5_next(arch):
        cfg = dict(raw)
        cfg.pop("index_topk_pattern", None)
        cfg.update(cut)
        return cfg
    cut["layer_types"] = list(arch.layer_types[:num_layers])
    cfg = dict(raw)
    text = dict(cfg["text_config"]) if isinstance(cfg.get("text_config"), Mapping) else cfg
    for legacy in ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset"):
        text.pop(legacy, None)
    text.update(cut)
    if text is not cfg:
        cfg["text_config"] = text
    return cfg


def check_glm5_next_layout(arch, tp: int, pp: int, ep: int, *, source: str) -> None:
    """GLM-5.3-Flash constraints beyond GLM-5's: TP divides the KDA heads; no pipeline parallelism yet (the mHC
    streams would cross stage boundaries at ``hc_mult`` times the width megatron-core's schedules send)."""
    problems = []
    if arch.kda_layers and arch.linear_num_heads % tp:
        problems.append(f"--tp {tp} must divide linear_num_heads ({arch.linear_num_heads}): KDA heads are split "
                        "over TP ranks")
    if pp > 1:
        problems.append(f"--pp {pp}: pipeline parallelism is not supported for GLM-5.3-Flash yet (its mHC streams "
                        "would cross stage boundaries); the checkpoint is reshardable, convert with --pp 1")
    if problems:
        raise BridgeError(f"{source}: " + "; ".join(problems))
