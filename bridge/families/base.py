"""What the bridge needs to know of a model family, as one interface (:class:`BridgeFamily`), and how a checkpoint
lays out its HF tensors (:class:`HFLayout`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence

from ..mapping import Expansion, ExpertLayout

DEFAULT_TEXT_PREFIX = "model.language_model."  # transformers' vision-language models (GLM-5.3-Flash)


@dataclass(frozen=True, slots=True)
class HFLayout:
    """How a checkpoint names its HF tensors: the expert layout (every family), and for a family with a naming
    choice and a text-model prefix (GLM-5.3-Flash) those. Detected from a source checkpoint's names, recorded in the
    Megatron checkpoint's bridge metadata and used again on export, so a round trip writes the names it read."""

    expert_layout: ExpertLayout = "per_expert"
    naming: str | None = None  # "disk" / "memory" (None: follows the expert layout)
    prefix: str = DEFAULT_TEXT_PREFIX

    def meta(self) -> dict[str, str | None]:
        return {"expert_layout": self.expert_layout, "hf_naming": self.naming, "hf_prefix": self.prefix}

    @classmethod
    def from_meta(cls, meta: Mapping, *, expert_layout: str | None = None) -> "HFLayout":
        """The layout a checkpoint recorded; ``expert_layout`` overrides it (and then the naming follows it unless
        recorded)."""
        layout = expert_layout or meta.get("expert_layout") or "per_expert"
        naming = meta.get("hf_naming") if expert_layout is None else None
        return cls(layout, naming, meta.get("hf_prefix") or DEFAULT_TEXT_PREFIX)


class BridgeFamily(Protocol):
    """One family on the bridge side (``bridge/families/<name>.py``; the name is the registry's)."""

    name: str
    megatron_layouts: tuple[str, ...]  # the Megatron layouts it reads and writes (bridge.megatron_layout.LAYOUTS)

    def detect_layout(self, arch: Any, hf_names: list[str]) -> HFLayout: ...

    def expand(self, arch: Any, layout: HFLayout, *, fp8_names: Iterable[str],
               fp8_block: Sequence[int]) -> Expansion: ...

    def account(self, arch: Any, expansion: Expansion, hf_names: Iterable[str], *, source: str,
                layout: HFLayout) -> tuple[dict[str, str], tuple[str, ...]]: ...

    def truncate_config(self, raw: Mapping, arch: Any, num_layers: int) -> dict: ...

    def check_layout(self, arch: Any, tp: int, pp: int, ep: int, *, source: str) -> None: ...

    def needs_passthrough(self, arch: Any) -> bool: ...


def cut_layers(arch: Any, num_layers: int) -> dict[str, Any]:
    """The per-layer fields of the first ``num_layers`` decoder layers, explicit, without MTP (both families)."""
    return dict(num_hidden_layers=num_layers, indexer_types=list(arch.indexer_types[:num_layers]),
                mlp_layer_types=list(arch.mlp_layer_types[:num_layers]), num_nextn_predict_layers=0)
