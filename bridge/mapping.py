"""The HF <-> Megatron weight table for GLM-5.x, and its expansion to one concrete list per checkpoint.

One declarative table (:data:`GLOBAL_RULES`, :data:`LAYER_RULES`, :data:`MTP_RULES`) names every tensor on both
sides. Each :class:`Rule` is: HF name template(s), a megatron name template, the HF shape(s) as a function of the
architecture, a :mod:`transform <bridge.transforms>`, and the layers it applies to. :func:`expand` turns the table
into a flat list of :class:`TensorMap` for one architecture, with pure functions for the variants:

* decoder layer ``i``: ``model.layers.{i}.*`` <-> ``decoder.layers.{i}.*``;
* MTP layer ``k`` (HF stores it after the decoder layers): ``model.layers.{N+k}.*`` <-> the inner layer
  ``mtp.layers.{k}.mtp_model_layer.*`` plus ``mtp.layers.{k}.{enorm,hnorm,eh_proj,final_layernorm}``;
  megatron-core's dist-checkpoint key for the inner layer is ``transformer_layer`` (see :mod:`bridge.naming`);
* IndexShare: a "shared" layer simply gets no indexer rows (HF has no tensors there, megatron builds no indexer);
* experts: the released per-expert names (``mlp.experts.{e}.gate_proj``) or transformers-v5's fused 3-D
  tensors (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``: row ``e`` of the fused tensor is
  expert ``e``), always megatron's per-expert ``mlp.experts.local_experts.{e}.*`` with *global* expert ids;
* block-FP8 sources: every FP8-stored weight also consumes its ``weight_scale_inv`` (dequantised on read).

Megatron names here are *logical*: the names of a TP=PP=EP=1 model (``local_experts.{e}`` with the global id).
:mod:`bridge.naming` maps them to and from megatron-core's dist-checkpoint keys.

Key accounting is exact (:func:`account_hf_names`): every HF tensor is consumed by a row or listed in
:data:`IGNORED_HF_KEYS` with the reason; anything else is an error naming the tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Mapping, Sequence

from megatron_glm5.glm5.config import GLM5Architecture

from . import transforms as T
from .errors import ShapeMismatchError, TensorSetError, format_names
from .naming import MTP_INNER  # the MTP inner layer's logical name (its dist-checkpoint key: transformer_layer)

ExpertLayout = Literal["per_expert", "fused"]
Shape = tuple[int, ...]
ShapeFn = Callable[[GLM5Architecture], Shape]


@dataclass(frozen=True, slots=True)
class LayerKind:
    """What a decoder (or MTP) layer contains: its IndexShare type and its MLP type."""

    indexer: Literal["full", "shared"]
    mlp: Literal["dense", "sparse"]


def _always(kind: LayerKind | None) -> bool:
    return True


def _full(kind: LayerKind) -> bool:
    return kind.indexer == "full"


def _dense(kind: LayerKind) -> bool:
    return kind.mlp == "dense"


def _sparse(kind: LayerKind) -> bool:
    return kind.mlp == "sparse"


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the table. ``hf`` templates may contain ``{e}`` (expert id); a template ending in ``[e]`` names
    row ``e`` of a stacked (fused) HF tensor whose full shape is ``(E, *shape)``."""

    hf: tuple[str, ...]
    mcore: str
    shapes: tuple[ShapeFn, ...]
    transform: T.Transform = T.COPY
    when: Callable[[LayerKind], bool] = _always
    experts: ExpertLayout | None = None  # expert rows exist once per expert, in one layout only
    fp32: bool = False  # keep in fp32 whatever the requested dtype (router bias)


# Shapes (PyTorch [out, in]) as functions of the architecture.
def _h(a):  # hidden
    return (a.hidden_size,)


def _v_h(a):
    return (a.vocab_size, a.hidden_size)


def _q_heads(a):
    return a.num_attention_heads * a.qk_head_dim


