"""GLM-5.x HF ``config.json`` -> megatron-core ``MLATransformerConfig`` kwargs.

The translation happens here and only here, in three visible steps:

1. :func:`parse_hf_config` reads the *raw* JSON dict (never an in-memory transformers config: transformers
   rewrites geometry fields such as ``head_dim`` and may shadow ``n_routed_experts`` with ``num_experts``) and
   validates it into a frozen :class:`GLM5Architecture` that describes the checkpoint and nothing else.
2. :func:`architecture_kwargs` maps the architecture 1:1 onto megatron-core field names (the table
   ``_DIRECT_FIELDS``) plus the derived fields (rope width, MoE layer pattern, IndexShare pattern, ...).
3. :func:`runtime_kwargs` maps a :class:`RuntimePolicy` (parallelism, dtype, recompute, kernels) onto the
   remaining fields. Architecture and policy never mix: the policy cannot change what the checkpoint is.

:func:`mcore_kwargs` merges the two and :func:`build_transformer_config` instantiates the megatron-core dataclass.
Everything is pure (no I/O except :func:`load_hf_config`, no globals, no distributed state).

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

import dataclasses
import functools
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import torch

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa",)
INDEXER_K_NORM_EPS = 1e-6  # hard-coded LayerNorm eps of the indexer k_norm in HF, sglang and vLLM

IndexerType = Literal["full", "shared"]


class GLM5ConfigError(ValueError):
    """A GLM-5.x ``config.json`` that cannot be translated; the message names the field."""


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
class GLM5Architecture:
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
    def qk_head_dim(self) -> int:
        """HF ``qk_head_dim`` = nope + rope (megatron-core calls the nope part ``qk_head_dim``)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * (_yarn_mscale(self.yarn) ** 2)

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def is_fp8(self) -> bool:
        return bool(self.quantization) and self.quantization.get("quant_method") == "fp8"


def _yarn_mscale(yarn: YarnParameters | None) -> float:
    if yarn is None or yarn.factor <= 1 or not yarn.mscale_all_dim:
        return 1.0
    return 0.1 * yarn.mscale_all_dim * math.log(yarn.factor) + 1.0


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """Read ``config.json`` (or the directory holding it) as a raw dict."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"HF config not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise GLM5ConfigError(f"{path}: not valid JSON ({e})") from e


def natural_key(name: str) -> list[Any]:
    """Sort key that orders HF tensor names as checkpoints store them (``layers.9`` before ``layers.10``)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


_MISSING = object()


def _get(raw: Mapping[str, Any], name: str, typ: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    value = raw.get(name, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise GLM5ConfigError(f"config field '{name}' is required for a GLM-5.x (glm_moe_dsa) config but is missing")
        return default
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and typ in (int, float):
        raise GLM5ConfigError(f"config field '{name}': expected {typ.__name__}, found bool {value!r}")
    if not isinstance(value, typ):
        names = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise GLM5ConfigError(f"config field '{name}': expected {names}, found {type(value).__name__} {value!r}")
    return value


def _positive(name: str, value: int) -> int:
    if value <= 0:
        raise GLM5ConfigError(f"config field '{name}': expected a positive integer, found {value}")
    return value


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
        types = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))
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
    derived = tuple(
        "sparse" if (i >= first_k and (i - first_k) % freq == 0) else "dense" for i in range(num_layers)
    )
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


# --------------------------------------------------------------------------------------------------------------------
# 2. Architecture -> megatron-core fields
# --------------------------------------------------------------------------------------------------------------------

