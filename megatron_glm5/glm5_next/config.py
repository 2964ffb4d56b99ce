"""GLM-5.3-Flash (HF ``glm5_next``) ``config.json`` -> frozen :class:`GLM5NextArchitecture`.

Reads the *raw* JSON dict, never an in-memory transformers config, and describes the checkpoint's text model and
nothing else (no runtime policy, no megatron-core fields yet). Accepted layouts:

* the released vision-language checkpoint: ``model_type: "glm5_next"`` with a nested ``text_config`` (and a
  ``vision_config``, carried opaquely);
* a flat text config: ``model_type: "glm5_next"`` with the text fields at the top level (transformers forwards them
  into ``text_config``), or ``model_type: "glm5_next_text"`` as ``Glm5NextTextConfig.save_pretrained`` writes it.

Defaults are transformers 5.24's (``configuration_glm5_next.py``) for every field a config may omit, with one
deliberate exception: ``index_kpool`` is required. transformers defaults it to 16, while every third-party reader of
the released checkpoint reports 4, and the pool size fixes the indexer's parameter shapes and its top-k width.

Traps handled here (each one found in transformers 5.24 or the released config):

* NoPE: ``qk_rope_head_dim`` must be 0 (transformers rejects > 0 too). ``head_dim`` is ignored: transformers
  overwrites it with the rope width, so a saved config carries ``head_dim: 0``; the attention head width is
  ``qk_nope_head_dim + qk_rope_head_dim`` (``qk_head_dim``).
* ``layer_types`` uses ``"linear_attention"`` (KDA) and ``"indexed_attention"`` (NoPE MLA + KPool DSA); the old
  name ``"full_attention"`` means ``"indexed_attention"``. Default: DSA iff ``layer % 4 == 3``.
* ``indexer_types`` has an entry for every layer but only DSA layers read theirs. Legacy ``index_topk_pattern`` /
  ``index_topk_freq`` / ``index_skip_topk_offset`` derive it when absent (default: all ``"full"``).
* Legacy ``linear_attn_config`` {head_dim, num_heads, short_conv_kernel_size, gate_lower_bound, safe_gate} overrides
  the ``linear_*`` fields, as transformers does.
* Hard-coded eps values are not in the JSON: indexer ``k_norm`` LayerNorm 1e-6, KDA q/k l2-norm 1e-6, router
  top-k renormalisation 1e-20. ``rms_norm_eps`` also covers the MLA ``q_a``/``kv_a`` norms (GLM-5's HF code
  hard-codes 1e-6 there), the KDA output norm and the (weightless) mHC input norm; ``hc_eps`` is only the Sinkhorn /
  mixing floor.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from ..core.hf_config import INDEXER_K_NORM_EPS, MISSING, GLM5ConfigError, MLAGeometry, get_field
from ..core.patterns import indexshare_types, moe_pattern

SUPPORTED_MODEL_TYPES = ("glm5_next", "glm5_next_text")
TEXT_MODEL_TYPE = "glm5_next_text"

LayerType = Literal["linear_attention", "indexed_attention"]
MlpLayerType = Literal["dense", "sparse"]
IndexerType = Literal["full", "shared"]

# Numerics that transformers 5.24 hard-codes (they are not config fields).
# INDEXER_K_NORM_EPS (core): Glm5NextTextIndexer.k_norm = nn.LayerNorm(index_head_dim, eps=1e-6), affine with bias
KDA_QK_L2NORM_EPS = 1e-6  # x / sqrt(sum(x^2) + eps) on KDA q and k, per head, fp32
ROUTER_NORM_EPS = 1e-20  # top-k weights / (sum + eps) when norm_topk_prob

_MISSING = MISSING
FAMILY = "GLM-5.3-Flash (glm5_next)"


@dataclass(frozen=True, kw_only=True, slots=True)
class GLM5NextArchitecture(MLAGeometry):
    """What a GLM-5.3-Flash checkpoint's text model is. Field names follow HF; per-layer lists are tuples of
    ``num_hidden_layers`` entries, 0-indexed."""

    model_type: str  # of the file read: "glm5_next" (nested or flat) or "glm5_next_text"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int  # the MTP layer is not counted
    layer_types: tuple[LayerType, ...]
    mlp_layer_types: tuple[MlpLayerType, ...]
    # NoPE MLA (DSA layers)
    num_attention_heads: int
    num_key_value_heads: int  # always == num_attention_heads
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # always 0
    v_head_dim: int
    attention_bias: bool  # q_a_proj, kv_a_proj_with_mqa and o_proj
    attention_dropout: float
    max_position_embeddings: int  # unused by the (position-free) text model
    # KPool DSA indexer
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    index_kpool: int
    index_kpool_always_select_tail: bool
    indexer_types: tuple[IndexerType, ...]  # read by DSA layers only
    # KDA (linear-attention layers)
    linear_head_dim: int
    linear_num_heads: int
    linear_conv_kernel_dim: int
    linear_lower_bound: float | None  # None: softplus decay instead of the "safe gate"
    # mHC
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    # FFN / MoE
    hidden_act: str  # "silu": the SwiGLU activation and the KDA short-conv activation
    swiglu_limit: float
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    router_aux_loss_coef: float
    # misc
    num_nextn_predict_layers: int  # MTP layers; not a transformers field (HF drops layer 45), default 0
    index_share_for_mtp_iteration: bool | int | None  # read by llama.cpp from the released config; carried as is
    rms_norm_eps: float
    tie_word_embeddings: bool
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | tuple[int, ...] | None
    torch_dtype: str | None = None
    # hard-coded numerics (module constants above), kept here so consumers read them from one object
    indexer_k_norm_eps: float = INDEXER_K_NORM_EPS
    kda_qk_l2norm_eps: float = KDA_QK_L2NORM_EPS
    router_norm_eps: float = ROUTER_NORM_EPS
    # opaque sub-configs, read-only views of copies
    vision_config: Mapping[str, Any] | None = field(default=None, compare=False)
    quantization: Mapping[str, Any] | None = field(default=None, compare=False)

    # ---- derived geometry ----

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5`` (1/16); no yarn mscale."""
        return self.qk_head_dim**-0.5

    @property
    def absorbed_qk_dim(self) -> int:
        """Width of q and k in the absorbed (latent) form: ``kv_lora_rank + qk_rope_head_dim`` (512; GLM-5: 576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def absorbed_v_dim(self) -> int:
        """Width of v in the absorbed form: ``kv_lora_rank`` (512)."""
        return self.kv_lora_rank

    @property
    def pool_topk(self) -> int:
        """Pools selected per query: ``index_topk // index_kpool``."""
        return self.index_topk // self.index_kpool

    @property
    def topk_width(self) -> int:
        """Width of the indexer's int32 output: ``index_topk`` + the tail's ``index_kpool - 1`` slots if on."""
        return self.index_topk + (self.index_kpool - 1 if self.index_kpool_always_select_tail else 0)

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def kda_dim(self) -> int:
        """Width of each of KDA's q, k and v: ``linear_num_heads * linear_head_dim``."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def mhc_fn_rows(self) -> int:
        """Rows of an mHC ``fn`` matrix: pre (N) + post (N) + N x N mixing."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def mla_norm_eps(self) -> float:
        """eps of ``q_a_layernorm`` / ``kv_a_layernorm`` (``rms_norm_eps``; GLM-5's HF code hard-codes 1e-6)."""
        return self.rms_norm_eps

    @property
    def mhc_norm_eps(self) -> float:
        """eps of the weightless RMS norm over the ``hc_mult * hidden_size`` flattened streams (not ``hc_eps``)."""
        return self.rms_norm_eps

    @property
    def kda_o_norm_eps(self) -> float:
        return self.rms_norm_eps

    # ---- per-layer views ----

    @property
    def dsa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "indexed_attention")

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def dense_mlp_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "dense")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "sparse")

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        """DSA layers that run their own indexer (and own ``indexer.*`` weights)."""
        return tuple(i for i in self.dsa_layers if self.indexer_types[i] == "full")

    def indexer_source(self, layer: int) -> int:
        """The DSA layer whose top-k ``layer`` uses: itself if "full", else the nearest earlier "full" DSA layer.

        transformers 5.24 passes top-k only from the directly preceding decoder layer (a KDA layer passes None), so
        it can run a "shared" layer only right after a "full" DSA layer; this property gives the intended source."""
        if self.layer_types[layer] != "indexed_attention":
            raise ValueError(f"layer {layer} is a {self.layer_types[layer]!r} layer and has no indexer")
        for i in range(layer, -1, -1):
            if self.layer_types[i] == "indexed_attention" and self.indexer_types[i] == "full":
                return i
        raise AssertionError("unreachable: parse_glm5_next_config checks every shared DSA layer has a source")


