"""GLM-5.x HF ``config.json`` -> frozen :class:`GLM5Architecture` (step 1 of the translation).

:func:`parse_hf_config` reads the *raw* JSON dict (never an in-memory transformers config: transformers rewrites
geometry fields such as ``head_dim`` and may shadow ``n_routed_experts`` with ``num_experts``) and validates it into
a frozen :class:`GLM5Architecture` that describes the checkpoint and nothing else. Step 2 (architecture ->
megatron-core fields) is :mod:`megatron_glm5.glm5.mcore_config`; step 3 (runtime policy -> megatron-core fields) is
family-neutral, :mod:`megatron_glm5.core.policy`. Pure: no I/O, no globals, no distributed state.

Pitfalls handled (each names where it was seen):

* ``qk_pos_emb_head_dim`` is ``qk_head_dim - qk_nope_head_dim``, never ``head_dim``: GLM-5.2 ships
  ``head_dim: 192`` and some transformers versions copy it into ``qk_rope_head_dim`` (radixark Megatron-Bridge).
* ``rope_theta`` lives in ``rope_parameters`` (transformers 5 layout); the flat key is a fallback only. Reading the
  flat key first silently used 1e6 for GLM-5.2, whose theta is 8e6 (sglang-jax #1384).
* megatron-core's ``MLATransformerConfig.rope_type`` defaults to ``"yarn"``; GLM-5.x uses plain RoPE.
* megatron-core hard-codes interleaved (GPT-J pair) RoPE for MLA, so ``rope_interleave: false`` is refused.
* Configs written by transformers' own ``GlmMoeDsaConfig.save_pretrained`` carry neither ``rope_interleave`` nor
  ``indexer_rope_interleave`` (its GLM code always interleaves, in MLA and in the indexer), and add ``layer_types``,
  ``mlp_layer_types``, ``head_dim`` and ``mlp_bias``. An absent flag therefore means interleaved; an explicit
  ``false`` contradicts ``glm_moe_dsa`` (that is DeepSeek-V3.2's half-split indexer) and is refused.
  ``mlp_layer_types`` must agree with ``first_k_dense_replace``; ``layer_types`` must name DSA attention everywhere.
* ``dsa_indexer_rotate_activation`` defaults to True (Hadamard, DeepSeek-V3.2); GLM-5.x has none.
* The indexer ``k_norm`` is a LayerNorm with eps 1e-6 (not ``rms_norm_eps``), computed in fp32.
* transformers 5.11-5.12 wrote ``num_experts=256`` into every saved GlmMoeDsa config; ``n_routed_experts`` wins.
* The router runs in fp32 with the ``e_score_correction_bias`` kept in fp32 (GLM-5.2 bias values sit near 7.0,
  where bf16 collapses them; sglang #31213).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from ..core.hf_config import MISSING, GLM5ConfigError, MLAGeometry, get_field, require_positive
from ..core.patterns import indexshare_types, moe_pattern

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa",)
FAMILY = "GLM-5.x (glm_moe_dsa)"

IndexerType = Literal["full", "shared"]


# --------------------------------------------------------------------------------------------------------------------
# 1. The checkpoint's architecture, read from raw JSON
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class YarnParameters:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class GLM5Architecture(MLAGeometry):
    """What a GLM-5.x checkpoint is. Field names follow HF; values are validated and derived ones resolved."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    # MLA
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # resolved as qk_head_dim - qk_nope_head_dim
    v_head_dim: int
    rope_theta: float
    yarn: YarnParameters | None
    max_position_embeddings: int
    # DSA indexer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[IndexerType, ...]  # per decoder layer, 0-indexed
    # MoE
    mlp_layer_types: tuple[Literal["dense", "sparse"], ...]
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    # misc
    num_nextn_predict_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    torch_dtype: str | None = None
    quantization: Mapping[str, Any] | None = field(default=None, compare=False)

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * (_yarn_mscale(self.yarn) ** 2)

    @property
    def dsa_layers(self) -> tuple[int, ...]:
        """Every GLM-5.x decoder layer is a DSA layer (GLM-5.3-Flash's architecture has the same view)."""
        return tuple(range(self.num_hidden_layers))

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")


def _yarn_mscale(yarn: YarnParameters | None) -> float:
    if yarn is None or yarn.factor <= 1 or not yarn.mscale_all_dim:
        return 1.0
    return 0.1 * yarn.mscale_all_dim * math.log(yarn.factor) + 1.0


def _get(raw: Mapping[str, Any], name: str, typ: type | tuple[type, ...], default: Any = MISSING) -> Any:
    return get_field(raw, name, typ, default, family=FAMILY)


