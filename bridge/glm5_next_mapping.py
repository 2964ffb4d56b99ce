"""The HF <-> Megatron weight table for GLM-5.3-Flash (HF ``glm5_next``): every text tensor, MTP included.

A separate table from GLM-5's (:mod:`bridge.mapping`), expanded by the same :class:`~bridge.mapping.RuleExpander`.
Its rows are GLM-5's where the tensors are the same (their shape functions read fields ``GLM5NextArchitecture``
has under the same names), plus what GLM-5.3-Flash adds:

* every decoder layer has ``input_layernorm`` / ``post_attention_layernorm`` (``pre_mlp_layernorm``), a dense MLP or
  a MoE (router + fp32 score-correction bias, shared expert, routed experts per expert or fused 3-D) and two mHC
  blocks (``attn_hc`` / ``ffn_hc`` -> ``attn_hc`` / ``mlp_hc``: ``fn``, fp32 ``base`` and ``scale``);
* a DSA layer (``layer_types[i] == "indexed_attention"``) has GLM-5's MLA rows with a zero rope width and, when
  "full", GLM-5's indexer rows plus the two KPool parameters (``index_kpool_compress_gate`` -> ``compress_gate``,
  ``index_kpool_compress_ape`` -> ``compress_ape``); a shared one has none;
* a KDA layer (``"linear_attention"``) has the rows of :data:`KDA_RULES` (see :mod:`megatron_glm5.glm5_next.kda`);
* MTP layer ``k`` is stored after the decoder layers (``layers.{N + k}``): GLM-5's ``enorm`` / ``hnorm`` /
  ``eh_proj`` / ``shared_head.norm`` rows and a plain (no mHC) full-indexer DSA + MoE layer. transformers neither
  builds nor loads it; the names are the ones the release is reported to use.

Two HF namings, chosen per checkpoint (:func:`detect_naming`), independent of the expert layout:

* ``"disk"``: what ``save_pretrained`` writes and the release ships (transformers renames on load,
  ``conversion_mapping.py``): ``self_attn.{f_a_proj, f_b_proj, A_log, dt_bias}``, q/k/v convolutions as three
  ``self_attn.{q,k,v}_conv1d.weight [D, 1, K]``, mHC as ``hc_attn_{fn,base,scale}`` / ``hc_ffn_*``;
* ``"memory"``: transformers' module names: ``self_attn.forget_gate.*``, one ``self_attn.conv1d.weight [3D, 1, K]``
  (q | k | v), ``attn_hc.*`` / ``ffn_hc.*``.

Our convolution weight is ``[3, D, K]`` (q, k, v blocks kept apart so TP can shard each): :data:`STACK3` /
:data:`SPLIT3` convert it. fp32 rows (kept fp32 whatever the requested dtype, as transformers'
``_keep_in_fp32_modules_strict``): router weight and bias, KDA ``A_log`` / ``dt_bias`` / convolution, mHC ``base`` /
``scale``.

Names are relative to ``hf_prefix``: ``Glm5NextForConditionalGeneration`` puts the text model under
``model.language_model.`` with ``lm_head.weight`` at the top (the default); :func:`detect_prefix` reads it from the
checkpoint. The vision tower (``model.visual.*``) has no rows: conversion carries it through untouched
(:func:`passthrough_names`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

import torch

from megatron_glm5.glm5_next.config import GLM5NextArchitecture

from . import transforms as T
from .errors import TensorSetError
from .mapping import (
    LAYER_RULES,
    Expansion,
    ExpertLayout,
    Rule,
    RuleExpander,
    TensorMap,
    account_tensors,
    one_layout,
)

AttentionType = Literal["indexed_attention", "linear_attention"]
Naming = Literal["disk", "memory"]
NAMINGS = ("disk", "memory")
DEFAULT_PREFIX = "model.language_model."


@dataclass(frozen=True, slots=True)
class NextLayerKind:
    """What a GLM-5.3-Flash decoder (or MTP) layer contains. Duck-types :class:`bridge.mapping.LayerKind`
    (``indexer``, ``mlp``) so GLM-5's row predicates apply unchanged."""

    attention: AttentionType
    indexer: Literal["full", "shared"]  # read by DSA layers only
    mlp: Literal["dense", "sparse"]
    hc: bool = True  # mHC streams (decoder layers); MTP layers have none


# --------------------------------------------------------------------------------------------------------------------
# Transforms of the convolution weight
# --------------------------------------------------------------------------------------------------------------------


