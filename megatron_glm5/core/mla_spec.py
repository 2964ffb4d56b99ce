"""Spec helpers every MLA + DSA family builds its layers from: the MLA projections, the indexer's submodules, one
DSA self-attention spec, the refusal of configs with the wrong numerics and of settings whose implementation is not
installed."""

from __future__ import annotations

from typing import Any, Sequence

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerSubmodules, DSAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from .hf_config import GLM5ConfigError


def mla_fields(provider) -> dict[str, ModuleSpec]:
    """MLA projections and norms, identical for both backends and both families (so parameters and checkpoints
    are)."""
    return dict(
        linear_q_proj=provider.column_parallel_linear(),
        linear_q_down_proj=provider.down_projection(),
        linear_q_up_proj=provider.column_parallel_linear(),
        linear_kv_down_proj=provider.down_projection(),
        linear_kv_up_proj=provider.column_parallel_linear(),
        linear_proj=provider.row_parallel_linear(),
        q_layernorm=provider.layer_norm(rms_norm=True, for_qk=True),
        kv_layernorm=provider.layer_norm(rms_norm=True, for_qk=True),
    )


def indexer_spec(module: type, provider) -> ModuleSpec:
    """A DSA indexer (megatron-core's ``DSAIndexer`` or a family's subclass): replicated projections and ``k_norm``."""
    return ModuleSpec(
        module=module,
        submodules=DSAIndexerSubmodules(
            linear_wq_b=provider.linear(),
            linear_wk=provider.linear(),
            k_norm=provider.replicated_norm(),
            linear_weights_proj=provider.linear(),
        ),
    )


def dsa_attention_spec(provider, *, attention: type, core: type, submodules: type, indexer: type,
                       indexer_type: str, core_params: dict[str, Any] | None = None) -> ModuleSpec:
    """``attention(core)`` where ``core`` owns an ``indexer`` on "full" layers only ("shared" layers own none)."""
    if indexer_type not in ("full", "shared"):
        raise ValueError(f"indexer_type: expected one of ['full', 'shared'], got {indexer_type!r}")
    core_spec = ModuleSpec(
        module=core,
        params={"indexer_type": indexer_type, **(core_params or {})},
        submodules=DSAttentionSubmodules(indexer=indexer_spec(indexer, provider) if indexer_type == "full" else None),
    )
    return ModuleSpec(
        module=attention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=submodules(**mla_fields(provider), core_attention=core_spec),
    )


def wrong_fields(config, required: Sequence[tuple[str, Any, str]], sep: str = "; ") -> list[str]:
    """``(attribute, expected, why or flag)`` rows the config does not match, each as one readable line."""
    return [f"{attr}={getattr(config, attr, None)!r} (expected {want!r}{sep}{why})"
            for attr, want, why in required if getattr(config, attr, None) != want]


def check_runtime_dependencies(config) -> None:
    """Refuse, before anything is built, settings whose implementation is not installed (Megatron-LM turns both on
    by default): Transformer Engine modules without Transformer Engine, and apex's gradient-accumulation fusion
    without apex (megatron-core would fail deep inside the first linear's constructor). Names the flag to add."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    bad = []
    if getattr(config, "transformer_impl", "local") == "transformer_engine" and not HAVE_TE:
        bad.append("transformer_impl='transformer_engine' but Transformer Engine is not installed "
                   "(add --transformer-impl local)")
    if getattr(config, "gradient_accumulation_fusion", False) and not apex_gradient_accumulation_fusion():
        bad.append("gradient_accumulation_fusion=True needs apex's fused_weight_gradient_mlp_cuda, which is not "
                   "installed (add --no-gradient-accumulation-fusion)")
    if bad:
        raise GLM5ConfigError("; ".join(bad))


def apex_gradient_accumulation_fusion() -> bool:
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True
