"""Layer and block specs for GLM-5.3-Flash's NoPE DSA + MLP/MoE layers on megatron-core, on both attention backends.

:func:`build_glm5_next_layer_spec` builds one decoder layer from its four per-layer choices:

* ``layer_type`` (HF ``layer_types[i]``): ``"indexed_attention"`` = NoPE MLA DSA with the KPool indexer
  (:mod:`.attention`), ``"linear_attention"`` = KDA (:mod:`.kda`);
* ``mlp_type`` (HF ``mlp_layer_types[i]``): ``"dense"`` = megatron-core ``MLP``, ``"sparse"`` = ``MoELayer`` (sigmoid
  router with expert bias, routed experts, one shared expert), both with the clamped SwiGLU;
* ``indexer_type`` (HF ``indexer_types[i]``): ``"full"`` layers own a KPool indexer, ``"shared"`` layers reuse the
  top-k of the nearest earlier full DSA layer and own no indexer parameters;
* ``backend``: ``"megatron"`` (megatron-core AbsorbedMLA) or ``"tilelang"`` (our fused TileLang path).

The layer (:class:`~.layer.GLM5NextTransformerLayer`) is a plain pre-norm residual layer, or with
``hyper_connections=True`` (what :func:`build_glm5_next_block_spec` builds when ``config.hc_mult > 0``) both sublayers
are wrapped in mHC streams (:mod:`.mhc`). :func:`build_glm5_next_mtp_spec` gives the MTP block (plain layers).

Top-k passing: a DSA layer takes the incoming top-k and returns its own through the layer ``context`` slot (see
:mod:`megatron_glm5.core.layer`); a "shared" layer attends with the incoming one. Any layer without DSA attention (the
KDA layers) must return the ``context`` it received, unchanged, so the top-k reaches the next DSA layer
across it: the source of a shared layer is the nearest earlier *full DSA* layer (:func:`topk_sources`), not the
previous decoder layer (transformers 5.24 only passes it between adjacent layers). A pipeline stage starts with no
top-k, so its first DSA layer must be full (:func:`validate_stage_layers`).

Build-time refusals, each naming the field: a config that is not GLM-5.3-Flash-shaped
(:func:`check_glm5_next_numerics`: rope width > 0, ``dsa_indexer_topk % dsa_indexer_kpool``, Hadamard, ...), and
every megatron-core path that drops the SwiGLU clamp (the config flags via
:func:`~.swiglu.check_clamped_swiglu`; the built MLP modules again in :class:`GLM5NextTransformerLayer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttentionSubmodules
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec_for_backend,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from ..compat import send_pipeline_hidden_size
from ..core.hf_config import GLM5ConfigError
from ..core.mla_spec import dsa_attention_spec, indexer_spec, prepare_runtime, wrong_numerics
from ..core.patterns import mlp_types_from_mcore
from ..core.stages import local_layer_ids, pipeline_stages
from ..core.stages import topk_sources as _topk_sources
from ..core.stages import validate_stage_layers as _validate_stages
from ..dsa.attention import GLMAbsorbedMLASelfAttention
from ..dsa.kpool_indexer import KPoolIndexer
from ..dsa.tilelang_attention import TileLangMLASelfAttention
from ..providers import default_provider

from .attention import GLM5NextSparseAttention, TileLangGLM5NextSparseAttention
from .kda import KDASubmodules, KimiDeltaAttention
from .layer import GLM5NextTransformerLayer
from .mhc import StreamMeanNorm
from .swiglu import ClampedSwiGLUError, check_clamped_swiglu

LAYER_TYPES = ("indexed_attention", "linear_attention")
MLP_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")


@dataclass(frozen=True, slots=True)
class NoPEDSABackend:
    """One backend's NoPE DSA attention: the GLM-5 attention module with the glm5_next (KPool) core attention."""

    attention: type
    core_attention: type
    submodules: type


