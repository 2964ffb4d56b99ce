"""How a megatron-core ``torch_dist`` checkpoint names a GLM-5.x model: its *Megatron layout* (which modules built
the model) and its *expert form* (how megatron-core keyed the experts). One declarative table, :data:`LAYOUTS`,
beside the HF one (:mod:`bridge.mapping`); :mod:`bridge.naming` maps the local keys to the logical names.

Layouts, and who writes them:

* ``local``: every norm its own module (``q_layernorm``, ``kv_layernorm``, ``pre_mlp_layernorm``). This bridge by
  default; megatron-glm5 training (both of its providers keep norms separate, with or without Transformer Engine);
  megatron-core's local spec.
* ``te``: megatron-core 0.19.2's DSA spec built with Transformer Engine
  (``get_transformer_block_with_experimental_attention_variant_spec``, what NVIDIA Megatron-Bridge's ``GLM5Bridge``
  builds): a dense layer's pre-MLP norm is fused into ``mlp.linear_fc1`` (``TELayerNormColumnParallelLinear``,
  stored as ``mlp.linear_fc1.layer_norm_weight``); the q/kv norms stay separate because the indexer reads the
  normalised q; a MoE layer keeps ``pre_mlp_layernorm`` (its router cannot take a norm).
* ``te-fused-qk``: megatron-core's MLA spec with Transformer Engine (``get_gpt_layer_with_transformer_engine_spec``
  with ``qk_layernorm``), on which slime's and miles' GLM-5 specs build: the q/kv norms are fused too, into
  ``linear_q_up_proj`` / ``linear_kv_up_proj``. (Megatron-Bridge's table accepts both TE spellings.)

TE layouts also hold TE's ``_extra_state`` objects (FP8 metadata) beside the weights of every TE module; they are
not weights and reading ignores them. Written here they are what TE stores without FP8 (an empty byte tensor), for
every module a TE build has: a Megatron-LM ``--load`` at its default strictness fails on any extra state it asks
for and does not find, and one it does not ask for costs nothing.

Expert forms (orthogonal to the layout; both are read, ``stacked`` is written):

* ``stacked``, megatron-core 0.19.2's default: one key per layer and linear with an expert axis,
  ``...mlp.experts.experts.linear_fc1.weight [E, 2I, H]`` (``SequentialMLP`` and ``TEGroupedMLP`` alike);
* ``singleton``, megatron-core's ``singleton_local_shards`` option (recorded in the checkpoint's content metadata;
  Megatron-LM and Megatron-Bridge set it False): one key per global expert,
  ``...mlp.experts.experts.{e}.linear_fc1.weight``, and every gated ``linear_fc1`` as its gate and up halves
  ``..._w`` / ``..._v``.

Layouts and forms are detected from the keys: a candidate fits when every key maps to a tensor the config implies
and back to itself (so a mix of spellings fits none); an unknown layout is refused naming its first unmatched key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Collection, Iterable, Literal, Mapping, Sequence

from megatron_glm5.core.hf_config import natural_key

from . import naming
from .errors import BridgeError, TensorSetError

ExpertForm = Literal["stacked", "singleton"]
Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FusedNorm:
    """A norm Transformer Engine fuses into the linear after it (``TELayerNormColumnParallelLinear``): its weight is
    stored as that linear's ``layer_norm_weight``. Only in a layer that has that linear (``{into}.weight``)."""

    norm: str  # module, relative to the layer
    into: str  # the fused linear, relative to the layer

    @property
    def norm_key(self) -> str:
        return f"{self.norm}.weight"

    @property
    def fused_key(self) -> str:
        return f"{self.into}.layer_norm_weight"


PRE_MLP_NORM = FusedNorm("pre_mlp_layernorm", "mlp.linear_fc1")  # dense layers only: MoE layers have no linear_fc1
Q_NORM = FusedNorm("self_attention.q_layernorm", "self_attention.linear_q_up_proj")
KV_NORM = FusedNorm("self_attention.kv_layernorm", "self_attention.linear_kv_up_proj")