_positive = require_positive


def resolve_indexer_types(raw: Mapping[str, Any], num_layers: int) -> tuple[IndexerType, ...]:
    """Per-layer "full"/"shared" indexer pattern: ``indexer_types`` (explicit list) wins, then
    ``index_topk_pattern`` ("F"/"S" string or list), then ``index_topk_freq`` / ``index_skip_topk_offset``
    with HF's rule (0-indexed layer i is full iff ``max(i - offset + 1, 0) % freq == 0``; HF defaults offset=2,
    freq=1, i.e. every layer full). The first layer must be full: a shared layer needs an earlier source."""
    explicit = raw.get("indexer_types")
    pattern = raw.get("index_topk_pattern")
    if explicit is not None:
        if not isinstance(explicit, list):
            raise GLM5ConfigError(f"config field 'indexer_types': expected a list, found {type(explicit).__name__}")
        types = tuple(explicit)
        source = "indexer_types"
        if pattern is not None and tuple(_pattern_to_types(pattern)) != types:
            raise GLM5ConfigError(
                "config fields 'indexer_types' and 'index_topk_pattern' disagree: "
                f"indexer_types={list(types)}, index_topk_pattern={pattern!r}"
            )
    elif pattern is not None:
        types = tuple(_pattern_to_types(pattern))
        source = "index_topk_pattern"
    else:
        freq = _get(raw, "index_topk_freq", int, 1)
        offset = _get(raw, "index_skip_topk_offset", int, 2)
        if freq < 1:
            raise GLM5ConfigError(f"config field 'index_topk_freq': expected >= 1, found {freq}")
        if offset < 0:
            raise GLM5ConfigError(f"config field 'index_skip_topk_offset': expected >= 0, found {offset}")
        types = indexshare_types(num_layers, freq, offset)
        source = f"index_topk_freq={freq}/index_skip_topk_offset={offset}"
    bad = [t for t in types if t not in ("full", "shared")]
    if bad:
        raise GLM5ConfigError(f"config field '{source}': entries must be 'full' or 'shared', found {bad[0]!r}")
    if len(types) != num_layers:
        raise GLM5ConfigError(
            f"config field '{source}': expected {num_layers} entries (num_hidden_layers), found {len(types)}"
        )
    if types and types[0] != "full":
        raise GLM5ConfigError(
            f"config field '{source}': layer 0 is 'shared' but a shared layer reuses the top-k of an earlier "
            "'full' layer and layer 0 has none; expected 'full' for layer 0"
        )
    return types  # type: ignore[return-value]


def _pattern_to_types(pattern: Any) -> list[str]:
    if isinstance(pattern, str):
        try:
            return [{"F": "full", "S": "shared"}[c] for c in pattern]
        except KeyError as e:
            raise GLM5ConfigError(
                f"config field 'index_topk_pattern': expected only 'F'/'S' characters, found {e.args[0]!r}"
            ) from None
    if isinstance(pattern, list):
        return list(pattern)
    raise GLM5ConfigError(f"config field 'index_topk_pattern': expected str or list, found {type(pattern).__name__}")