BACKENDS: dict[str, NoPEDSABackend] = {
    "megatron": NoPEDSABackend(GLMAbsorbedMLASelfAttention, GLM5NextSparseAttention,
                               AbsorbedMLASelfAttentionSubmodules),
    "tilelang": NoPEDSABackend(TileLangMLASelfAttention, TileLangGLM5NextSparseAttention, MLASelfAttentionSubmodules),
}


def _choice(value: str, valid: Sequence[str], what: str) -> str:
    if value not in valid:
        raise ValueError(f"{what}: expected one of {list(valid)}, got {value!r}")
    return value


# --------------------------------------------------------------------------------------------------------------------
# config check
# --------------------------------------------------------------------------------------------------------------------

_NOPE = (("qk_pos_emb_head_dim", 0, "--qk-pos-emb-head-dim 0",
          "GLM-5.3-Flash attention is NoPE (HF qk_rope_head_dim = 0)"),)  # beyond the shared DSA_NUMERICS


def check_glm5_next_numerics(config) -> None:
    """Refuse a config that would not run GLM-5.3-Flash's NoPE DSA + clamped-SwiGLU layers; names every bad field."""
    if not hasattr(config, "dsa_indexer_kpool"):
        raise GLM5ConfigError(
            f"config is a {type(config).__name__} without dsa_indexer_kpool: build it with "
            "megatron_glm5.glm5_next.mcore_config.build_transformer_config (GLM5NextTransformerConfig)"
        )
    bad = wrong_numerics(config, _NOPE, explain="why")
    if config.dsa_indexer_kpool < 1 or config.dsa_indexer_topk % config.dsa_indexer_kpool:
        bad.append(f"dsa_indexer_topk={config.dsa_indexer_topk!r} (expected a multiple of "
                   f"dsa_indexer_kpool={config.dsa_indexer_kpool!r}: whole pools)")
    if config.num_moe_experts and config.moe_router_score_function != "sigmoid":
        bad.append(f"moe_router_score_function={config.moe_router_score_function!r} (expected 'sigmoid')")
    limit = config.activation_func_clamp_value
    if limit is None:
        bad.append("activation_func_clamp_value=None (expected the checkpoint's swiglu_limit: clamped SwiGLU)")
    else:
        try:
            check_clamped_swiglu(config, limit)
        except ClampedSwiGLUError as e:
            bad.append(str(e))
    if bad:
        raise GLM5ConfigError("config is not GLM-5.3-Flash-shaped: " + "; ".join(bad))


# --------------------------------------------------------------------------------------------------------------------
# layer spec
# --------------------------------------------------------------------------------------------------------------------


def kpool_indexer_spec(provider) -> ModuleSpec:
    """megatron-core ``DSAIndexer`` submodules (replicated projections and ``k_norm``) + KPool parameters."""
    return indexer_spec(KPoolIndexer, provider)


def nope_dsa_attention_spec(indexer_type: str, backend: str, provider) -> ModuleSpec:
    """The self-attention spec of a NoPE DSA layer; "shared" layers get no indexer."""
    _choice(indexer_type, INDEXER_TYPES, "indexer_type")
    try:
        chosen = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown GLM-5.3-Flash attention backend {backend!r}; valid backends: "
                         f"{sorted(BACKENDS)}") from None
    return dsa_attention_spec(provider, attention=chosen.attention, core=chosen.core_attention,
                              submodules=chosen.submodules, indexer=KPoolIndexer, indexer_type=indexer_type)


def kda_attention_spec(provider) -> ModuleSpec:
    """The mixer of a ``linear_attention`` (KDA) layer: column-parallel q/k/v/beta and up-projections, replicated
    low-rank down-projections, row-parallel output (:mod:`.kda`)."""
    column = provider.column_parallel_linear()
    return ModuleSpec(
        module=KimiDeltaAttention,
        submodules=KDASubmodules(
            linear_q=column, linear_k=column, linear_v=column,
            linear_f_down=provider.linear(), linear_f_up=column,
            linear_beta=column,
            linear_g_down=provider.linear(), linear_g_up=column,
            linear_proj=provider.row_parallel_linear(),
        ),
    )