@dataclass(frozen=True, slots=True)
class MegatronLayout:
    """One row of the table: the norms it fuses, whether it holds TE extra state, and what writes it."""

    name: str
    fused: tuple[FusedNorm, ...]
    te_extra_state: bool
    written_by: str


LAYOUTS: dict[str, MegatronLayout] = {m.name: m for m in (
    MegatronLayout("local", (), False,
                   "this bridge by default, megatron-glm5 training, megatron-core's local spec"),
    MegatronLayout("te", (PRE_MLP_NORM,), True,
                   "megatron-core 0.19.2's DSA spec with Transformer Engine (NVIDIA Megatron-Bridge GLM5Bridge)"),
    MegatronLayout("te-fused-qk", (PRE_MLP_NORM, Q_NORM, KV_NORM), True,
                   "megatron-core's MLA spec with Transformer Engine (slime's and miles' GLM-5 specs)"),
)}
DEFAULT_LAYOUT = "local"

# Modules that are no Transformer Engine modules in a TE build, hence hold no extra state: the embedding, the router
# (megatron-core's TopKRouter) and the LM head (GPTModel drops its extra state from the checkpoint).
NO_EXTRA_STATE = re.compile(r"^embedding\.|\.router$|^output_layer$")

_LAYER = re.compile(r"^((?:decoder\.layers\.\d+|mtp\.layers\.\d+\.(?:transformer_layer|mtp_model_layer))\.)(.+)$")
_SINGLE_EXPERT = re.compile(r"^(?P<pre>.+\.mlp\.experts)\.experts\.(?P<e>\d+)\.(?P<lin>linear_fc[12])\.weight"
                            r"(?:_(?P<half>[wv]))?$")
_HALF = re.compile(r"^(?P<base>.+\.linear_fc1\.weight)_(?P<half>[wv])$")


def get_layout(name: str, *, allowed: Sequence[str] = tuple(LAYOUTS),
               what: str = "--megatron-layout") -> MegatronLayout:
    """The table row ``name``; an error listing the choices (``allowed``: the model family's)."""
    if name not in allowed:
        raise BridgeError(f"{what} {name!r}: expected one of {', '.join(allowed)}")
    return LAYOUTS[name]


# --------------------------------------------------------------------------------------------------------------------
# Local keys <-> layout keys (norm fusion)
# --------------------------------------------------------------------------------------------------------------------


def to_layout(keys: Iterable[str], layout: MegatronLayout) -> dict[str, str]:
    """``{local key: its key in layout}`` for the given local checkpoint keys that ``layout`` renames. A norm is
    renamed only where its layer has the linear it fuses into (among ``keys``)."""
    keys = set(keys)
    out = {}
    for key in keys:
        m = _LAYER.match(key)
        if m is None:
            continue
        layer, rest = m.groups()
        for f in layout.fused:
            if rest == f.norm_key and f"{layer}{f.into}.weight" in keys:
                out[key] = layer + f.fused_key
    return out


def from_layout(key: str, layout: MegatronLayout) -> str:
    """The local key of one ``layout`` key (inverse of :func:`to_layout`)."""
    m = _LAYER.match(key)
    if m is not None:
        layer, rest = m.groups()
        for f in layout.fused:
            if rest == f.fused_key:
                return layer + f.norm_key
    return key


# --------------------------------------------------------------------------------------------------------------------
# Stored keys -> logical tensors (reading)
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stored:
    """Rows ``[start, start + shape[0])`` of a logical tensor, stored as key ``key`` (or row ``row`` of its stacked
    expert axis)."""

    key: str
    row: int | None
    start: int
    shape: Shape


