"""Block specs for GLM-5.x on megatron-core, with a small registry of DSA attention backends.

``get_glm5_spec`` is callable three ways:

* Megatron-LM ``pretrain_gpt.py --spec megatron_glm5.spec get_glm5_spec``: called as ``fn(config, vp_stage=...)``
  with the model config Megatron-LM built from its flags (``get_glm5_tilelang_spec`` selects the fused backend the
  same way). The IndexShare pattern then comes from ``--dsa-indexer-topk-freq`` / ``--dsa-indexer-skip-topk-offset``.
* slime / miles: ``fn(args, config, vp_stage)``; the backend comes from ``args.dsa_attention_backend`` when present
  and the IndexShare pattern from ``args.hf_checkpoint``'s ``config.json`` when present.
* Python: ``get_glm5_spec(config, backend="megatron"|"tilelang", vp_stage=None, indexer_types=None)``.

It returns a ``TransformerBlockSubmodules`` holding this pipeline stage's layers. Each layer is a
:class:`~megatron_glm5.glm5.layer.GLMTransformerLayer` whose attention is the selected backend's; "shared" (IndexShare)
layers get no indexer. A stage that would start on a shared layer is refused here, at build time.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttentionSubmodules
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec_for_backend,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from ..core.hf_config import GLM5ConfigError, load_hf_config
from ..core.mla_spec import dsa_attention_spec, prepare_runtime, wrong_numerics
from ..core.patterns import indexer_types_from_mcore, mlp_types_from_mcore
from ..core.stages import local_layer_ids, pipeline_stages
from ..core.stages import validate_stage_layers as _validate_stages
from ..dsa.attention import GLMAbsorbedMLASelfAttention, GLMSparseAttention
from ..dsa.indexer_training import IndexerLossSettings, LossSlot, loss_slots, warmup_freeze
from ..dsa.tilelang_attention import TileLangMLASelfAttention, TileLangSparseAttention
from ..offload import ActivationOffload, activation_offload_for
from ..providers import default_provider
from .config import resolve_indexer_types
from .layer import GLMTransformerLayer

# --------------------------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """How one DSA backend builds a layer's self-attention spec."""

    name: str
    build: Callable[[Any, Any, str, "IndexerTraining"], ModuleSpec]  # (config, provider, indexer_type, training)
    description: str


@dataclass(frozen=True, slots=True)
class IndexerTraining:
    """Per-layer indexer-training parameters of a core attention spec: the warm-up switch (megatron-core's config has
    no field for it) and the layer's tracker slot among the loss-computing layers (None on shared layers)."""

    warmup: bool = False
    slot: LossSlot | None = None

    def params(self) -> dict[str, Any]:
        return {"indexer_warmup": self.warmup, "loss_slot": self.slot}


def _dsa_attention(provider, indexer_type: str, attention: type, core: type, submodules: type,
                   training: IndexerTraining) -> ModuleSpec:
    """``attention(core)`` where ``core`` owns megatron-core's ``DSAIndexer`` on "full" layers only."""
    return dsa_attention_spec(provider, attention=attention, core=core, submodules=submodules, indexer=DSAIndexer,
                              indexer_type=indexer_type, core_params=training.params())


def _megatron_attention(config, provider, indexer_type: str, training: IndexerTraining) -> ModuleSpec:
    return _dsa_attention(provider, indexer_type, GLMAbsorbedMLASelfAttention, GLMSparseAttention,
                          AbsorbedMLASelfAttentionSubmodules, training)


def _tilelang_attention(config, provider, indexer_type: str, training: IndexerTraining) -> ModuleSpec:
    return _dsa_attention(provider, indexer_type, TileLangMLASelfAttention, TileLangSparseAttention,
                          MLASelfAttentionSubmodules, training)


BACKENDS: dict[str, AttentionBackend] = {
    "megatron": AttentionBackend(
        "megatron", _megatron_attention, "megatron-core AbsorbedMLA + DSA indexer and its kernel hooks"
    ),
    "tilelang": AttentionBackend(
        "tilelang", _tilelang_attention, "fused TileLangMLASelfAttention with megatron-glm5's TileLang kernels"
    ),
}


def get_backend(name: str) -> AttentionBackend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown GLM-5.x attention backend {name!r}; valid backends: {sorted(BACKENDS)}") from None


# --------------------------------------------------------------------------------------------------------------------
# GLM numerics the config must carry (checked, since Megatron-LM builds the config from flags)
# --------------------------------------------------------------------------------------------------------------------

_GLM5_NUMERICS = (  # beyond the shared DSA_NUMERICS: (attribute, expected, Megatron-LM flag, why)
    ("dsa_indexer_rope_interleaved", True, "--dsa-indexer-rope-interleaved", "GLM-5.x interleaves the indexer RoPE"),
    ("dsa_indexer_k_norm_fp32", True, "--dsa-indexer-k-norm-fp32", "the indexer k_norm runs in fp32"),
)