def _resolve_mlp_layer_types(raw: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    first_k = _get(raw, "first_k_dense_replace", int, 0)
    freq = _get(raw, "moe_layer_freq", int, 1)
    if freq < 1:
        raise GLM5ConfigError(f"config field 'moe_layer_freq': expected >= 1, found {freq}")
    derived = moe_pattern(num_layers, first_k, freq)
    explicit = raw.get("mlp_layer_types")
    if explicit is None:
        return derived
    explicit = tuple(explicit)
    if len(explicit) != num_layers or any(t not in ("dense", "sparse") for t in explicit):
        raise GLM5ConfigError(
            f"config field 'mlp_layer_types': expected {num_layers} entries of 'dense'/'sparse', found {list(explicit)}"
        )
    if "first_k_dense_replace" in raw and explicit != derived:
        raise GLM5ConfigError(
            "config fields 'mlp_layer_types' and 'first_k_dense_replace'/'moe_layer_freq' disagree: "
            f"mlp_layer_types={list(explicit)}, first_k_dense_replace={first_k} gives {list(derived)}"
        )
    return explicit


# ``layer_types`` values transformers has written for GLM-5.x's (all-DSA) attention layers.
_DSA_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")


def _check_layer_types(raw: Mapping[str, Any], num_layers: int) -> None:
    types = raw.get("layer_types")
    if types is None:
        return
    if not isinstance(types, list) or len(types) != num_layers:
        raise GLM5ConfigError(
            f"config field 'layer_types': expected a list of {num_layers} entries (num_hidden_layers), found {types!r}"
        )
    bad = sorted({t for t in types if t not in _DSA_LAYER_TYPES})
    if bad:
        raise GLM5ConfigError(
            f"config field 'layer_types': every GLM-5.x layer is DSA attention (expected entries in "
            f"{list(_DSA_LAYER_TYPES)}), found {bad}"
        )


def _resolve_rope(raw: Mapping[str, Any]) -> tuple[float, YarnParameters | None]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise GLM5ConfigError(f"config field 'rope_parameters': expected a dict, found {type(params).__name__}")
    nested = params.get("rope_theta")
    flat = raw.get("rope_theta")
    if nested is not None and flat is not None and float(nested) != float(flat):
        raise GLM5ConfigError(
            f"config fields 'rope_parameters.rope_theta' ({nested}) and 'rope_theta' ({flat}) disagree; "
            "expected one value (transformers 5 reads the nested one)"
        )
    theta = nested if nested is not None else flat
    if theta is None:
        raise GLM5ConfigError("config field 'rope_parameters.rope_theta' (or flat 'rope_theta') is required but missing")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "yarn":
        try:
            yarn = YarnParameters(
                factor=float(params["factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                beta_fast=float(params.get("beta_fast", 32.0)),
                beta_slow=float(params.get("beta_slow", 1.0)),
                mscale=float(params.get("mscale", 1.0)),
                mscale_all_dim=float(params.get("mscale_all_dim", 0.0)),
            )
        except KeyError as e:
            raise GLM5ConfigError(f"config field 'rope_parameters.{e.args[0]}' is required for rope_type 'yarn'") from None
        return float(theta), yarn
    raise GLM5ConfigError(
        f"config field 'rope_parameters.rope_type': expected 'default' or 'yarn', found {rope_type!r}"
    )


def parse_hf_config(raw: Mapping[str, Any]) -> GLM5Architecture:
    """Validate a raw GLM-5.x ``config.json`` dict and resolve every derived field."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise GLM5ConfigError(
            f"config field 'model_type': expected one of {list(SUPPORTED_MODEL_TYPES)}, found {model_type!r}"
        )
    num_layers = _positive("num_hidden_layers", _get(raw, "num_hidden_layers", int))
    nope = _positive("qk_nope_head_dim", _get(raw, "qk_nope_head_dim", int))

    # Rope width: qk_head_dim - qk_nope_head_dim. head_dim is never used (GLM-5.2 ships head_dim 192).
    qk_head_dim = raw.get("qk_head_dim")
    raw_rope = raw.get("qk_rope_head_dim")
    if qk_head_dim is not None:
        rope = _get(raw, "qk_head_dim", int) - nope
        if rope <= 0:
            raise GLM5ConfigError(
                f"config field 'qk_head_dim': expected > qk_nope_head_dim ({nope}), found {qk_head_dim}"
            )
        if raw_rope is not None and raw_rope != rope:
            raise GLM5ConfigError(
                f"config fields 'qk_rope_head_dim' ({raw_rope}) and 'qk_head_dim' - 'qk_nope_head_dim' "
                f"({qk_head_dim} - {nope} = {rope}) disagree"
            )
    else:
        rope = _positive("qk_rope_head_dim", _get(raw, "qk_rope_head_dim", int))
    if rope % 2:
        raise GLM5ConfigError(f"RoPE width qk_head_dim - qk_nope_head_dim must be even, found {rope}")

    if not _get(raw, "rope_interleave", bool, True):
        raise GLM5ConfigError(
            "config field 'rope_interleave': expected true (megatron-core 0.19.2 applies interleaved RoPE in MLA "
            "unconditionally), found false"
        )
    theta, yarn = _resolve_rope(raw)

    heads = _positive("num_attention_heads", _get(raw, "num_attention_heads", int))
    index_head_dim = _positive("index_head_dim", _get(raw, "index_head_dim", int))
    if index_head_dim <= rope:
        raise GLM5ConfigError(
            f"config field 'index_head_dim': expected > the RoPE width {rope} (rope occupies its first {rope} dims), "
            f"found {index_head_dim}"
        )
    if _get(raw, "attention_bias", bool, False):
        raise GLM5ConfigError("config field 'attention_bias': expected false (GLM-5.x has no attention bias), found true")
    if _get(raw, "mlp_bias", bool, False):
        raise GLM5ConfigError("config field 'mlp_bias': expected false (GLM-5.x MLPs have no bias), found true")
    if not _get(raw, "indexer_rope_interleave", bool, True):
        raise GLM5ConfigError(
            "config field 'indexer_rope_interleave': expected true or absent (GLM-5.x indexers apply interleaved RoPE; "
            "a half-split indexer RoPE is DeepSeek-V3.2's), found false"
        )
    _check_layer_types(raw, num_layers)
    act = _get(raw, "hidden_act", str, "silu")
    if act != "silu":
        raise GLM5ConfigError(f"config field 'hidden_act': expected 'silu', found {act!r}")

    n_experts = raw.get("n_routed_experts")
    if n_experts is None:
        n_experts = raw.get("num_experts")  # older alias; n_routed_experts wins when both are present
        if n_experts is None:
            raise GLM5ConfigError("config field 'n_routed_experts' is required but missing")
    n_experts = _positive("n_routed_experts", int(n_experts))
    topk_experts = _positive("num_experts_per_tok", _get(raw, "num_experts_per_tok", int))
    if topk_experts > n_experts:
        raise GLM5ConfigError(
            f"config field 'num_experts_per_tok': expected <= n_routed_experts ({n_experts}), found {topk_experts}"
        )
    scoring = _get(raw, "scoring_func", str, "sigmoid")
    if scoring != "sigmoid":
        raise GLM5ConfigError(f"config field 'scoring_func': expected 'sigmoid', found {scoring!r}")
    topk_method = _get(raw, "topk_method", str, "noaux_tc")
    if topk_method != "noaux_tc":
        raise GLM5ConfigError(f"config field 'topk_method': expected 'noaux_tc', found {topk_method!r}")
    if not _get(raw, "norm_topk_prob", bool, True):
        raise GLM5ConfigError(
            "config field 'norm_topk_prob': expected true (megatron-core renormalises sigmoid top-k scores), found false"
        )
    router_dtype = raw.get("moe_router_dtype")
    if router_dtype not in (None, "float32", "fp32"):
        raise GLM5ConfigError(f"config field 'moe_router_dtype': expected 'float32', found {router_dtype!r}")
    n_group = _get(raw, "n_group", int, 1)
    topk_group = _get(raw, "topk_group", int, 1)
    if n_group < 1 or n_experts % n_group or not 1 <= topk_group <= n_group:
        raise GLM5ConfigError(
            f"config fields 'n_group'/'topk_group': expected n_group dividing n_routed_experts ({n_experts}) and "
            f"1 <= topk_group <= n_group, found n_group={n_group}, topk_group={topk_group}"
        )

    index_topk = _positive("index_topk", _get(raw, "index_topk", int))
    quant = raw.get("quantization_config")
    if quant is not None and quant.get("quant_method") not in ("fp8",):
        raise GLM5ConfigError(
            f"config field 'quantization_config.quant_method': expected 'fp8' (block-scaled), found {quant.get('quant_method')!r}"
        )
    mtp = _get(raw, "num_nextn_predict_layers", int, 0)
    if mtp < 0:
        raise GLM5ConfigError(f"config field 'num_nextn_predict_layers': expected >= 0, found {mtp}")

    return GLM5Architecture(
        model_type=model_type,
        vocab_size=_positive("vocab_size", _get(raw, "vocab_size", int)),
        hidden_size=_positive("hidden_size", _get(raw, "hidden_size", int)),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        intermediate_size=_positive("intermediate_size", _get(raw, "intermediate_size", int)),
        q_lora_rank=_positive("q_lora_rank", _get(raw, "q_lora_rank", int)),
        kv_lora_rank=_positive("kv_lora_rank", _get(raw, "kv_lora_rank", int)),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=_positive("v_head_dim", _get(raw, "v_head_dim", int)),
        rope_theta=theta,
        yarn=yarn,
        max_position_embeddings=_positive("max_position_embeddings", _get(raw, "max_position_embeddings", int)),
        index_n_heads=_positive("index_n_heads", _get(raw, "index_n_heads", int)),
        index_head_dim=index_head_dim,
        index_topk=index_topk,
        indexer_types=resolve_indexer_types(raw, num_layers),
        mlp_layer_types=_resolve_mlp_layer_types(raw, num_layers),  # type: ignore[arg-type]
        n_routed_experts=n_experts,
        n_shared_experts=_get(raw, "n_shared_experts", int, 0),
        num_experts_per_tok=topk_experts,
        moe_intermediate_size=_positive("moe_intermediate_size", _get(raw, "moe_intermediate_size", int)),
        routed_scaling_factor=_get(raw, "routed_scaling_factor", float, 1.0),
        n_group=n_group,
        topk_group=topk_group,
        num_nextn_predict_layers=mtp,
        rms_norm_eps=_get(raw, "rms_norm_eps", float, 1e-5),
        tie_word_embeddings=_get(raw, "tie_word_embeddings", bool, False),
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        quantization=quant,
    )
