"""Spec helpers every MLA + DSA family builds its layers from: the MLA projections, the indexer's submodules, one
DSA self-attention spec, the refusal of configs with the wrong numerics and of settings whose implementation is not
installed, and what every block spec does before it is built (:func:`prepare_runtime`)."""

from __future__ import annotations

from typing import Any, Sequence

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerSubmodules, DSAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from ..fusions import install_fusions
from .hf_config import INDEXER_K_NORM_EPS, GLM5ConfigError


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


# The numerics every MLA + DSA family's megatron-core config must carry (Megatron-LM builds it from flags, so they
# are checked when a spec is built): (attribute, expected, the Megatron-LM flag that sets it, why)
DSA_NUMERICS: tuple[tuple[str, Any, str, str], ...] = (
    ("multi_latent_attention", True, "--multi-latent-attention", "MLA"),
    ("experimental_attention_variant", "dsa", "--experimental-attention-variant dsa", "DSA attention"),
    ("rope_type", "rope", "--rope-type rope (no YaRN)",
     "plain RoPE (GLM-5.3-Flash: width 0; YaRN would build a width-0 YarnRotaryEmbedding)"),
    ("apply_rope_fusion", False, "--no-rope-fusion", "refused for DSA (and unverified at width 0)"),
    ("dsa_indexer_rotate_activation", False, "--no-dsa-indexer-rotate-activation", "no Hadamard in the indexer"),
    ("dsa_indexer_scoring_relu", True, "(default; do not pass --no-dsa-indexer-scoring-relu)", "ReLU'd indexer scores"),
    ("dsa_indexer_k_norm_epsilon", INDEXER_K_NORM_EPS, "--dsa-indexer-k-norm-epsilon 1e-6",
     "transformers' k_norm LayerNorm eps"),
    ("qk_layernorm", True, "--qk-layernorm", "q_a / kv_a RMSNorms"),
    ("add_bias_linear", False, "--disable-bias-linear", "no attention / MLP bias"),
)


def wrong_numerics(config, extra: Sequence[tuple[str, Any, str, str]] = (), *, explain: str = "flag") -> list[str]:
    """The rows of :data:`DSA_NUMERICS` plus a family's ``extra`` rows that ``config`` does not match, each as one
    readable line naming the Megatron-LM flag (``explain="flag"``) or the reason (``explain="why"``)."""
    out = []
    for attr, want, flag, why in (*extra, *DSA_NUMERICS):
        found = getattr(config, attr, None)
        if found != want:
            out.append(f"{attr}={found!r} (expected {want!r}; {flag})" if explain == "flag"
                       else f"{attr}={found!r} (expected {want!r}: {why})")
    return out


def check_runtime_dependencies(config) -> None:
    """Refuse, before anything is built, settings whose implementation is not installed (Megatron-LM turns both on
    by default): Transformer Engine modules without Transformer Engine, and apex's gradient-accumulation fusion
    without apex (megatron-core would fail deep inside the first linear's constructor). Names the flag to add."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    bad = []
    if getattr(config, "transformer_impl", "local") == "transformer_engine" and not HAVE_TE:
        bad.append("transformer_impl='transformer_engine' but Transformer Engine is not installed "
                   "(add --transformer-impl local)")
    if getattr(config, "gradient_accumulation_fusion", False):
        if not gradient_accumulation_fusion_available():
            bad.append("gradient_accumulation_fusion=True needs apex's fused_weight_gradient_mlp_cuda, which is not "
                       "installed (add --no-gradient-accumulation-fusion, or set "
                       "MEGATRON_GLM5_FUSED_WGRAD_ACCUMULATION=1 for megatron-glm5's torch version)")
        elif getattr(config, "defer_embedding_wgrad_compute", False) and not apex_gradient_accumulation_fusion():
            bad.append("defer_embedding_wgrad_compute=True needs apex's fused_weight_gradient_mlp_cuda itself "
                       "(megatron-glm5's weight-gradient accumulation serves only the linear layers)")
    if bad:
        raise GLM5ConfigError("; ".join(bad))


def prepare_runtime(config) -> None:
    """What every GLM family does before it builds a layer spec: refuse settings whose implementation is not
    installed (:func:`check_runtime_dependencies`), and route megatron-core's SwiGLU, gradient norm and MoE
    permutation through the fused kernels the environment asks for (:func:`megatron_glm5.fusions.install_fusions`,
    once per process)."""
    install_fusions()
    check_runtime_dependencies(config)


def gradient_accumulation_fusion_available() -> bool:
    """apex's fusion, or ours routed into megatron-core's linear layers (``MEGATRON_GLM5_FUSED_WGRAD_ACCUMULATION``)."""
    from .. import compat

    return apex_gradient_accumulation_fusion() or compat.wgrad_accumulation_routed()


def apex_gradient_accumulation_fusion() -> bool:
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True