def check_glm5_numerics(config) -> None:
    """Refuse a config that would silently run GLM-5.x with the wrong numerics; name the flag that fixes it."""
    bad = wrong_numerics(config, _GLM5_NUMERICS)
    if config.num_moe_experts and getattr(config, "moe_router_score_function", None) != "sigmoid":
        bad.append("moe_router_score_function must be 'sigmoid' (--moe-router-score-function sigmoid)")
    if bad:
        raise GLM5ConfigError("config is not GLM-5.x-shaped: " + "; ".join(bad))


def check_document_masking(args) -> None:
    """Refuse Megatron-LM data flags whose document boundaries would not reach DSA attention.

    ``--reset-attention-mask`` builds a dense block-diagonal mask in the dataloader, but Megatron-LM hands it to the
    first and last pipeline stages only (middle stages attend causally across documents), and ``--reset-position-ids``
    changes only the position ids, which megatron-core's MLA never reads (its RoPE positions come from the sequence
    or the packing). Documents reach every stage, the indexer and RoPE as THD packing:
    ``--dataloader-inter-document-masking`` (``cu_seqlens`` per micro-batch)."""
    if getattr(args, "dataloader_inter_document_masking", False):
        return
    bad = [flag for flag, on in (("--reset-attention-mask", getattr(args, "reset_attention_mask", False)),
                                 ("--reset-position-ids", getattr(args, "reset_position_ids", False))) if on]
    if bad:
        raise GLM5ConfigError(
            f"{' and '.join(bad)}: GLM-5.x DSA attention takes document boundaries as THD packing; use "
            "--dataloader-inter-document-masking instead (Megatron-LM's pretrain_gpt.py), otherwise attention "
            "and RoPE positions would silently cross documents"
        )


def _megatron_lm_args():
    """Megatron-LM's global args when a Megatron-LM program set them (pretrain_gpt.py), else None."""
    global_vars = sys.modules.get("megatron.training.global_vars")  # not imported: no Megatron-LM program runs
    if global_vars is None:
        return None
    try:
        return global_vars.get_args()
    except (AssertionError, RuntimeError):
        return None


# --------------------------------------------------------------------------------------------------------------------
# IndexShare pattern and pipeline split
# --------------------------------------------------------------------------------------------------------------------


indexer_types_from_config = indexer_types_from_mcore  # the pattern of Megatron-LM's --dsa-indexer-topk-freq / offset


def validate_stage_layers(types: Sequence[str], local_layer_ids: Sequence[int], config) -> None:
    """Every pipeline stage / virtual chunk must start on a full layer: shared layers take their top-k from the
    previous layer in the same stage, and nothing crosses a stage boundary (:mod:`megatron_glm5.core.stages`)."""
    _validate_stages(types, local_layer_ids, stages=pipeline_stages(config))


# --------------------------------------------------------------------------------------------------------------------
# Layer and block specs
# --------------------------------------------------------------------------------------------------------------------