# --------------------------------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------------------------------


def _get(raw: Mapping[str, Any], name: str, typ: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    return get_field(raw, name, typ, default, family=FAMILY)


def _nullable(raw: Mapping[str, Any], name: str, typ: type, default: Any) -> Any:
    """A field where an explicit null is a value (not "use the default")."""
    if name not in raw:
        return default
    return None if raw[name] is None else _get(raw, name, typ)


def _positive(raw: Mapping[str, Any], name: str, default: Any = _MISSING) -> int:
    value = _get(raw, name, int, default)
    if value <= 0:
        raise GLM5ConfigError(f"config field '{name}': expected a positive integer, found {value}")
    return value


def text_config_of(raw: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """``(model_type, text fields)`` of a raw glm5_next config: the nested ``text_config`` if there is one, else the
    top level (flat text config)."""
    if not isinstance(raw, Mapping):
        raise GLM5ConfigError(f"config: expected a JSON object, found {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise GLM5ConfigError(
            f"config field 'model_type': expected one of {list(SUPPORTED_MODEL_TYPES)}, found {model_type!r}"
        )
    text = raw.get("text_config")
    if text is None:
        return model_type, raw
    if model_type != "glm5_next":
        raise GLM5ConfigError(
            f"config field 'text_config': only a 'glm5_next' config nests one, found it in a {model_type!r} config"
        )
    if not isinstance(text, Mapping):
        raise GLM5ConfigError(f"config field 'text_config': expected a JSON object, found {type(text).__name__}")
    inner = text.get("model_type", TEXT_MODEL_TYPE)
    if inner != TEXT_MODEL_TYPE:
        raise GLM5ConfigError(f"config field 'text_config.model_type': expected {TEXT_MODEL_TYPE!r}, found {inner!r}")
    return model_type, text


def _layer_types(text: Mapping[str, Any], n: int) -> tuple[LayerType, ...]:
    raw_types = text.get("layer_types")
    if raw_types is None:
        return tuple("indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n))
    types_ = _checked_list(raw_types, "layer_types", n, ("linear_attention", "indexed_attention", "full_attention"))
    # transformers renames the old "full_attention" to "indexed_attention" (configuration_glm5_next.py)
    return tuple("indexed_attention" if t == "full_attention" else t for t in types_)  # type: ignore[misc]


def _mlp_layer_types(text: Mapping[str, Any], n: int) -> tuple[MlpLayerType, ...]:
    raw_types = text.get("mlp_layer_types")
    if raw_types is None:
        return moe_pattern(n, 3, 1)  # transformers' default: the first 3 layers dense
    return _checked_list(raw_types, "mlp_layer_types", n, ("dense", "sparse"))  # type: ignore[return-value]


def _indexer_types(text: Mapping[str, Any], n: int) -> tuple[IndexerType, ...]:
    explicit = text.get("indexer_types")
    if explicit is not None:
        return _checked_list(explicit, "indexer_types", n, ("full", "shared"))  # type: ignore[return-value]
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            bad = sorted(set(pattern) - {"F", "S"})
            if bad:
                raise GLM5ConfigError(
                    f"config field 'index_topk_pattern': expected only 'F'/'S' characters, found {bad[0]!r}"
                )
            pattern = ["full" if c == "F" else "shared" for c in pattern]
        return _checked_list(pattern, "index_topk_pattern", n, ("full", "shared"))  # type: ignore[return-value]
    # transformers: freq = max(freq, 1); layer i is full iff max(i - offset + 1, 0) % freq == 0 (defaults: all full)
    freq = max(_get(text, "index_topk_freq", int, 1), 1)
    offset = _get(text, "index_skip_topk_offset", int, 2)
    return indexshare_types(n, freq, offset)


def _checked_list(value: Any, name: str, n: int, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise GLM5ConfigError(f"config field '{name}': expected a list of {n} entries, found {type(value).__name__}")
    if len(value) != n:
        raise GLM5ConfigError(
            f"config field '{name}': expected {n} entries (num_hidden_layers), found {len(value)}"
        )
    for i, v in enumerate(value):
        if v not in allowed:
            raise GLM5ConfigError(f"config field '{name}[{i}]': expected one of {list(allowed)}, found {v!r}")
    return tuple(value)


def _check_shared_sources(layer_types: tuple[str, ...], indexer_types: tuple[str, ...]) -> None:
    seen_full = False
    for i, (lt, it) in enumerate(zip(layer_types, indexer_types)):
        if lt != "indexed_attention":
            continue
        if it == "full":
            seen_full = True
        elif not seen_full:
            raise GLM5ConfigError(
                f"config field 'indexer_types[{i}]': DSA layer {i} reuses the top-k of an earlier 'full' DSA layer "
                f"but there is none; expected 'full', found 'shared'"
            )


def _linear_attention(text: Mapping[str, Any]) -> tuple[int, int, int, float | None]:
    head_dim = _positive(text, "linear_head_dim", 128)
    num_heads = _positive(text, "linear_num_heads", 64)
    kernel = _positive(text, "linear_conv_kernel_dim", 4)
    lower = _nullable(text, "linear_lower_bound", float, -5.0)
    legacy = text.get("linear_attn_config")
    if legacy is not None:  # transformers lets the legacy dict override the flat fields
        if not isinstance(legacy, Mapping):
            raise GLM5ConfigError(
                f"config field 'linear_attn_config': expected a JSON object, found {type(legacy).__name__}"
            )
        head_dim = _positive(legacy, "head_dim", head_dim)
        num_heads = _positive(legacy, "num_heads", num_heads)
        kernel = _positive(legacy, "short_conv_kernel_size", kernel)
        lower = _nullable(legacy, "gate_lower_bound", float, lower)
        if _get(legacy, "safe_gate", bool, True) and lower is None:
            lower = -5.0
    if lower is not None and not lower < 0:
        raise GLM5ConfigError(
            f"config field 'linear_lower_bound': expected a negative float (log-decay in (bound, 0)) or null, "
            f"found {lower}"
        )
    return head_dim, num_heads, kernel, lower


def _token_ids(text: Mapping[str, Any]) -> tuple[int | None, int | None, int | tuple[int, ...] | None]:
    pad = _nullable(text, "pad_token_id", int, 154820)
    bos = _get(text, "bos_token_id", int, None)
    eos = text.get("eos_token_id")
    if isinstance(eos, list):
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
            raise GLM5ConfigError(f"config field 'eos_token_id': expected int or list of int, found {eos!r}")
        eos = tuple(eos)
    elif eos is not None:
        eos = _get(text, "eos_token_id", int)
    return pad, bos, eos


def _frozen_copy(value: Any, name: str) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise GLM5ConfigError(f"config field '{name}': expected a JSON object, found {type(value).__name__}")
    return types.MappingProxyType(copy.deepcopy(dict(value)))


def parse_glm5_next_config(raw: Mapping[str, Any]) -> GLM5NextArchitecture:
    """Validate a raw GLM-5.3-Flash ``config.json`` dict (nested or flat) into a :class:`GLM5NextArchitecture`.

    Raises :class:`~megatron_glm5.config.GLM5ConfigError` naming the field, the expected and the found value."""
    model_type, text = text_config_of(raw)
    n = _positive(text, "num_hidden_layers")

    # ---- NoPE MLA ----
    nope = _positive(text, "qk_nope_head_dim")
    rope = _get(text, "qk_rope_head_dim", int, 0)
    if rope != 0:
        raise GLM5ConfigError(
            f"config field 'qk_rope_head_dim': expected 0 (GLM-5.3-Flash attention has no RoPE), found {rope}"
        )
    qk_head_dim = text.get("qk_head_dim")
    if qk_head_dim is not None and qk_head_dim != nope + rope:
        raise GLM5ConfigError(
            f"config field 'qk_head_dim': expected qk_nope_head_dim + qk_rope_head_dim = {nope + rope}, "
            f"found {qk_head_dim}"
        )
    heads = _positive(text, "num_attention_heads")
    kv_heads = _positive(text, "num_key_value_heads", heads)
    if kv_heads != heads:
        raise GLM5ConfigError(
            f"config field 'num_key_value_heads': expected num_attention_heads ({heads}), found {kv_heads}"
        )

    # ---- KPool indexer ----
    if "index_kpool" not in text:
        raise GLM5ConfigError(
            "config field 'index_kpool' is required but missing: transformers would default it to 16, while the "
            "released GLM-5.3-Flash reportedly uses 4; set it explicitly"
        )
    kpool = _positive(text, "index_kpool")
    index_topk = _positive(text, "index_topk")
    if index_topk % kpool:
        raise GLM5ConfigError(
            f"config field 'index_topk': expected a multiple of index_kpool ({kpool}), found {index_topk}"
        )

    # ---- layer schedule ----
    layer_types = _layer_types(text, n)
    mlp_layer_types = _mlp_layer_types(text, n)
    indexer_types = _indexer_types(text, n)
    _check_shared_sources(layer_types, indexer_types)

    # ---- FFN / MoE ----
    act = _get(text, "hidden_act", str, "silu")
    if act != "silu":
        raise GLM5ConfigError(f"config field 'hidden_act': expected 'silu', found {act!r}")
    swiglu_limit = _get(text, "swiglu_limit", float, 10.0)
    if not swiglu_limit > 0:
        raise GLM5ConfigError(f"config field 'swiglu_limit': expected a positive float, found {swiglu_limit}")
    n_experts = text.get("n_routed_experts")
    alias = text.get("num_local_experts")  # transformers' attribute_map alias
    if n_experts is not None and alias is not None and n_experts != alias:
        raise GLM5ConfigError(
            f"config fields 'n_routed_experts' ({n_experts}) and 'num_local_experts' ({alias}) disagree; "
            "expected one value"
        )
    n_experts = _positive(text, "n_routed_experts" if n_experts is not None else "num_local_experts")
    topk_experts = _positive(text, "num_experts_per_tok")
    if topk_experts > n_experts:
        raise GLM5ConfigError(
            f"config field 'num_experts_per_tok': expected <= n_routed_experts ({n_experts}), found {topk_experts}"
        )
    n_group = _positive(text, "n_group", 1)
    topk_group = _positive(text, "topk_group", 1)
    if n_experts % n_group or topk_group > n_group:
        raise GLM5ConfigError(
            f"config fields 'n_group'/'topk_group': expected n_group dividing n_routed_experts ({n_experts}) and "
            f"topk_group <= n_group, found n_group={n_group}, topk_group={topk_group}"
        )

    n_shared = _get(text, "n_shared_experts", int, 1)
    if n_shared < 0:
        raise GLM5ConfigError(f"config field 'n_shared_experts': expected >= 0, found {n_shared}")

    # ---- mHC ----
    hc_mult = _positive(text, "hc_mult", 4)
    hc_eps = _get(text, "hc_eps", float, 1e-6)
    if not hc_eps > 0:
        raise GLM5ConfigError(f"config field 'hc_eps': expected a positive float, found {hc_eps}")
    hc_iters = _positive(text, "hc_sinkhorn_iters", 20)

    mtp = _get(text, "num_nextn_predict_layers", int, 0)
    if mtp < 0:
        raise GLM5ConfigError(f"config field 'num_nextn_predict_layers': expected >= 0, found {mtp}")

    tie = _get(text, "tie_word_embeddings", bool, False)
    if text is not raw and "tie_word_embeddings" in raw and _get(raw, "tie_word_embeddings", bool) != tie:
        raise GLM5ConfigError(
            f"config fields 'tie_word_embeddings' ({raw['tie_word_embeddings']}) and "
            f"'text_config.tie_word_embeddings' ({tie}) disagree; expected one value"
        )
    rms_eps = _get(text, "rms_norm_eps", float, 1e-5)
    if not rms_eps > 0:
        raise GLM5ConfigError(f"config field 'rms_norm_eps': expected a positive float, found {rms_eps}")
    linear_head_dim, linear_heads, conv_kernel, lower_bound = _linear_attention(text)
    pad, bos, eos = _token_ids(text)

    return GLM5NextArchitecture(
        model_type=model_type,
        vocab_size=_positive(text, "vocab_size"),
        hidden_size=_positive(text, "hidden_size"),
        num_hidden_layers=n,
        layer_types=layer_types,
        mlp_layer_types=mlp_layer_types,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        q_lora_rank=_positive(text, "q_lora_rank"),
        kv_lora_rank=_positive(text, "kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=_positive(text, "v_head_dim"),
        attention_bias=_get(text, "attention_bias", bool, False),
        attention_dropout=_get(text, "attention_dropout", float, 0.0),
        max_position_embeddings=_positive(text, "max_position_embeddings", 1048576),
        index_topk=index_topk,
        index_head_dim=_positive(text, "index_head_dim"),
        index_n_heads=_positive(text, "index_n_heads"),
        index_kpool=kpool,
        index_kpool_always_select_tail=_get(text, "index_kpool_always_select_tail", bool, True),
        indexer_types=indexer_types,
        linear_head_dim=linear_head_dim,
        linear_num_heads=linear_heads,
        linear_conv_kernel_dim=conv_kernel,
        linear_lower_bound=lower_bound,
        hc_mult=hc_mult,
        hc_eps=hc_eps,
        hc_sinkhorn_iters=hc_iters,
        hidden_act=act,
        swiglu_limit=swiglu_limit,
        intermediate_size=_positive(text, "intermediate_size"),
        moe_intermediate_size=_positive(text, "moe_intermediate_size"),
        n_routed_experts=n_experts,
        n_shared_experts=n_shared,
        num_experts_per_tok=topk_experts,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=_get(text, "norm_topk_prob", bool, True),
        routed_scaling_factor=_get(text, "routed_scaling_factor", float, 2.5),
        router_aux_loss_coef=_get(text, "router_aux_loss_coef", float, 0.001),
        num_nextn_predict_layers=mtp,
        index_share_for_mtp_iteration=_get(text, "index_share_for_mtp_iteration", (bool, int), None),
        rms_norm_eps=rms_eps,
        tie_word_embeddings=tie,
        pad_token_id=pad,
        bos_token_id=bos,
        eos_token_id=eos,
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype"),
        vision_config=_frozen_copy(raw.get("vision_config"), "vision_config"),
        quantization=_frozen_copy(raw.get("quantization_config") or text.get("quantization_config"),
                                  "quantization_config"),
    )