class _Stack3(T.Transform):
    """``q_conv1d, k_conv1d, v_conv1d [D, 1, K]`` <-> ``conv1d.weight [3, D, K]``."""

    name = "stack3"
    n_hf = 3

    def to_mcore(self, parts):
        return torch.stack([p.squeeze(1) for p in parts])

    def to_hf(self, t):
        return [t[i].unsqueeze(1).contiguous() for i in range(3)]

    def mcore_shape(self, hf_shapes):
        d, _, k = hf_shapes[0]
        return (3, d, k)

    def hf_shapes(self, mcore_shape):
        _, d, k = mcore_shape
        return [(d, 1, k)] * 3


class _Split3(T.Transform):
    """``conv1d.weight [3D, 1, K]`` (q | k | v) <-> ``conv1d.weight [3, D, K]``."""

    name = "split3"

    def to_mcore(self, parts):
        (t,) = parts
        return t.reshape(3, t.shape[0] // 3, t.shape[-1])

    def to_hf(self, t):
        return [t.reshape(t.shape[0] * t.shape[1], 1, t.shape[2]).contiguous()]

    def mcore_shape(self, hf_shapes):
        (c, _, k), = hf_shapes
        return (3, c // 3, k)

    def hf_shapes(self, mcore_shape):
        n, d, k = mcore_shape
        return [(n * d, 1, k)]


STACK3: T.Transform = _Stack3()
SPLIT3: T.Transform = _Split3()


# --------------------------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------------------------


def _dsa(kind) -> bool:
    return kind.attention == "indexed_attention"


def _kda(kind) -> bool:
    return kind.attention == "linear_attention"


def _full_dsa(kind) -> bool:
    return _dsa(kind) and kind.indexer == "full"


def _hc(kind) -> bool:
    return kind.hc


def _on_dsa_layers(rule: Rule) -> Rule:
    """GLM-5's attention row, restricted to DSA layers (KDA layers have other attention tensors)."""
    return dataclasses.replace(rule, when=lambda kind, base=rule.when: _dsa(kind) and base(kind))


def _h(a):
    return (a.hidden_size,)


def _kda_dim(a):
    return a.linear_num_heads * a.linear_head_dim


GLOBAL_RULES: tuple[Rule, ...] = (
    Rule(("embed_tokens.weight",), "embedding.word_embeddings.weight", (lambda a: (a.vocab_size, a.hidden_size),)),
    Rule(("norm.weight",), "decoder.final_layernorm.weight", (_h,)),
)
LM_HEAD_RULE = Rule(("lm_head.weight",), "output_layer.weight", (lambda a: (a.vocab_size, a.hidden_size),))

# KDA rows, relative to ``layers.{i}.`` / ``decoder.layers.{i}.``; (disk name, memory name) where they differ.
_KDA_COMMON: tuple[Rule, ...] = tuple(
    Rule((f"self_attn.{hf}.weight",), f"self_attention.{ours}.weight", (shape,), when=_kda)
    for hf, ours, shape in (
        ("q_proj", "linear_q", lambda a: (_kda_dim(a), a.hidden_size)),
        ("k_proj", "linear_k", lambda a: (_kda_dim(a), a.hidden_size)),
        ("v_proj", "linear_v", lambda a: (_kda_dim(a), a.hidden_size)),
        ("b_proj", "linear_beta", lambda a: (a.linear_num_heads, a.hidden_size)),
        ("g_a_proj", "linear_g_down", lambda a: (a.linear_head_dim, a.hidden_size)),
        ("g_b_proj", "linear_g_up", lambda a: (_kda_dim(a), a.linear_head_dim)),
        ("o_norm", "out_norm", lambda a: (a.linear_head_dim,)),
        ("o_proj", "linear_proj", lambda a: (a.hidden_size, _kda_dim(a))),
    )
)


def _forget_gate_rules(pre: str) -> tuple[Rule, ...]:
    return (
        Rule((f"self_attn.{pre}f_a_proj.weight",), "self_attention.linear_f_down.weight",
             (lambda a: (a.linear_head_dim, a.hidden_size),), when=_kda),
        Rule((f"self_attn.{pre}f_b_proj.weight",), "self_attention.linear_f_up.weight",
             (lambda a: (_kda_dim(a), a.linear_head_dim),), when=_kda),
        Rule((f"self_attn.{pre}A_log",), "self_attention.A_log", (lambda a: (a.linear_num_heads,),), when=_kda,
             fp32=True),
        Rule((f"self_attn.{pre}dt_bias",), "self_attention.dt_bias", (lambda a: (_kda_dim(a),),), when=_kda,
             fp32=True),
    )


def _conv_shape(a):
    return (_kda_dim(a), 1, a.linear_conv_kernel_dim)


def _hc_rules(hf_names: tuple[str, str, str], ours: str) -> tuple[Rule, ...]:
    rows = lambda a: (2 + a.hc_mult) * a.hc_mult  # noqa: E731
    fn, base, scale = hf_names
    return (
        Rule((fn,), f"{ours}.fn", (lambda a: (rows(a), a.hc_mult * a.hidden_size),), when=_hc),
        Rule((base,), f"{ours}.base", (lambda a: (rows(a),),), when=_hc, fp32=True),
        Rule((scale,), f"{ours}.scale", (lambda a: (3,),), when=_hc, fp32=True),
    )


KDA_RULES: dict[Naming, tuple[Rule, ...]] = {
    "disk": _KDA_COMMON + _forget_gate_rules("") + (
        Rule(tuple(f"self_attn.{x}_conv1d.weight" for x in "qkv"), "self_attention.conv1d.weight",
             (_conv_shape,) * 3, STACK3, when=_kda, fp32=True),
    ),
    "memory": _KDA_COMMON + _forget_gate_rules("forget_gate.") + (
        Rule(("self_attn.conv1d.weight",), "self_attention.conv1d.weight",
             (lambda a: (3 * _kda_dim(a), 1, a.linear_conv_kernel_dim),), SPLIT3, when=_kda, fp32=True),
    ),
}

HC_RULES: dict[Naming, tuple[Rule, ...]] = {
    "disk": _hc_rules(("hc_attn_fn", "hc_attn_base", "hc_attn_scale"), "attn_hc")
    + _hc_rules(("hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale"), "mlp_hc"),
    "memory": _hc_rules(("attn_hc.fn", "attn_hc.base", "attn_hc.scale"), "attn_hc")
    + _hc_rules(("ffn_hc.fn", "ffn_hc.base", "ffn_hc.scale"), "mlp_hc"),
}


def _next_rule(rule: Rule) -> Rule:
    if rule.hf[0].startswith("self_attn."):
        return _on_dsa_layers(rule)
    if rule.hf == ("mlp.gate.weight",):  # transformers keeps the router weight in fp32
        return dataclasses.replace(rule, fp32=True)
    return rule


# DSA / MLP / MoE rows: GLM-5's, relative to ``layers.{i}.`` / ``decoder.layers.{i}.``
LAYER_RULES_NEXT: tuple[Rule, ...] = tuple(_next_rule(r) for r in LAYER_RULES) + (
    Rule(("self_attn.indexer.index_kpool_compress_gate",), "self_attention.core_attention.indexer.compress_gate",
         (lambda a: (a.index_head_dim, a.hidden_size),), when=_full_dsa),
    Rule(("self_attn.indexer.index_kpool_compress_ape",), "self_attention.core_attention.indexer.compress_ape",
         (lambda a: (a.index_kpool, a.index_head_dim),), when=_full_dsa),
)


def layer_rules(naming: Naming) -> tuple[Rule, ...]:
    if naming not in NAMINGS:
        raise ValueError(f"naming: expected one of {list(NAMINGS)}, got {naming!r}")
    return LAYER_RULES_NEXT + KDA_RULES[naming] + HC_RULES[naming]


def layer_kinds(arch: GLM5NextArchitecture) -> tuple[NextLayerKind, ...]:
    """Decoder layers per the config, then one plain full-indexer DSA layer per MTP layer (MoE when the model has
    experts)."""
    kinds = [NextLayerKind(a, i, m) for a, i, m in zip(arch.layer_types, arch.indexer_types, arch.mlp_layer_types)]
    mtp_mlp = "sparse" if arch.n_routed_experts else "dense"
    kinds += [NextLayerKind("indexed_attention", "full", mtp_mlp, hc=False)] * arch.num_nextn_predict_layers
    return tuple(kinds)


def default_naming(expert_layout: ExpertLayout) -> Naming:
    """The naming that goes with an expert layout when none is given: per-expert tensors are the on-disk layout,
    fused 3-D experts transformers' in-memory one."""
    return "disk" if expert_layout == "per_expert" else "memory"


def expand_glm5_next(
    arch: GLM5NextArchitecture,
    *,
    expert_layout: ExpertLayout = "per_expert",
    naming: Naming | None = None,
    hf_prefix: str = DEFAULT_PREFIX,
    lm_head: bool = True,
    layers: Sequence[int] | None = None,
    mtp: bool = True,
    fp8_names: Iterable[str] = (),
    fp8_block: Sequence[int] = (128, 128),
) -> Expansion:
    """The rows for ``arch``: embedding, final norm, ``lm_head`` (unless tied or ``lm_head=False``), each decoder
    layer in ``layers`` (default: all) and, with ``mtp``, the MTP layers. ``naming`` defaults to
    :func:`default_naming`. Megatron names are the logical (TP=PP=EP=1) ones, as in :func:`bridge.mapping.expand`."""
    naming = naming or default_naming(expert_layout)
    rules = layer_rules(naming)
    ex = RuleExpander(arch, expert_layout, frozenset(fp8_names), fp8_block)
    kinds = layer_kinds(arch)
    maps: list[TensorMap] = []
    for rule in GLOBAL_RULES:
        maps += ex.rows(rule, hf_prefix, "")
    if lm_head and not arch.tie_word_embeddings:
        maps += ex.rows(LM_HEAD_RULE, "", "")
    maps += ex.layers(rules, kinds, f"{hf_prefix}layers.", num_layers=arch.num_hidden_layers,
                      mtp_layers=arch.num_nextn_predict_layers if mtp else 0, only=layers)
    return ex.expansion(maps, kinds)


# --------------------------------------------------------------------------------------------------------------------
# Reading a checkpoint's conventions, and key accounting
# --------------------------------------------------------------------------------------------------------------------

_PASSTHROUGH = re.compile(r"^(model\.)?visual\.")
_DISK_MARK = re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$|\.self_attn\.[qkv]_conv1d\.weight$|\.self_attn\.(f_a_proj|"
                        r"f_b_proj)\.weight$|\.self_attn\.(A_log|dt_bias)$")
_MEMORY_MARK = re.compile(r"\.(attn_hc|ffn_hc)\.(fn|base|scale)$|\.self_attn\.conv1d\.weight$"
                          r"|\.self_attn\.forget_gate\.")


def passthrough_names(hf_names: Iterable[str]) -> list[str]:
    """The vision tower's tensors (``model.visual.*``): no rows; conversion carries them through untouched."""
    return sorted(n for n in hf_names if _PASSTHROUGH.match(n))


def detect_naming(hf_names: Iterable[str]) -> Naming:
    """``"disk"`` or ``"memory"`` from the mHC / KDA tensor names (every decoder layer has mHC tensors); an error if
    both appear."""
    return one_layout(hf_names, ("disk", _DISK_MARK, "transformers' on-disk names"),
                      ("memory", _MEMORY_MARK, "its in-memory module names"), "naming")  # type: ignore[return-value]


def detect_prefix(hf_names: Iterable[str]) -> str:
    """The text model's name prefix: what precedes ``embed_tokens.weight`` (``model.language_model.`` in
    transformers' ``Glm5NextForConditionalGeneration``)."""
    found = sorted(n[: -len("embed_tokens.weight")] for n in hf_names
                   if n.endswith("embed_tokens.weight") and not _PASSTHROUGH.match(n))
    if len(found) != 1:
        raise TensorSetError(f"expected exactly one text embedding '...embed_tokens.weight', found {found or 'none'}")
    return found[0]


def account_glm5_next(arch: GLM5NextArchitecture, expansion: Expansion, hf_names: Iterable[str], *, source: str,
                      hf_prefix: str = DEFAULT_PREFIX) -> tuple[dict[str, str], tuple[str, ...]]:
    """GLM-5.3-Flash's exact key accounting (:func:`bridge.mapping.account_tensors`): the table's tensors plus the
    vision tower (carried through). Returns ``({ignored name: reason}, passthrough names)``."""
    names = set(hf_names)
    passthrough = tuple(passthrough_names(names))
    ignored = account_tensors(
        expansion, names, source=source, indexer_types=arch.indexer_types, layer_prefix=f"{hf_prefix}layers.",
        passthrough=passthrough, mtp_hint="the text config", mtp_layers=arch.num_nextn_predict_layers,
        describe=f"GLM-5.3-Flash, {arch.num_hidden_layers} layers: {len(arch.kda_layers)} KDA / "
                 f"{len(arch.dsa_layers)} DSA, {arch.num_nextn_predict_layers} MTP, {arch.n_routed_experts} experts")
    return ignored, passthrough