def _layer_spec(config, provider, backend: AttentionBackend, indexer_type: str, moe: bool,
                offload: ActivationOffload | None = None,
                training: IndexerTraining = IndexerTraining()) -> ModuleSpec:
    if moe:
        mlp = get_moe_module_spec_for_backend(
            backend=provider, num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm
        )
    else:
        mlp = get_mlp_module_spec_for_backend(backend=provider, num_experts=None)
    return ModuleSpec(
        module=GLMTransformerLayer,
        params={"activation_offload": offload} if offload is not None else {},
        submodules=TransformerLayerSubmodules(
            input_layernorm=provider.layer_norm(rms_norm=True),
            self_attention=backend.build(config, provider, indexer_type, training),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=provider.layer_norm(rms_norm=True),
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def build_glm5_block_spec(
    config,
    *,
    backend: str = "megatron",
    vp_stage: int | None = None,
    indexer_types: Sequence[str] | None = None,
    provider=None,
    pp_rank: int | None = None,
    activation_offload: ActivationOffload | None = None,
    indexer_warmup: bool = False,
) -> TransformerBlockSubmodules:
    """This stage's decoder block spec (see module docstring). ``pp_rank`` defaults to megatron-core's.
    ``activation_offload``: the layers' offload window (:mod:`megatron_glm5.offload`); None takes it from
    megatron-core's ``fine_grained_activation_offloading`` / ``offload_modules`` (Megatron-LM's flags).
    ``indexer_warmup``: the indexer warm-up stage (:mod:`megatron_glm5.dsa.indexer_training`)."""
    check_glm5_numerics(config)
    prepare_runtime(config)
    args = _megatron_lm_args()
    if args is not None:
        check_document_masking(args)
    chosen = get_backend(backend)
    provider = provider or default_provider()
    types = tuple(indexer_types) if indexer_types is not None else indexer_types_from_config(config)
    if len(types) != config.num_layers:
        raise GLM5ConfigError(f"indexer_types has {len(types)} entries but the model has {config.num_layers} layers")
    if types[0] != "full":
        raise GLM5ConfigError("indexer_types[0] must be 'full': layer 0 has no earlier layer to share top-k with")
    local = local_layer_ids(config, vp_stage, pp_rank)
    validate_stage_layers(types, local, config)
    moe = [t == "sparse" for t in mlp_types_from_mcore(config)]
    offload = activation_offload if activation_offload is not None else activation_offload_for(config)
    check_indexer_training(config, indexer_warmup)
    slots, _ = loss_slots(types, config.mtp_num_layers or 0)
    layers = [_layer_spec(config, provider, chosen, types[i], bool(moe[i]), offload,
                          IndexerTraining(indexer_warmup, slots.get(i))) for i in local]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=provider.layer_norm(rms_norm=True))


def check_indexer_training(config, warmup: bool) -> None:
    """Refuse an indexer-loss setting that cannot train (named flags), when the spec is built."""
    try:
        IndexerLossSettings.from_config(config, warmup)
    except ValueError as e:
        raise GLM5ConfigError(str(e)) from None


def build_glm5_mtp_spec(config, *, backend: str = "megatron", provider=None,
                        activation_offload: ActivationOffload | None = None,
                        indexer_types: Sequence[str] | None = None, indexer_warmup: bool = False):
    """MTP block spec: each MTP layer is a full MoE decoder layer with its own indexer (never shared) and its own
    indexer-loss slot after the decoder's full layers."""
    if not config.mtp_num_layers:
        return None
    provider = provider or default_provider()
    offload = activation_offload if activation_offload is not None else activation_offload_for(config)
    types = tuple(indexer_types) if indexer_types is not None else indexer_types_from_config(config)
    _, slots = loss_slots(types, config.mtp_num_layers)
    layers = []
    for slot in slots:
        inner = _layer_spec(config, provider, get_backend(backend), "full", bool(config.num_moe_experts), offload,
                            IndexerTraining(indexer_warmup, slot))
        layers.append(get_mtp_layer_spec_for_backend(mtp_model_layer_spec=inner, backend=provider))
    return MultiTokenPredictionBlockSubmodules(layer_specs=layers)


def _indexer_types_from_hf(path: str | Path | None, num_layers: int) -> tuple[str, ...] | None:
    if not path:
        return None
    try:
        raw = load_hf_config(path)
    except FileNotFoundError:
        return None
    return resolve_indexer_types(raw, num_layers)


def get_glm5_spec(*args: Any, backend: str | None = None, vp_stage: int | None = None,
                  indexer_types: Sequence[str] | None = None, **kwargs: Any) -> TransformerBlockSubmodules:
    """GLM-5.x decoder block spec; see the module docstring for the three calling conventions."""
    if len(args) >= 2 and isinstance(args[0], argparse.Namespace):  # slime / miles: (args, config, vp_stage)
        ns, config = args[0], args[1]
        if len(args) > 2:
            vp_stage = args[2]
        backend = backend or getattr(ns, "dsa_attention_backend", None) or "megatron"
        if indexer_types is None:
            indexer_types = _indexer_types_from_hf(getattr(ns, "hf_checkpoint", None), config.num_layers)
    elif len(args) == 1:
        config = args[0]
    else:
        raise TypeError("get_glm5_spec(config, *, backend=..., vp_stage=...) or get_glm5_spec(args, config, vp_stage)")
    return build_glm5_block_spec(
        config, backend=backend or "megatron", vp_stage=vp_stage, indexer_types=indexer_types, **kwargs
    )


def get_glm5_tilelang_spec(config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """``--spec megatron_glm5.spec get_glm5_tilelang_spec``: the fused TileLang backend."""
    return build_glm5_block_spec(config, backend="tilelang", vp_stage=vp_stage)


def get_glm5_warmup_spec(config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """``--spec megatron_glm5.spec get_glm5_warmup_spec``: the indexer warm-up stage on the ``megatron`` backend
    (dense main attention, dense indexer loss, only the indexers train: :func:`warmup_freeze` freezes the rest of the
    model as Megatron-LM builds it). Needs ``--dsa-indexer-loss-coeff`` > 0."""
    spec = build_glm5_block_spec(config, backend="megatron", vp_stage=vp_stage, indexer_warmup=True)
    warmup_freeze.arm()
    return spec


def get_glm5_tilelang_warmup_spec(config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """``--spec megatron_glm5.spec get_glm5_tilelang_warmup_spec``: the warm-up on the ``tilelang`` backend."""
    spec = build_glm5_block_spec(config, backend="tilelang", vp_stage=vp_stage, indexer_warmup=True)
    warmup_freeze.arm()
    return spec