GLOBAL_RULES: tuple[Rule, ...] = (
    Rule(("model.embed_tokens.weight",), "embedding.word_embeddings.weight", (_v_h,)),
    Rule(("model.norm.weight",), "decoder.final_layernorm.weight", (_h,)),
    Rule(("lm_head.weight",), "output_layer.weight", (_v_h,)),
)

_GATE_UP_DENSE = (lambda a: (a.intermediate_size, a.hidden_size),) * 2
_GATE_UP_SHARED = (lambda a: (a.moe_intermediate_size * a.n_shared_experts, a.hidden_size),) * 2
_GATE_UP_EXPERT = (lambda a: (a.moe_intermediate_size, a.hidden_size),) * 2

# Relative to ``model.layers.{i}.`` / ``decoder.layers.{i}.`` (or the MTP inner layer).
LAYER_RULES: tuple[Rule, ...] = (
    Rule(("input_layernorm.weight",), "input_layernorm.weight", (_h,)),
    Rule(("post_attention_layernorm.weight",), "pre_mlp_layernorm.weight", (_h,)),
    # MLA
    Rule(("self_attn.q_a_proj.weight",), "self_attention.linear_q_down_proj.weight",
         (lambda a: (a.q_lora_rank, a.hidden_size),)),
    Rule(("self_attn.q_a_layernorm.weight",), "self_attention.q_layernorm.weight", (lambda a: (a.q_lora_rank,),)),
    Rule(("self_attn.q_b_proj.weight",), "self_attention.linear_q_up_proj.weight",
         (lambda a: (_q_heads(a), a.q_lora_rank),)),
    Rule(("self_attn.kv_a_proj_with_mqa.weight",), "self_attention.linear_kv_down_proj.weight",
         (lambda a: (a.kv_lora_rank + a.qk_rope_head_dim, a.hidden_size),)),
    Rule(("self_attn.kv_a_layernorm.weight",), "self_attention.kv_layernorm.weight", (lambda a: (a.kv_lora_rank,),)),
    Rule(("self_attn.kv_b_proj.weight",), "self_attention.linear_kv_up_proj.weight",
         (lambda a: (a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),)),
    Rule(("self_attn.o_proj.weight",), "self_attention.linear_proj.weight",
         (lambda a: (a.hidden_size, a.num_attention_heads * a.v_head_dim),)),
    # DSA indexer: "full" layers only (IndexShare "shared" layers own none). Each indexer head is [rope | nope] in HF
    # and in megatron-core 0.19.2's DSAIndexer alike (tests/test_bridge_mapping.py checks the installed one), so
    # the rows map unchanged.
    Rule(("self_attn.indexer.wq_b.weight",), "self_attention.core_attention.indexer.linear_wq_b.weight",
         (lambda a: (a.index_n_heads * a.index_head_dim, a.q_lora_rank),), when=_full),
    Rule(("self_attn.indexer.wk.weight",), "self_attention.core_attention.indexer.linear_wk.weight",
         (lambda a: (a.index_head_dim, a.hidden_size),), when=_full),
    Rule(("self_attn.indexer.k_norm.weight",), "self_attention.core_attention.indexer.k_norm.weight",
         (lambda a: (a.index_head_dim,),), when=_full),
    Rule(("self_attn.indexer.k_norm.bias",), "self_attention.core_attention.indexer.k_norm.bias",
         (lambda a: (a.index_head_dim,),), when=_full),
    Rule(("self_attn.indexer.weights_proj.weight",), "self_attention.core_attention.indexer.linear_weights_proj.weight",
         (lambda a: (a.index_n_heads, a.hidden_size),), when=_full),
    # Dense MLP
    Rule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), "mlp.linear_fc1.weight", _GATE_UP_DENSE, T.GATED, _dense),
    Rule(("mlp.down_proj.weight",), "mlp.linear_fc2.weight", (lambda a: (a.hidden_size, a.intermediate_size),),
         when=_dense),
    # MoE: router (+ fp32 score-correction bias), shared experts, routed experts in either HF layout
    Rule(("mlp.gate.weight",), "mlp.router.weight", (lambda a: (a.n_routed_experts, a.hidden_size),), when=_sparse),
    Rule(("mlp.gate.e_score_correction_bias",), "mlp.router.expert_bias", (lambda a: (a.n_routed_experts,),),
         when=_sparse, fp32=True),
    Rule(("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
         "mlp.shared_experts.linear_fc1.weight", _GATE_UP_SHARED, T.GATED, _sparse),
    Rule(("mlp.shared_experts.down_proj.weight",), "mlp.shared_experts.linear_fc2.weight",
         (lambda a: (a.hidden_size, a.moe_intermediate_size * a.n_shared_experts),), when=_sparse),
    Rule(("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
         "mlp.experts.local_experts.{e}.linear_fc1.weight", _GATE_UP_EXPERT, T.GATED, _sparse, "per_expert"),
    Rule(("mlp.experts.{e}.down_proj.weight",), "mlp.experts.local_experts.{e}.linear_fc2.weight",
         (lambda a: (a.hidden_size, a.moe_intermediate_size),), when=_sparse, experts="per_expert"),
    Rule(("mlp.experts.gate_up_proj[e]",), "mlp.experts.local_experts.{e}.linear_fc1.weight",
         (lambda a: (2 * a.moe_intermediate_size, a.hidden_size),), when=_sparse, experts="fused"),
    Rule(("mlp.experts.down_proj[e]",), "mlp.experts.local_experts.{e}.linear_fc2.weight",
         (lambda a: (a.hidden_size, a.moe_intermediate_size),), when=_sparse, experts="fused"),
)

# MTP layer k: relative to ``model.layers.{N+k}.`` / ``mtp.layers.{k}.``; its inner decoder layer uses LAYER_RULES.
MTP_RULES: tuple[Rule, ...] = (
    Rule(("enorm.weight",), "enorm.weight", (_h,)),
    Rule(("hnorm.weight",), "hnorm.weight", (_h,)),
    Rule(("eh_proj.weight",), "eh_proj.weight", (lambda a: (a.hidden_size, 2 * a.hidden_size),)),
    Rule(("shared_head.norm.weight",), "final_layernorm.weight", (_h,)),
)

# HF tensors that are dropped on purpose. Anything not mapped and not listed here is an error.
IGNORED_HF_KEYS: tuple[tuple[str, str], ...] = (
    (r"(^|\.)rotary_emb\.inv_freq$", "RoPE inverse frequencies are recomputed from config.json"),
)
_IGNORED = tuple((re.compile(p), reason) for p, reason in IGNORED_HF_KEYS)


def ignored_reason(hf_name: str) -> str | None:
    for pattern, reason in _IGNORED:
        if pattern.search(hf_name):
            return reason
    return None


# --------------------------------------------------------------------------------------------------------------------
# Expansion
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HFRef:
    """One HF tensor (or row ``row`` of a stacked tensor with ``stack`` rows) read by a :class:`TensorMap`.
    ``scale`` is the block-FP8 ``weight_scale_inv`` that comes with an FP8-stored weight."""

    name: str
    shape: Shape  # of the referenced tensor or row
    row: int | None = None
    stack: int | None = None
    scale: "HFRef | None" = None

    @property
    def full_shape(self) -> Shape:
        return self.shape if self.row is None else (self.stack, *self.shape)


@dataclass(frozen=True, slots=True)
class TensorMap:
    """One megatron (logical) tensor and the HF tensors it is made of."""

    mcore: str
    hf: tuple[HFRef, ...]
    transform: T.Transform
    fp32: bool = False

    @property
    def mcore_shape(self) -> Shape:
        return self.transform.mcore_shape([r.shape for r in self.hf])


@dataclass(frozen=True, slots=True)
class Expansion:
    """The table applied to one architecture."""

    maps: tuple[TensorMap, ...]
    expert_layout: ExpertLayout
    layer_kinds: tuple[LayerKind, ...]  # decoder layers, then MTP layers
    by_mcore: Mapping[str, TensorMap] = field(default_factory=dict)

    def hf_shapes(self) -> dict[str, Shape]:
        """Every expected HF tensor and its full shape (stacked tensors once, with their row count)."""
        out: dict[str, Shape] = {}
        for m in self.maps:
            for r in m.hf:
                out[r.name] = r.full_shape
                if r.scale is not None:
                    out[r.scale.name] = r.scale.full_shape
        return out


def layer_kinds(arch: GLM5Architecture) -> tuple[LayerKind, ...]:
    """Decoder layers per the config, then one entry per MTP layer (always a full indexer, MoE when the model has
    experts: the MTP block of GLM-5.x is a full MoE decoder layer with its own indexer)."""
    kinds = [LayerKind(t, m) for t, m in zip(arch.indexer_types, arch.mlp_layer_types)]
    mtp_mlp = "sparse" if arch.n_routed_experts else "dense"
    kinds += [LayerKind("full", mtp_mlp)] * arch.num_nextn_predict_layers
    return tuple(kinds)


@dataclass(frozen=True, slots=True)
class RuleExpander:
    """Applies table rows to one architecture (any object with the fields the rows' shape functions read):
    :meth:`rows` gives a row's :class:`TensorMap` (one per expert for expert rows) under name prefixes. Shared by
    the GLM-5.x table here and the GLM-5.3-Flash one (:mod:`bridge.glm5_next_mapping`)."""

    arch: object
    expert_layout: ExpertLayout = "per_expert"
    fp8: frozenset[str] = frozenset()  # HF weights stored in FP8: each also reads its weight_scale_inv
    fp8_block: Sequence[int] = (128, 128)

    def __post_init__(self) -> None:
        if self.expert_layout not in ("per_expert", "fused"):
            raise ValueError(f"expert_layout: expected 'per_expert' or 'fused', got {self.expert_layout!r}")

    def ref(self, name: str, shape: Shape, row: int | None = None, stack: int | None = None) -> HFRef:
        scale = None
        if name in self.fp8:
            scale_name = name + "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"
            scale = HFRef(scale_name, T.fp8_scale_shape(shape, self.fp8_block), row, stack)
        return HFRef(name, shape, row, stack, scale)

    def rows(self, rule: Rule, hf_prefix: str, mc_prefix: str) -> list[TensorMap]:
        arch, ref = self.arch, self.ref
        shapes = [fn(arch) for fn in rule.shapes]
        if rule.experts is None:
            refs = tuple(ref(hf_prefix + n, s) for n, s in zip(rule.hf, shapes))
            return [TensorMap(mc_prefix + rule.mcore, refs, rule.transform, rule.fp32)]
        out = []
        for e in range(arch.n_routed_experts):
            refs = []
            for n, s in zip(rule.hf, shapes):
                if n.endswith("[e]"):
                    refs.append(ref(hf_prefix + n[:-3], s, e, arch.n_routed_experts))
                else:
                    refs.append(ref(hf_prefix + n.format(e=e), s))
            out.append(TensorMap(mc_prefix + rule.mcore.format(e=e), tuple(refs), rule.transform, rule.fp32))
        return out

    def layer(self, rules: Iterable[Rule], kind, hf_prefix: str, mc_prefix: str) -> list[TensorMap]:
        """The rows of ``rules`` that apply to a layer of ``kind`` (and to this expert layout)."""
        return [m for rule in rules if rule.when(kind) and rule.experts in (None, self.expert_layout)
                for m in self.rows(rule, hf_prefix, mc_prefix)]

    def layers(self, rules: Sequence[Rule], kinds: Sequence, hf_layers: str, *, num_layers: int, mtp_layers: int,
               only: Iterable[int] | None = None) -> list[TensorMap]:
        """The decoder layers (``only``: those) and the MTP layers after them: HF numbers MTP layer ``k`` on as
        ``{hf_layers}{num_layers + k}.``, megatron-core as ``mtp.layers.{k}`` around its inner layer."""
        maps = [m for i in (range(num_layers) if only is None else only)
                for m in self.layer(rules, kinds[i], f"{hf_layers}{i}.", f"decoder.layers.{i}.")]
        for k in range(mtp_layers):
            hf, mc = f"{hf_layers}{num_layers + k}.", f"mtp.layers.{k}."
            maps += [m for rule in MTP_RULES for m in self.rows(rule, hf, mc)]
            maps += self.layer(rules, kinds[num_layers + k], hf, f"{mc}{MTP_INNER}.")
        return maps

    def expansion(self, maps: list[TensorMap], kinds: Sequence) -> "Expansion":
        by_mcore = {m.mcore: m for m in maps}
        assert len(by_mcore) == len(maps), "duplicate megatron name in the expanded table"
        return Expansion(tuple(maps), self.expert_layout, tuple(kinds), by_mcore)


def expand(
    arch: GLM5Architecture,
    *,
    expert_layout: ExpertLayout = "per_expert",
    fp8_names: Iterable[str] = (),
    fp8_block: Sequence[int] = (128, 128),
) -> Expansion:
    """The concrete table for ``arch``. ``fp8_names`` are HF weights stored in FP8 (each then also reads its
    ``weight_scale_inv``)."""
    ex = RuleExpander(arch, expert_layout, frozenset(fp8_names), fp8_block)
    kinds = layer_kinds(arch)
    maps: list[TensorMap] = []
    for rule in GLOBAL_RULES:
        if rule.mcore == "output_layer.weight" and arch.tie_word_embeddings:
            continue
        maps += ex.rows(rule, "", "")
    maps += ex.layers(LAYER_RULES, kinds, "model.layers.", num_layers=arch.num_hidden_layers,
                      mtp_layers=arch.num_nextn_predict_layers)
    return ex.expansion(maps, kinds)


# --------------------------------------------------------------------------------------------------------------------
# Source inspection and strict key accounting
# --------------------------------------------------------------------------------------------------------------------

_PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")
_FUSED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)(\.weight)?$")