# (HF / GLM5Architecture field, megatron-core field). Checked below for duplicate targets, so no field can be
# written twice (the first-wins shadowing bug of generic tables).
_DIRECT_FIELDS: tuple[tuple[str, str], ...] = (
    ("num_hidden_layers", "num_layers"),
    ("hidden_size", "hidden_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("intermediate_size", "ffn_hidden_size"),
    ("q_lora_rank", "q_lora_rank"),
    ("kv_lora_rank", "kv_lora_rank"),
    ("qk_nope_head_dim", "qk_head_dim"),  # naming trap: megatron's qk_head_dim is HF's nope part
    ("qk_rope_head_dim", "qk_pos_emb_head_dim"),
    ("v_head_dim", "v_head_dim"),
    ("rope_theta", "rotary_base"),
    ("rms_norm_eps", "layernorm_epsilon"),
    ("index_n_heads", "dsa_indexer_n_heads"),
    ("index_head_dim", "dsa_indexer_head_dim"),
    ("index_topk", "dsa_indexer_topk"),
    ("n_routed_experts", "num_moe_experts"),
    ("num_experts_per_tok", "moe_router_topk"),
    ("moe_intermediate_size", "moe_ffn_hidden_size"),
    ("routed_scaling_factor", "moe_router_topk_scaling_factor"),
)
_targets = [t for _, t in _DIRECT_FIELDS]
assert len(_targets) == len(set(_targets)), "duplicate megatron-core target in _DIRECT_FIELDS"

# Fixed GLM-5.x numerics that are not stored in config.json.
_GLM5_CONSTANTS: dict[str, Any] = dict(
    multi_latent_attention=True,
    normalization="RMSNorm",
    qk_layernorm=True,
    add_bias_linear=False,
    add_qkv_bias=False,
    gated_linear_unit=True,
    activation_func=torch.nn.functional.silu,
    apply_rope_fusion=False,  # megatron-core asserts this for DSA
    experimental_attention_variant="dsa",
    dsa_indexer_rope_interleaved=True,  # checked by parse_hf_config (absent or true)
    dsa_indexer_rotate_activation=False,  # no Hadamard in GLM-5.x
    dsa_indexer_scoring_relu=True,
    dsa_indexer_k_norm_epsilon=INDEXER_K_NORM_EPS,
    dsa_indexer_k_norm_fp32=True,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,  # e_score_correction_bias
    moe_router_pre_softmax=True,
    moe_router_dtype="fp32",
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def indexer_share_schedule(indexer_types: tuple[str, ...]) -> tuple[int, int] | None:
    """(freq, offset) in megatron-core's ``dsa_indexer_topk_freq``/``dsa_indexer_skip_topk_offset`` convention if
    the pattern is expressible that way, else None. Kept on the config for tools that read it (FLOP counters);
    our spec always uses the explicit per-layer pattern."""
    n = len(indexer_types)
    if all(t == "full" for t in indexer_types):
        return 1, 0
    for freq in range(2, n + 1):
        for offset in range(0, n + 1):
            off = max(offset, 1)
            pattern = tuple("shared" if max(layer - off, 0) % freq else "full" for layer in range(1, n + 1))
            if pattern == indexer_types:
                return freq, offset
    return None


def architecture_kwargs(arch: GLM5Architecture) -> dict[str, Any]:
    """megatron-core ``MLATransformerConfig`` kwargs that describe the checkpoint (no runtime policy)."""
    kw: dict[str, Any] = {mcore: getattr(arch, hf) for hf, mcore in _DIRECT_FIELDS}
    kw.update(_GLM5_CONSTANTS)
    kw["moe_layer_freq"] = [1 if t == "sparse" else 0 for t in arch.mlp_layer_types]
    kw["moe_shared_expert_intermediate_size"] = (
        arch.moe_intermediate_size * arch.n_shared_experts if arch.n_shared_experts else None
    )
    if arch.n_group > 1:
        kw["moe_router_num_groups"] = arch.n_group
        kw["moe_router_group_topk"] = arch.topk_group
    kw["mtp_num_layers"] = arch.num_nextn_predict_layers or None
    schedule = indexer_share_schedule(arch.indexer_types)
    freq, offset = schedule if schedule is not None else (1, 0)
    kw["dsa_indexer_topk_freq"] = freq
    kw["dsa_indexer_skip_topk_offset"] = offset
    if arch.yarn is None:
        kw.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    else:
        y = arch.yarn
        kw.update(
            rope_type="yarn",
            rotary_scaling_factor=y.factor,
            original_max_position_embeddings=y.original_max_position_embeddings,
            beta_fast=y.beta_fast,
            beta_slow=y.beta_slow,
            mscale=y.mscale,
            mscale_all_dim=y.mscale_all_dim,
        )
    return kw


# --------------------------------------------------------------------------------------------------------------------
# 3. Runtime policy -> megatron-core fields
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RuntimeEnvironment:
    """What the machine offers, as far as the runtime policy's ``"auto"`` choices are concerned."""

    cuda: bool
    mcore_tilelang_kernels: bool  # megatron-core's TileLang DSA kernels (lighting_indexer, SparseMLA) importable
    apex_gradient_accumulation_fusion: bool  # apex's fused_weight_gradient_mlp_cuda importable
    transformer_engine: bool = False  # Transformer Engine importable

    @classmethod
    @functools.cache
    def detect(cls) -> "RuntimeEnvironment":
        cuda = torch.cuda.is_available()
        kernels = False
        if cuda:
            from .compat import missing_tilelang_dsa_kernel_dependencies

            kernels = not missing_tilelang_dsa_kernel_dependencies()
        try:
            import fused_weight_gradient_mlp_cuda  # noqa: F401  (apex)

            gaf = cuda
        except ImportError:
            gaf = False
        from megatron.core.extensions.transformer_engine import HAVE_TE

        return cls(cuda=cuda, mcore_tilelang_kernels=kernels, apex_gradient_accumulation_fusion=gaf,
                   transformer_engine=HAVE_TE)


@dataclass(kw_only=True, slots=True)
class RuntimePolicy:
    """How to run the model: parallelism, precision, recompute, kernels. Never changes what the model is.

    ``dsa_kernel_backend="auto"``, ``fusions=None`` and ``moe_grouped_gemm="auto"`` are decided by
    :func:`resolve_policy` for the machine: on CUDA megatron-core's fused TileLang DSA kernels (when importable and the
    model is bf16), megatron-core's torch fusions (bias-SwiGLU, bias-dropout-add; apex's gradient-accumulation fusion
    when installed) and, for bf16 without Transformer Engine, grouped-GEMM routed experts
    (:class:`~megatron_glm5.moe.grouped_experts.TorchGroupedMLP`, same parameters and checkpoint layout as
    ``SequentialMLP``); on CPU the torch paths and ``SequentialMLP``. The choice is logged. With Transformer Engine
    ``"auto"`` keeps ``SequentialMLP`` (LoRA adapts it); ``"on"`` then selects megatron-core's ``TEGroupedMLP``."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool | None = None  # None: on when TP > 1 (AbsorbedMLA requires it)
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    params_dtype: torch.dtype = torch.bfloat16
    dsa_kernel_backend: Literal["auto", "none", "tilelang", "cudnn"] = "auto"
    fusions: bool | None = None  # megatron-core fusions that need no TE/apex; None: on with CUDA
    # Indexer training (megatron_glm5.dsa.indexer_training): coeff 0 leaves the indexer as loaded (RL / LoRA);
    # the sparse stage trains it over the selected keys; the warm-up (dense stage) trains only the indexers, with the
    # dense loss and dense main attention (coeff 0 there means 1.0).
    dsa_indexer_loss_coeff: float = 0.0
    dsa_indexer_use_sparse_loss: bool = False
    dsa_indexer_warmup: bool = False
    recompute_granularity: Literal["full", "selective"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = None
    recompute_modules: list[str] | None = None
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "allgather"
    moe_grouped_gemm: Literal["auto", "on", "off"] = "auto"  # megatron-core's; "auto": CUDA + bf16, no TE
    moe_aux_loss_coeff: float = 0.0
    moe_router_load_balancing_type: str = "none"
    moe_router_bias_update_rate: float = 0.0  # RL keeps the expert bias frozen
    use_cpu_initialization: bool = False
    perform_initialization: bool = True
    init_model_with_meta_device: bool = False
    deterministic_mode: bool = False
    # Per-layer saved-tensor offload to pinned host memory (megatron_glm5.offload), applied by our layers and
    # translated by offload.activation_offload_for; never megatron-core's fine_grained_activation_offloading, whose
    # manager needs CUDA streams and Transformer Engine and never reaches DSA attention.
    activation_offload: bool = False
    activation_offload_min_numel: int = 1 << 20  # smaller storages stay on the device (elements)
    activation_offload_shard_topk: bool = True  # TP ranks keep 1/TP of the (replicated) DSA top-k on the host

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                     "context_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"RuntimePolicy.{name}: expected >= 1, got {getattr(self, name)}")
        if self.params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"RuntimePolicy.params_dtype: expected float32/bfloat16/float16, got {self.params_dtype}")
        if self.sequence_parallel is False and self.tensor_model_parallel_size > 1:
            raise ValueError(
                "RuntimePolicy.sequence_parallel=False with tensor_model_parallel_size > 1: megatron-core's "
                "AbsorbedMLA requires sequence parallelism under TP; leave it None or True"
            )
        if self.dsa_indexer_loss_coeff < 0:
            raise ValueError(f"RuntimePolicy.dsa_indexer_loss_coeff: expected >= 0, got {self.dsa_indexer_loss_coeff}")
        if self.dsa_indexer_warmup and self.dsa_indexer_use_sparse_loss:
            raise ValueError("RuntimePolicy: the indexer warm-up (dsa_indexer_warmup=True) trains with the dense loss; "
                             "dsa_indexer_use_sparse_loss=True is the sparse stage that follows it")
        if self.moe_grouped_gemm not in ("auto", "on", "off"):
            raise ValueError(
                f"RuntimePolicy.moe_grouped_gemm: expected 'auto', 'on' or 'off', got {self.moe_grouped_gemm!r}"
            )
        if self.activation_offload_min_numel < 0:
            raise ValueError(
                f"RuntimePolicy.activation_offload_min_numel: expected >= 0, got {self.activation_offload_min_numel}")


_log = logging.getLogger("megatron_glm5")
_logged: set[str] = set()  # each distinct resolution is logged once per process


def resolve_policy(policy: RuntimePolicy, env: RuntimeEnvironment | None = None) -> RuntimePolicy:
    """``policy`` with its ``"auto"`` choices made for ``env`` (detected when None) and logged."""
    if policy.dsa_kernel_backend != "auto" and policy.fusions is not None and policy.moe_grouped_gemm != "auto":
        return policy
    env = env or RuntimeEnvironment.detect()
    backend = policy.dsa_kernel_backend
    if backend == "auto":
        backend = "tilelang" if (env.mcore_tilelang_kernels and policy.params_dtype == torch.bfloat16) else "none"
    fusions = env.cuda if policy.fusions is None else policy.fusions
    grouped = policy.moe_grouped_gemm
    if grouped == "auto":  # TorchGroupedMLP: torch's grouped_mm runs bf16 on CUDA (elsewhere it would loop anyway);
        # deterministic_mode keeps SequentialMLP, whose bitwise run-to-run equality is what was verified on the GPU
        grouped = ("on" if env.cuda and policy.params_dtype == torch.bfloat16 and not env.transformer_engine
                   and not policy.deterministic_mode else "off")
    resolved = dataclasses.replace(policy, dsa_kernel_backend=backend, fusions=fusions, moe_grouped_gemm=grouped)
    why = ("CUDA, megatron-core TileLang DSA kernels importable, bf16" if backend == "tilelang"
           else "no CUDA" if not env.cuda else "no megatron-core TileLang DSA kernels" if not env.mcore_tilelang_kernels
           else f"params_dtype {policy.params_dtype} (the fused kernels are bf16-only)")
    message = (f"megatron-glm5 runtime: dsa_kernel_backend={backend!r} ({why}), torch fusions "
               f"{'on' if fusions else 'off'}, apex gradient-accumulation fusion "
               f"{'on' if fusions and env.apex_gradient_accumulation_fusion else 'off'}, grouped-GEMM experts "
               f"{grouped}")
    if message not in _logged:
        _logged.add(message)
        _log.info(message)
    return resolved


def runtime_kwargs(policy: RuntimePolicy, env: RuntimeEnvironment | None = None) -> dict[str, Any]:
    """megatron-core kwargs for how the model runs (``"auto"`` choices resolved by :func:`resolve_policy`)."""
    env = env or RuntimeEnvironment.detect()
    policy = resolve_policy(policy, env)
    gaf = bool(policy.fusions) and env.apex_gradient_accumulation_fusion
    tp = policy.tensor_model_parallel_size
    kw: dict[str, Any] = dict(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=policy.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=policy.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=policy.expert_model_parallel_size,
        expert_tensor_parallel_size=policy.expert_tensor_parallel_size,
        context_parallel_size=policy.context_parallel_size,
        sequence_parallel=tp > 1 if policy.sequence_parallel is None else policy.sequence_parallel,
        num_layers_in_first_pipeline_stage=policy.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=policy.num_layers_in_last_pipeline_stage,
        params_dtype=policy.params_dtype,
        pipeline_dtype=policy.params_dtype,  # dtype of tensors sent between pipeline stages
        bf16=policy.params_dtype == torch.bfloat16,
        fp16=policy.params_dtype == torch.float16,
        dsa_kernel_backend=policy.dsa_kernel_backend,
        dsa_indexer_loss_coeff=policy.dsa_indexer_loss_coeff or (1.0 if policy.dsa_indexer_warmup else None),
        dsa_indexer_use_sparse_loss=policy.dsa_indexer_use_sparse_loss,
        recompute_granularity=policy.recompute_granularity,
        recompute_method=policy.recompute_method,
        recompute_num_layers=policy.recompute_num_layers,
        moe_token_dispatcher_type=policy.moe_token_dispatcher_type,
        moe_grouped_gemm=policy.moe_grouped_gemm == "on",
        moe_aux_loss_coeff=policy.moe_aux_loss_coeff,
        moe_router_load_balancing_type=policy.moe_router_load_balancing_type,
        moe_router_bias_update_rate=policy.moe_router_bias_update_rate,
        use_cpu_initialization=policy.use_cpu_initialization,
        perform_initialization=policy.perform_initialization,
        init_model_with_meta_device=policy.init_model_with_meta_device,
        deterministic_mode=policy.deterministic_mode,
        cp_comm_type="allgather" if policy.context_parallel_size > 1 else "p2p",
        transformer_impl="transformer_engine" if env.transformer_engine else "local",
        # megatron-core's own (torch / jit) fusions with CUDA; apex's only when installed; never TE-only ones.
        gradient_accumulation_fusion=gaf,
        masked_softmax_fusion=False,  # DSA has no dense softmax
        bias_activation_fusion=bool(policy.fusions),
        bias_dropout_fusion=bool(policy.fusions),
        persist_layer_norm=False,  # apex; our norms are torch modules
    )
    if policy.recompute_modules is not None:
        kw["recompute_modules"] = list(policy.recompute_modules)
    return kw


def mcore_kwargs(arch: GLM5Architecture, policy: RuntimePolicy | None = None) -> dict[str, Any]:
    """All ``MLATransformerConfig`` kwargs: the architecture's, then the policy's (disjoint key sets)."""
    a = architecture_kwargs(arch)
    r = runtime_kwargs(policy or RuntimePolicy())
    overlap = set(a) & set(r)
    assert not overlap, f"architecture and runtime kwargs overlap: {sorted(overlap)}"
    return {**a, **r}


def build_transformer_config(arch: GLM5Architecture, policy: RuntimePolicy | None = None):
    """Instantiate megatron-core's ``MLATransformerConfig`` (its own validation runs in ``__post_init__``)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(**mcore_kwargs(arch, policy))


def gpt_model_kwargs(arch: GLM5Architecture) -> dict[str, Any]:
    """Kwargs for megatron-core ``GPTModel`` that come from the checkpoint."""
    return dict(
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",  # MLA applies its own RoPE; GPTModel builds none for MLA
    )
