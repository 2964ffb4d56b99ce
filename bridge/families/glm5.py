"""GLM-5.x (``glm_moe_dsa``) on the bridge: the table of :mod:`bridge.mapping`, the expert layout only; every
Megatron layout (ours and megatron-core's Transformer Engine ones, :mod:`bridge.megatron_layout`)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from ..mapping import Expansion, account_hf_names, detect_expert_layout, expand as expand_table
from .base import HFLayout, cut_layers

name = "glm5"
megatron_layouts = ("local", "te", "te-fused-qk")


def detect_layout(arch: Any, hf_names: list[str]) -> HFLayout:
    return HFLayout(detect_expert_layout(hf_names))


def expand(arch: Any, layout: HFLayout, *, fp8_names: Iterable[str] = (),
           fp8_block: Sequence[int] = (128, 128)) -> Expansion:
    return expand_table(arch, expert_layout=layout.expert_layout, fp8_names=fp8_names, fp8_block=fp8_block)


def account(arch: Any, expansion: Expansion, hf_names: Iterable[str], *, source: str,
            layout: HFLayout) -> tuple[dict[str, str], tuple[str, ...]]:
    return account_hf_names(arch, expansion, hf_names, source=source), ()


def truncate_config(raw: Mapping, arch: Any, num_layers: int) -> dict:
    cfg = dict(raw)
    cfg.pop("index_topk_pattern", None)
    cfg.update(cut_layers(arch, num_layers))
    return cfg


def check_layout(arch: Any, tp: int, pp: int, ep: int, *, source: str) -> None:
    """Nothing beyond what every family checks (:func:`bridge.launch.check_parallel_layout`)."""


def needs_passthrough(arch: Any) -> bool:
    return False
