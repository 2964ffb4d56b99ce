"""GLM-5.3-Flash (``glm5_next``) on the bridge: the table of :mod:`bridge.glm5_next_mapping`; the layout adds
transformers' naming (on-disk or in-memory) and the text model's prefix, and the vision tower is carried through.
Megatron checkpoints in our local layout only: no Transformer Engine build of GLM-5.3-Flash exists to match (its KDA,
mHC and KPool modules are megatron-glm5's)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from .. import glm5_next_mapping as nxt
from ..errors import BridgeError
from ..mapping import Expansion, detect_expert_layout
from .base import HFLayout, cut_layers

name = "glm5_next"
megatron_layouts = ("local",)


def detect_layout(arch: Any, hf_names: list[str]) -> HFLayout:
    return HFLayout(detect_expert_layout(hf_names), nxt.detect_naming(hf_names), nxt.detect_prefix(hf_names))


def expand(arch: Any, layout: HFLayout, *, fp8_names: Iterable[str] = (),
           fp8_block: Sequence[int] = (128, 128)) -> Expansion:
    return nxt.expand_glm5_next(arch, expert_layout=layout.expert_layout, naming=layout.naming,
                                hf_prefix=layout.prefix, fp8_names=fp8_names, fp8_block=fp8_block)


def account(arch: Any, expansion: Expansion, hf_names: Iterable[str], *, source: str,
            layout: HFLayout) -> tuple[dict[str, str], tuple[str, ...]]:
    return nxt.account_glm5_next(arch, expansion, hf_names, source=source, hf_prefix=layout.prefix)


def truncate_config(raw: Mapping, arch: Any, num_layers: int) -> dict:
    """The text config (nested or flat) cut; legacy IndexShare fields dropped (the cut lists are explicit)."""
    cut = cut_layers(arch, num_layers)
    cut["layer_types"] = list(arch.layer_types[:num_layers])
    cfg = dict(raw)
    text = dict(cfg["text_config"]) if isinstance(cfg.get("text_config"), Mapping) else cfg
    for legacy in ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset"):
        text.pop(legacy, None)
    text.update(cut)
    if text is not cfg:
        cfg["text_config"] = text
    return cfg


def check_layout(arch: Any, tp: int, pp: int, ep: int, *, source: str) -> None:
    """TP divides the KDA heads (the pipeline split is checked for every family:
    :func:`bridge.launch.pipeline_split`)."""
    if arch.kda_layers and arch.linear_num_heads % tp:
        raise BridgeError(f"{source}: --tp {tp} must divide linear_num_heads ({arch.linear_num_heads}): KDA heads are "
                          "split over TP ranks")


def needs_passthrough(arch: Any) -> bool:
    """The vision tower, which the Megatron model does not hold, must come from the source checkpoint."""
    return arch.vision_config is not None
