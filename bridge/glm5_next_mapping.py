"""The HF <-> Megatron weight table for GLM-5.3-Flash (HF ``glm5_next``): NoPE DSA (KPool indexer) and MLP / MoE rows.

A separate table from GLM-5's (:mod:`bridge.mapping`), expanded by the same :class:`~bridge.mapping.RuleExpander`.
Its rows are GLM-5's where the tensors are the same (their shape functions read fields ``GLM5NextArchitecture``
has under the same names), plus what GLM-5.3-Flash adds:

* every layer has ``input_layernorm`` / ``post_attention_layernorm`` (``pre_mlp_layernorm``) and a dense MLP or a MoE
  (router + fp32 score-correction bias, shared expert, routed experts per expert or fused 3-D);
* a DSA layer (``layer_types[i] == "indexed_attention"``) has GLM-5's MLA rows with a zero rope width
  (``kv_a_proj_with_mqa`` is ``[kv_lora_rank + 0, hidden]``, ``q_b_proj`` ``heads x 256`` rows);
* a *full* DSA layer also has GLM-5's indexer rows and the two KPool parameters, ``index_kpool_compress_gate``
  ``[index_head_dim, hidden]`` -> ``indexer.compress_gate`` and ``index_kpool_compress_ape`` ``[P, index_head_dim]``
  -> ``indexer.compress_ape``; a shared one has none.

Not here yet (later steps add rows, nothing else): the KDA attention of ``linear_attention`` layers
(:data:`UNMAPPED_LAYER_PARTS`), the mHC ``attn_hc`` / ``ffn_hc`` parameters of every layer, the MTP layer.

HF names: in-memory ``Glm5NextForConditionalGeneration`` puts the text model under ``model.language_model.`` with
``lm_head.weight`` at the top (the default ``hf_prefix``); the bare ``Glm5NextTextModel`` has no prefix and no
``lm_head``. The released on-disk prefix is not verified yet, so it is a parameter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

from megatron_glm5.glm5_next.config import GLM5NextArchitecture

from .mapping import LAYER_RULES, Expansion, ExpertLayout, Rule, RuleExpander, TensorMap

AttentionType = Literal["indexed_attention", "linear_attention"]


@dataclass(frozen=True, slots=True)
class NextLayerKind:
    """What a GLM-5.3-Flash decoder layer contains. Duck-types :class:`bridge.mapping.LayerKind` (``indexer``,
    ``mlp``) so GLM-5's row predicates apply unchanged."""

    attention: AttentionType
    indexer: Literal["full", "shared"]  # read by DSA layers only
    mlp: Literal["dense", "sparse"]


def _dsa(kind: NextLayerKind) -> bool:
    return kind.attention == "indexed_attention"


def _full_dsa(kind: NextLayerKind) -> bool:
    return _dsa(kind) and kind.indexer == "full"


def _on_dsa_layers(rule: Rule) -> Rule:
    """GLM-5's attention row, restricted to DSA layers (KDA layers have other attention tensors)."""
    return dataclasses.replace(rule, when=lambda kind, base=rule.when: _dsa(kind) and base(kind))


GLOBAL_RULES: tuple[Rule, ...] = (
    Rule(("embed_tokens.weight",), "embedding.word_embeddings.weight", (lambda a: (a.vocab_size, a.hidden_size),)),
    Rule(("norm.weight",), "decoder.final_layernorm.weight", (lambda a: (a.hidden_size,),)),
)
LM_HEAD_RULE = Rule(("lm_head.weight",), "output_layer.weight", (lambda a: (a.vocab_size, a.hidden_size),))

# Relative to ``{hf_prefix}layers.{i}.`` / ``decoder.layers.{i}.``.
LAYER_RULES_NEXT: tuple[Rule, ...] = tuple(
    _on_dsa_layers(r) if r.hf[0].startswith("self_attn.") else r for r in LAYER_RULES
) + (
    Rule(("self_attn.indexer.index_kpool_compress_gate",), "self_attention.core_attention.indexer.compress_gate",
         (lambda a: (a.index_head_dim, a.hidden_size),), when=_full_dsa),
    Rule(("self_attn.indexer.index_kpool_compress_ape",), "self_attention.core_attention.indexer.compress_ape",
         (lambda a: (a.index_kpool, a.index_head_dim),), when=_full_dsa),
)

# HF tensor groups that exist but have no row yet, per layer (relative names): (predicate, prefixes, what adds them)
UNMAPPED_LAYER_PARTS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("linear_attention", ("self_attn.",), "the KDA layer"),
    ("all", ("attn_hc.", "ffn_hc."), "mHC"),
)


def layer_kinds(arch: GLM5NextArchitecture) -> tuple[NextLayerKind, ...]:
    return tuple(NextLayerKind(a, i, m) for a, i, m in zip(arch.layer_types, arch.indexer_types,
                                                           arch.mlp_layer_types))


def is_unmapped(rel_name: str, kind: NextLayerKind) -> bool:
    """A layer-relative HF name that belongs to a part of :data:`UNMAPPED_LAYER_PARTS`."""
    for which, prefixes, _ in UNMAPPED_LAYER_PARTS:
        if (which == "all" or which == kind.attention) and rel_name.startswith(prefixes):
            return True
    return False


def expand_glm5_next(
    arch: GLM5NextArchitecture,
    *,
    expert_layout: ExpertLayout = "per_expert",
    hf_prefix: str = "model.language_model.",
    lm_head: bool = True,
    layers: Sequence[int] | None = None,
    fp8_names: Iterable[str] = (),
    fp8_block: Sequence[int] = (128, 128),
) -> Expansion:
    """The rows for ``arch``: embedding, final norm, ``lm_head`` (unless tied or ``lm_head=False``) and, for each
    decoder layer in ``layers`` (default: all), its norms, MLP / MoE and, on DSA layers, NoPE MLA (+ indexer and
    KPool on full ones). Megatron names are the logical (TP=PP=EP=1) ones, as in :func:`bridge.mapping.expand`."""
    ex = RuleExpander(arch, expert_layout, frozenset(fp8_names), fp8_block)
    kinds = layer_kinds(arch)
    maps: list[TensorMap] = []
    for rule in GLOBAL_RULES:
        maps += ex.rows(rule, hf_prefix, "")
    if lm_head and not arch.tie_word_embeddings:
        maps += ex.rows(LM_HEAD_RULE, "", "")
    for i in range(arch.num_hidden_layers) if layers is None else layers:
        maps += ex.layer(LAYER_RULES_NEXT, kinds[i], f"{hf_prefix}layers.{i}.", f"decoder.layers.{i}.")
    by_mcore = {m.mcore: m for m in maps}
    assert len(by_mcore) == len(maps), "duplicate megatron name in the expanded table"
    return Expansion(tuple(maps), expert_layout, kinds, by_mcore)  # type: ignore[arg-type]