def mlp_spec(config, mlp_type: str, provider) -> Callable:
    """Dense ``MLP`` or ``MoELayer`` with megatron-core's unfused (clamping) GLU: never the TE op fuser."""
    if _choice(mlp_type, MLP_TYPES, "mlp_type") == "sparse":
        if not config.num_moe_experts:
            raise GLM5ConfigError("mlp_type 'sparse' needs num_moe_experts > 0 in the config")
        return get_moe_module_spec_for_backend(backend=provider, num_experts=config.num_moe_experts,
                                               moe_grouped_gemm=config.moe_grouped_gemm)
    return get_mlp_module_spec_for_backend(backend=provider, num_experts=None, use_te_op_fuser=False)


def build_glm5_next_layer_spec(config, layer_type: str, mlp_type: str, indexer_type: str = "full",
                               backend: str = "megatron", provider=None, *, hyper_connections: bool = False,
                               expand_streams: bool = False, activation_offload=None) -> ModuleSpec:
    """One GLM-5.3-Flash decoder layer (module docstring). ``hyper_connections``: wrap both sublayers in mHC streams
    (the decoder layers of the real model; ``expand_streams`` on its first layer), else a plain pre-norm layer (the
    MTP layer, single-layer fixtures). ``activation_offload``: the layer's offload window
    (:mod:`megatron_glm5.offload`). ``config`` is checked by :func:`check_glm5_next_numerics` and
    :func:`megatron_glm5.core.mla_spec.prepare_runtime`."""
    check_glm5_next_numerics(config)
    prepare_runtime(config)
    provider = provider or default_provider()
    if _choice(layer_type, LAYER_TYPES, "layer_type") == "linear_attention":
        mixer = kda_attention_spec(provider)
    else:
        mixer = nope_dsa_attention_spec(indexer_type, backend, provider)
    if hyper_connections and config.hc_mult < 1:
        raise GLM5ConfigError(f"hyper_connections needs hc_mult >= 1 in the config, found {config.hc_mult}")
    return ModuleSpec(
        module=GLM5NextTransformerLayer,
        params={"hyper_connections": hyper_connections, "expand_streams": expand_streams,
                **({"activation_offload": activation_offload} if activation_offload is not None else {})},
        submodules=TransformerLayerSubmodules(
            input_layernorm=provider.layer_norm(rms_norm=True),
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=provider.layer_norm(rms_norm=True),
            mlp=mlp_spec(config, mlp_type, provider),
            mlp_bda=get_bias_dropout_add,
        ),
    )


# --------------------------------------------------------------------------------------------------------------------
# IndexShare across non-DSA layers, pipeline split, block spec
# --------------------------------------------------------------------------------------------------------------------


def topk_sources(layer_types: Sequence[str], indexer_types: Sequence[str]) -> tuple[int | None, ...]:
    """Per layer: the DSA layer whose top-k it attends with (itself when full; the nearest earlier full DSA layer
    when shared, skipping non-DSA layers), or None for a non-DSA layer (:func:`megatron_glm5.core.stages.topk_sources`).
    Raises naming ``indexer_types[i]`` for a shared layer with no full DSA layer before it."""
    for i, lt in enumerate(layer_types):
        _choice(lt, LAYER_TYPES, f"layer_types[{i}]")
    return _topk_sources(indexer_types, [lt == "indexed_attention" for lt in layer_types])