@dataclass(frozen=True, slots=True)
class LogicalSource:
    """Where a logical tensor is stored: one piece, or (singleton gated ``linear_fc1``) its halves in row order."""

    pieces: tuple[Stored, ...]

    @property
    def shape(self) -> Shape:
        first = self.pieces[0].shape
        return (sum(p.shape[0] for p in self.pieces), *first[1:]) if first else first

    def boxes(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[tuple[str, Shape, Shape]]:
        """The stored boxes ``(key, offsets, sizes)`` that make up the logical box, in row order (concatenate
        along dim 0, each reshaped to its logical sizes)."""
        if len(self.pieces) == 1 and self.pieces[0].start == 0:
            return [_stored_box(self.pieces[0], tuple(offsets), tuple(sizes))]
        lo, hi = offsets[0], offsets[0] + sizes[0]
        out = []
        for p in self.pieces:
            a, b = max(lo, p.start), min(hi, p.start + p.shape[0])
            if a < b:
                out.append(_stored_box(p, (a - p.start, *offsets[1:]), (b - a, *sizes[1:])))
        return out


def _stored_box(p: Stored, offsets: Shape, sizes: Shape) -> tuple[str, Shape, Shape]:
    if p.row is None:
        return p.key, offsets, sizes
    return p.key, (p.row, *offsets), (1, *sizes)


def _base(key: str, form: ExpertForm) -> tuple[str, int | None, str | None] | None:
    """``(local-form key, expert or None, half or None)`` of a stored key in ``form``; None if the key cannot be one
    of that form's (a singleton key in a stacked checkpoint, or a ``linear_fc1`` stored whole in a singleton one)."""
    m = _SINGLE_EXPERT.match(key)
    if m is not None:
        if form != "singleton" or (m["lin"] == "linear_fc1") != (m["half"] is not None):
            return None
        return f"{m['pre']}.experts.{m['lin']}.weight", int(m["e"]), m["half"]
    h = _HALF.match(key)
    if h is not None:
        return (h["base"], None, h["half"]) if form == "singleton" else None
    if form == "singleton" and (naming.expert_stack(key) is not None or key.endswith(".linear_fc1.weight")):
        return None
    return key, None, None


def read_keys(shapes: Mapping[str, Shape], layout: MegatronLayout, form: ExpertForm,
              expected: Iterable[str]) -> tuple[dict[str, LogicalSource], list[str]]:
    """The logical tensors stored under ``shapes`` (stored key -> global shape) read as ``layout`` / ``form``, and
    the keys that do not fit (not of the form, no logical tensor among ``expected``, or not the name ``layout``
    gives that tensor)."""
    expected = set(expected)
    based = {k: _base(k, form) for k in shapes}
    local = {k: from_layout(b[0], layout) for k, b in based.items() if b is not None}
    renamed = to_layout(set(local.values()), layout)
    unmatched = {k for k, b in based.items() if b is None or renamed.get(local[k], local[k]) != b[0]}
    pieces: dict[str, list[Stored]] = {}
    for key, b in based.items():
        if key in unmatched:
            continue
        _, expert, half = b
        shape = tuple(shapes[key])
        if expert is not None:
            pre, lin = naming.expert_stack(local[key]) or ("", "")
            found = [(naming.canonical(f"{pre}.local_experts.{expert}.{lin}.weight"), None, shape)]
        else:
            found = naming.logical_tensors(local[key], shape)
        start = shape[0] if half == "v" else 0
        found = [(name, row, s) for name, row, s in found if name in expected]
        if not found:
            unmatched.add(key)
        for name, row, s in found:
            pieces.setdefault(name, []).append(Stored(key, row, start, tuple(s)))
    sources = {n: LogicalSource(tuple(sorted(p, key=lambda s: s.start))) for n, p in pieces.items()}
    return sources, sorted(unmatched, key=natural_key)


@dataclass(frozen=True, slots=True)
class Resolved:
    """A checkpoint's detected layout and form, and where each logical tensor is stored."""

    layout: MegatronLayout
    form: ExpertForm
    sources: dict[str, LogicalSource]


def resolve_checkpoint(shapes: Mapping[str, Shape], expected: Iterable[str], *, layouts: Sequence[str],
                       source: str, recorded: str | None = None) -> Resolved:
    """Detect the layout and form of a checkpoint's weight keys (``shapes``: stored key -> global shape) among
    ``layouts`` (the model family's) for the logical tensors ``expected``. When several fit (the same keys: e.g. no
    dense layer to fuse a norm into), the one ``recorded`` in the checkpoint's bridge metadata, else the first in
    :data:`LAYOUTS` order. None fitting is an error naming the first unmatched key of the closest candidate."""
    expected = set(expected)
    form = detect_form(shapes)  # a stacked checkpoint has no singleton spelling, and a singleton one needs them
    tried = []
    for name in layouts:
        sources, unmatched = read_keys(shapes, LAYOUTS[name], form, expected)
        tried.append((len(unmatched), name, form, sources, unmatched))
    fitting = [t for t in tried if not t[0]]
    if fitting:
        pick = next((t for t in fitting if t[1] == recorded), fitting[0])
        return Resolved(LAYOUTS[pick[1]], pick[2], pick[3])
    n, name, form, _, unmatched = min(tried, key=lambda t: t[0])
    raise TensorSetError(
        f"{source}: the checkpoint's tensor keys fit no Megatron layout this bridge knows for config.json "
        f"({_choices(layouts)}; read with {form} expert keys): first unmatched key '{unmatched[0]}' "
        f"(closest: the {name} layout, {n} of {len(shapes)} keys unmatched). Either the checkpoint "
        "belongs to another config.json or a tool wrote it with names this bridge does not map "
        "(bridge/megatron_layout.py LAYOUTS)",
        unexpected=unmatched,
    )


def no_mtp_hint(missing: Iterable[str]) -> str:
    """A fix for a checkpoint without the MTP layer config.json announces (NVIDIA Megatron-Bridge builds GLM-5 with
    ``mtp_num_layers=None`` by default), when MTP tensors are all that is missing; else ''."""
    missing = list(missing)
    if missing and all(k.startswith("mtp.") for k in missing):
        return ("; the checkpoint has no MTP layer (NVIDIA Megatron-Bridge trains GLM-5 without one by default): use a "
                "config.json with \"num_nextn_predict_layers\": 0 (--hf-config / hf_config=) to read it without MTP")
    return ""


def _choices(layouts: Sequence[str]) -> str:
    return ", ".join(f"{n}: {LAYOUTS[n].written_by}" for n in layouts)


def detect_form(keys: Iterable[str]) -> ExpertForm:
    """``singleton`` when a key has the singleton form's spelling (an expert index or a ``_w`` / ``_v`` half)."""
    return "singleton" if any(_SINGLE_EXPERT.match(k) or _HALF.match(k) for k in keys) else "stacked"


# --------------------------------------------------------------------------------------------------------------------
# Loading into a model: its sharded state dict keyed as the checkpoint stores it
# --------------------------------------------------------------------------------------------------------------------


def checkpoint_sharded_state_dict(
    model, tensor_keys: Collection[str], object_keys: Collection[str], *, source: str,
    layouts: Sequence[str] = tuple(LAYOUTS),
) -> tuple[dict, MegatronLayout, ExpertForm]:
    """``model.sharded_state_dict()`` (this rank's; our models always use local keys) with its keys renamed to the
    checkpoint's Megatron layout and built in its expert form, for megatron-core's ``dist_checkpointing.load``: the
    renaming is of keys only (boxes, replicas and factories are megatron-core's), so any TP / PP / EP reshards as
    usual. The layout is the first of ``layouts`` under which every key the model asks for is in the checkpoint
    (``tensor_keys``); extra-state objects the checkpoint lacks (``object_keys``) are not asked for (they are not
    weights; the local modules that have them ignore them). Returns ``(sharded state dict, layout, form)``."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    tensor_keys, object_keys = set(tensor_keys), set(object_keys)
    form = detect_form(tensor_keys)
    ssd = model.sharded_state_dict(metadata={"singleton_local_shards": True} if form == "singleton" else None)
    _, ssd = extract_matching_values(ssd, lambda v: isinstance(v, ShardedObject) and v.unique_key not in object_keys
                                     and "._extra_state/" in v.unique_key)
    tensors = [v for v in nested_values(ssd) if isinstance(v, ShardedTensor)]
    # a factory (the gated linear_fc1's gate / up split) reads the keys of the tensors it builds; no layout renames it
    built = {t.key for v in nested_values(ssd) if isinstance(v, ShardedTensorFactory)
             for t in nested_values(v.build())}
    own = {v.key for v in nested_values(ssd) if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
    tried = []
    for name in layouts:
        renamed = to_layout(own, LAYOUTS[name])
        wanted = {renamed.get(t.key, t.key) for t in tensors} | built
        unmatched = sorted(wanted - tensor_keys, key=natural_key)
        tried.append((len(unmatched), name, renamed, unmatched, len(wanted)))
        if not unmatched:
            break
    n, name, renamed, unmatched, asked = min(tried, key=lambda t: t[0])
    if n:
        raise TensorSetError(
            f"{source}: the checkpoint's tensor keys fit none of the Megatron layouts the model can load "
            f"({_choices(layouts)}; {form} experts): first key the model asks for and the checkpoint lacks "
            f"'{unmatched[0]}' (closest: the {name} layout, {n} of {asked} keys missing). Either the checkpoint "
            "belongs to another config.json or a tool wrote it with names this bridge does not map "
            f"(bridge/megatron_layout.py LAYOUTS){no_mtp_hint(unmatched)}",
            missing=unmatched,
        )
    for t in tensors:
        t.key = renamed.get(t.key, t.key)
    return ssd, LAYOUTS[name], form


# --------------------------------------------------------------------------------------------------------------------
# Writing: chunk keys and TE extra state
# --------------------------------------------------------------------------------------------------------------------


def te_extra_state(keys: Mapping[str, int | None]) -> dict[str, "torch.Tensor"]:
    """TE's ``_extra_state`` objects for the modules of a TE layout's weight keys (``keys``: stored key -> number of
    experts stacked in it, or None), keyed as megatron-core stores ``ShardedObject`` s (``{module}._extra_state``
    + ``/shard_{offset}_{shape}``; per expert along the expert axis), each what TE serialises without FP8 metadata
    (an empty byte tensor)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for key, experts in keys.items():
        module = key.rsplit(".", 1)[0]
        if NO_EXTRA_STATE.search(module):
            continue
        shards = [f"{e}_{experts}" for e in range(experts)] if experts else ["0_1"]
        for shard in shards:
            out[f"{module}._extra_state/shard_{shard}"] = torch.empty(0, dtype=torch.uint8)
    return out


def stored_layout_keys(logical: Iterable[str], layout: MegatronLayout) -> dict[str, int | None]:
    """Every stored key (stacked form, in ``layout``) of the logical tensors, with its number of stacked experts."""
    stacked: dict[str, int | None] = {}
    for name in logical:
        key, row = naming.stored_key(name)
        stacked[key] = max(stacked.get(key) or 0, row + 1) if row is not None else None
    renamed = to_layout(stacked, layout)
    return {renamed.get(k, k): n for k, n in stacked.items()}


__all__ = ["DEFAULT_LAYOUT", "LAYOUTS", "ExpertForm", "FusedNorm", "LogicalSource", "MegatronLayout",
           "Resolved", "Stored", "checkpoint_sharded_state_dict", "detect_form", "from_layout", "get_layout",
           "no_mtp_hint", "read_keys", "resolve_checkpoint", "stored_layout_keys", "te_extra_state", "to_layout"]
