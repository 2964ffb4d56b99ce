"""Which mapping table a checkpoint uses and how its HF tensors are laid out, for any registered family: thin
dispatch through :func:`bridge.families.bridge_family` (the bridge's modules call these, never a family by name)."""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from .errors import BridgeError
from .families import HFLayout, bridge_family
from .mapping import Expansion
from .megatron_layout import MegatronLayout, get_layout


def detect_layout(arch, hf_names: Iterable[str]) -> HFLayout:
    return bridge_family(arch).detect_layout(arch, list(hf_names))


def expand_for(arch, layout: HFLayout = HFLayout(), *, fp8_names: Iterable[str] = (),
               fp8_block: Sequence[int] = (128, 128)) -> Expansion:
    """The concrete table for ``arch`` in ``layout``."""
    return bridge_family(arch).expand(arch, layout, fp8_names=fp8_names, fp8_block=fp8_block)


def account_for(arch, expansion: Expansion, hf_names: Iterable[str], *, source: str,
                layout: HFLayout = HFLayout()) -> tuple[dict[str, str], tuple[str, ...]]:
    """Exact key accounting: ``({ignored name: reason}, passthrough names)``; raises naming the differences."""
    return bridge_family(arch).account(arch, expansion, hf_names, source=source, layout=layout)


def megatron_layouts_for(arch) -> tuple[str, ...]:
    """The Megatron layouts ``arch``'s family reads and writes (:data:`bridge.megatron_layout.LAYOUTS`)."""
    return bridge_family(arch).megatron_layouts


def megatron_layout_for(arch, name: str, *, source: str) -> MegatronLayout:
    """The layout ``name`` if ``arch``'s family has it, else an error naming the family's (``source``: where the
    config came from)."""
    from megatron_glm5.families import family_of_architecture

    layout = get_layout(name)
    allowed = megatron_layouts_for(arch)
    if name not in allowed:
        raise BridgeError(f"{source}: --megatron-layout {name}: {family_of_architecture(arch).title} Megatron "
                          f"checkpoints come in the {', '.join(allowed)} layout only")
    return layout


def truncate_config(raw: Mapping, num_layers: int) -> dict:
    """``config.json`` of the first ``num_layers`` decoder layers without MTP (per-layer lists cut and explicit).
    The caller has checked ``num_layers``."""
    from megatron_glm5.families import parse_architecture

    arch = parse_architecture(raw)
    return bridge_family(arch).truncate_config(raw, arch, num_layers)


__all__ = ["HFLayout", "account_for", "detect_layout", "expand_for", "megatron_layout_for", "megatron_layouts_for",
           "truncate_config"]