def validate_stage_layers(layer_types: Sequence[str], indexer_types: Sequence[str],
                          local_layer_ids: Sequence[int], stages: int = 1) -> None:
    """A pipeline stage (or virtual chunk) starts without a top-k: its first DSA layer must be full. ``stages``
    (pipeline x virtual stages), when more than one, adds a valid split to the error."""
    topk_sources(layer_types, indexer_types)
    _validate_stages(indexer_types, local_layer_ids, is_dsa=[lt == "indexed_attention" for lt in layer_types],
                     stages=stages)


def check_pipeline_support(config) -> None:
    """Pipeline stages of an mHC model exchange the streams, ``[s, b, hc_mult * hidden]``
    (``GLM5NextTransformerConfig.pipeline_hidden_size``): megatron-core's 1F1B schedule is told that width
    (:func:`megatron_glm5.compat.send_pipeline_hidden_size`). Its interleaved schedule computes ``[s, b,
    hidden_size]`` inline, so virtual pipeline stages are refused (:func:`megatron_glm5.model.build_model` refuses them
    earlier, by the family's name for them)."""
    if not config.hc_mult or config.pipeline_model_parallel_size == 1:
        return
    vpp = config.virtual_pipeline_model_parallel_size
    if (vpp or 1) > 1:
        raise GLM5ConfigError(
            f"virtual_pipeline_model_parallel_size={vpp}: virtual pipeline stages are not supported for GLM-5.3-Flash "
            "yet: its stages exchange the mHC streams ([s, b, hc_mult * hidden] = "
            f"[s, b, {config.pipeline_hidden_size}]), and megatron-core's interleaved schedule sends [s, b, "
            "hidden_size]; use pipeline parallelism without virtual stages"
        )
    send_pipeline_hidden_size()


def build_glm5_next_block_spec(config, *, layer_types: Sequence[str], indexer_types: Sequence[str],
                               backend: str = "megatron", vp_stage: int | None = None, pp_rank: int | None = None,
                               provider=None, activation_offload=None) -> TransformerBlockSubmodules:
    """This pipeline stage's decoder layers. ``layer_types`` / ``indexer_types`` are the architecture's
    (``GLM5NextArchitecture``); the MLP types come from ``config.moe_layer_freq``. With ``config.hc_mult > 0`` every
    layer carries mHC streams (the first expands the embedding into them) and the final norm is
    :class:`~.mhc.StreamMeanNorm`."""
    check_glm5_next_numerics(config)
    check_pipeline_support(config)
    n = config.num_layers
    for name, seq in (("layer_types", layer_types), ("indexer_types", indexer_types)):
        if len(seq) != n:
            raise GLM5ConfigError(f"{name} has {len(seq)} entries but the config has num_layers={n}")
    local = local_layer_ids(config, vp_stage, pp_rank)
    validate_stage_layers(layer_types, indexer_types, local, pipeline_stages(config))
    provider = provider or default_provider()
    mlps = mlp_types_from_mcore(config)
    hc = config.hc_mult > 0
    layers = [build_glm5_next_layer_spec(config, layer_types[i], mlps[i], indexer_types[i], backend, provider,
                                         hyper_connections=hc, expand_streams=hc and i == 0,
                                         activation_offload=activation_offload)
              for i in local]
    final_norm = StreamMeanNorm if hc else provider.layer_norm(rms_norm=True)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)


def build_glm5_next_mtp_spec(config, *, backend: str = "megatron", provider=None, activation_offload=None):
    """MTP block spec (None without MTP): each MTP layer's inner layer is a plain pre-norm NoPE-DSA layer with its
    own (full) KPool indexer and the MoE MLP, without mHC: it takes the decoder output after the final norm."""
    if not config.mtp_num_layers:
        return None
    provider = provider or default_provider()
    inner = build_glm5_next_layer_spec(config, "indexed_attention", "sparse" if config.num_moe_experts else "dense",
                                       "full", backend, provider, activation_offload=activation_offload)
    layer = get_mtp_layer_spec_for_backend(mtp_model_layer_spec=inner, backend=provider)
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * config.mtp_num_layers)