def one_layout(hf_names: Iterable[str], default: tuple[str, re.Pattern, str], other: tuple[str, re.Pattern, str],
               what: str) -> str:
    """``other``'s label when a name matches its pattern, else ``default``'s (``(label, pattern, description)``);
    a checkpoint with names of both is refused, with an example of each."""
    found = {label: None for label, _, _ in (default, other)}
    for n in hf_names:
        for label, pattern, _ in (default, other):
            if found[label] is None and pattern.search(n):
                found[label] = n
    (a, _, desc_a), (b, _, desc_b) = default, other
    if found[a] and found[b]:
        raise TensorSetError(f"the checkpoint mixes {desc_a} (e.g. {found[a]}) and {desc_b} (e.g. {found[b]}); "
                             f"expected one {what}")
    return b if found[b] else a


def detect_expert_layout(hf_names: Iterable[str]) -> ExpertLayout:
    """``per_expert`` (released safetensors) or ``fused`` (transformers-v5 3-D tensors); an error if both."""
    return one_layout(hf_names, ("per_expert", _PER_EXPERT, "per-expert expert tensors"),
                      ("fused", _FUSED, "fused 3-D expert tensors"), "layout")  # type: ignore[return-value]


def account_tensors(expansion: Expansion, hf_names: Iterable[str], *, source: str, indexer_types: Sequence[str],
                    describe: str, layer_prefix: str = "model.layers.", passthrough: Iterable[str] = (),
                    mtp_hint: str | None = None, mtp_layers: int = 0) -> dict[str, str]:
    """Exact key accounting for any family: the HF tensors must be exactly the table's, plus ``passthrough`` (carried
    as is) and the ignored ones. Returns {ignored name: reason}. Raises :class:`TensorSetError` naming what is
    missing / unexpected (``describe``: what config.json says, for the message), with a specific message when the
    difference is an IndexShare mismatch (indexer tensors on a "shared" layer, or none on a "full" one) or, with
    ``mtp_hint`` (where to announce it), tensors of an MTP layer config.json does not announce."""
    names = set(hf_names)
    ignored = {n: r for n in names if (r := ignored_reason(n)) is not None}
    present = names - set(ignored) - set(passthrough)
    expected = set(expansion.hf_shapes())
    missing, unexpected = expected - present, present - expected
    kinds = expansion.layer_kinds
    n_layers = len(indexer_types)
    layer_re = re.compile(rf"^{re.escape(layer_prefix)}(\d+)\.")

    def layer_of(name: str) -> int | None:
        m = layer_re.match(name)
        return int(m.group(1)) if m else None

    beyond = sorted(x for x in unexpected if (i := layer_of(x)) is not None and i >= len(kinds))
    if beyond and mtp_hint is not None and mtp_layers == 0:
        layers = sorted({layer_of(x) for x in beyond})
        raise TensorSetError(
            f"{source}: the checkpoint has tensors of layer(s) {layers} after the {n_layers} decoder layers (an MTP "
            f"layer, e.g. {beyond[0]}) but config.json announces no MTP layer; add \"num_nextn_predict_layers\": "
            f"{len(layers)} to {mtp_hint}",
            unexpected=beyond,
        )
    idx_extra = sorted(n for n in unexpected if ".self_attn.indexer." in n and (i := layer_of(n)) is not None
                       and i < len(kinds) and kinds[i].indexer == "shared")
    if idx_extra:
        layers = sorted({layer_of(n) for n in idx_extra})
        raise TensorSetError(
            f"{source}: decoder layer(s) {layers} are 'shared' in config.json's IndexShare pattern (indexer_types = "
            f"{list(indexer_types)}) and must have no indexer tensors, but the checkpoint has "
            f"{format_names(idx_extra)}. Either config.json's indexer_types is wrong or the weights belong to "
            "another model",
            unexpected=idx_extra,
        )
    idx_missing = sorted(n for n in missing if ".self_attn.indexer." in n)
    if idx_missing:
        layers = sorted({layer_of(n) for n in idx_missing})
        raise TensorSetError(
            f"{source}: layer(s) {layers} are 'full' in config.json's IndexShare pattern (indexer_types = "
            f"{list(indexer_types)}; MTP layers {list(range(n_layers, len(kinds)))} always have an indexer) "
            f"but the checkpoint lacks {format_names(idx_missing)}",
            missing=idx_missing,
        )
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing: {format_names(missing)}")
        if unexpected:
            carried = ", not carried through" if passthrough else ""
            parts.append(f"{len(unexpected)} unexpected (not in the mapping table{carried}, not in IGNORED_HF_KEYS): "
                         f"{format_names(unexpected)}")
        raise TensorSetError(
            f"{source}: the tensors do not match config.json ({describe}, {expansion.expert_layout} expert "
            "layout): " + "; ".join(parts),
            missing=missing,
            unexpected=unexpected,
        )
    return ignored


def account_hf_names(
    arch: GLM5Architecture, expansion: Expansion, hf_names: Iterable[str], *, source: str
) -> dict[str, str]:
    """GLM-5.x's exact key accounting (:func:`account_tensors`). Returns {ignored name: reason}."""
    return account_tensors(expansion, hf_names, source=source, indexer_types=arch.indexer_types,
                           describe=f"{arch.num_hidden_layers} layers, {arch.num_nextn_predict_layers} MTP, "
                                    f"{arch.n_routed_experts} experts")


def check_hf_shapes(expansion: Expansion, actual: Mapping[str, Shape], *, source: str) -> None:
    """Every HF tensor's shape must be the one the config implies."""
    bad = []
    for name, shape in expansion.hf_shapes().items():
        got = tuple(actual[name])
        if got != tuple(shape):
            bad.append(f"{name}: expected {list(shape)}, found {list(got)}")
    if bad:
        more = f" (and {len(bad) - 10} more)" if len(bad) > 10 else ""
        raise ShapeMismatchError(f"{source}: tensor shapes do not match config.json: " + "; ".join(bad[:10]) + more)
