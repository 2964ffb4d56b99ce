"""LoRA for GLM-5.x on megatron-core: :class:`LoraConfig` and :func:`add_lora`.

``add_lora(model, LoraConfig(r=16, alpha=32))`` wraps the targeted linears of a built ``GPTModel`` (either attention
backend, any TP / SP / EP / PP layout, MTP layers included) and freezes every base weight. Targets are HF names
(``q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, gate_proj, up_proj, down_proj`` and the indexer's
``wq_b, wk, weights_proj``), megatron-core names (``linear_q_down_proj, ...``) or groups (``attention``,
``indexer``, ``routed_experts``, ``dense_mlp``, ``shared_experts``: every linear of the group). The MLP names mean
what they mean to peft on transformers 5: the routed experts (one adapter per expert). The dense MLP and the shared
experts are adapted only when their group is named (``target_modules=(*DEFAULT_TARGET_MODULES, "dense_mlp",
"shared_experts")``): an HF PEFT adapter cannot hold them (:mod:`bridge.adapters`), so the defaults - attention and
routed experts - are exactly what ``bridge.export_peft_adapter`` can write; adapters on them are merge-only. A
target that matches no module of the model is refused with the names the model has. A wrapped linear keeps its
parameter names (adapters are child modules ``lora_A`` / ``lora_B``); weight-read linears (``kv_b_proj``) reach the
attention through :func:`megatron_glm5.dsa.hooks.linear_weight`.

Why our own wrapper instead of peft's megatron-core layers, the per-layout sharding of the factors, initialisation,
the frozen base and what is refused: ``docs/design/lora.md``.
"""

from __future__ import annotations

import math
import re
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, Sequence

import torch

from . import compat
from .lora_layers import (
    LoraColumn,
    LoraDuplicated,
    LoraFactor,
    LoraLinear,
    LoraRow,
    LoraWeightRead,
    _kind_of,
    _lora_class,
    base_only,
    linear_weight,
)

# --------------------------------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------------------------------

HF_TO_MEGATRON: dict[str, str] = {
    "q_a_proj": "linear_q_down_proj",
    "q_b_proj": "linear_q_up_proj",
    "kv_a_proj_with_mqa": "linear_kv_down_proj",
    "kv_b_proj": "linear_kv_up_proj",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
    "wq_b": "linear_wq_b",
    "wk": "linear_wk",
    "weights_proj": "linear_weights_proj",
}
MEGATRON_TARGETS: tuple[str, ...] = (
    "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj",
    "linear_fc1", "linear_fc2", "linear_wq_b", "linear_wk", "linear_weights_proj",
)
INDEXER_TARGETS = frozenset({"linear_wq_b", "linear_wk", "linear_weights_proj"})
DEFAULT_TARGET_MODULES: tuple[str, ...] = (
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)
# Groups usable in ``exclude_modules`` (besides target names and regular expressions on module names).
SCOPES = ("attention", "indexer", "dense_mlp", "shared_experts", "routed_experts", "mtp")
# Groups usable in ``target_modules``: every linear of the group. The dense MLP and shared experts are reached only
# this way (no HF PEFT representation), never by the MLP names.
TARGET_GROUPS = ("attention", "indexer", "routed_experts", "dense_mlp", "shared_experts")
MERGE_ONLY_GROUPS = frozenset({"dense_mlp", "shared_experts"})

# Where each target lives, relative to a decoder (or MTP inner) layer; ``{e}`` is the global expert id.
_MODULE_RE = re.compile(
    r"^(?P<layer>decoder\.layers\.\d+|mtp\.layers\.\d+\.mtp_model_layer)\."
    r"(?P<rest>self_attention\.(?:core_attention\.indexer\.)?linear_\w+"
    r"|mlp\.(?:shared_experts\.|experts\.local_experts\.\d+\.)?linear_fc[12])$"
)


def _valid_targets() -> list[str]:
    return sorted(HF_TO_MEGATRON) + list(MEGATRON_TARGETS) + list(TARGET_GROUPS) + ["all-linear"]


def resolve_targets(names: Iterable[str]) -> tuple[str, ...]:
    """HF or megatron target names -> megatron-core linear names (sorted, unique). ``gate_proj`` and ``up_proj`` are
    one megatron linear (``linear_fc1``), so they come together; ``all-linear`` is :data:`DEFAULT_TARGET_MODULES`."""
    names = [n for n in names if n not in TARGET_GROUPS]
    unknown = [n for n in names if n not in HF_TO_MEGATRON and n not in MEGATRON_TARGETS and n != "all-linear"]
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {unknown}; valid targets: {_valid_targets()} (the indexer's "
                         "wq_b/wk/weights_proj receive no gradient from the LM loss)")
    if "all-linear" in names:
        names = [n for n in names if n != "all-linear"] + list(DEFAULT_TARGET_MODULES)
    halves = {"gate_proj", "up_proj"} & set(names)
    if len(halves) == 1:
        (have,) = halves
        other = ({"gate_proj", "up_proj"} - halves).pop()
        raise ValueError(f"LoRA target {have!r} without {other!r}: gate_proj and up_proj are one megatron-core linear "
                         "(linear_fc1 = [gate; up]) and get one adapter; target both (or linear_fc1)")
    return tuple(sorted({HF_TO_MEGATRON.get(n, n) for n in names}, key=MEGATRON_TARGETS.index))


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """LoRA hyper-parameters and targets.

    ``r`` / ``alpha``: rank and scale (``alpha / r``); ``linear_fc1`` (gate + up) adapters get rank ``2r`` and
    alpha ``2*alpha``, as peft does for transformers' fused ``gate_up_proj``. ``target_modules``: HF or megatron names
    (see :func:`resolve_targets`; the MLP names reach the routed experts) and groups (:data:`TARGET_GROUPS`; the only
    way to reach the dense MLP and shared experts, whose adapters HF PEFT cannot hold). The default is attention +
    routed experts: what ``bridge.export_peft_adapter`` writes. ``exclude_modules``: target names, groups
    (:data:`SCOPES`: ``attention``,
    ``indexer``, ``dense_mlp``, ``shared_experts``, ``routed_experts``, ``mtp``) or regular expressions searched in
    module names such as ``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1``. ``init_lora_weights=False``
    draws ``B`` at random too (non-zero adapter from the start; for tests), ``seed`` seeds the initialisation."""

    r: int
    alpha: float
    dropout: float = 0.0
    target_modules: Sequence[str] = DEFAULT_TARGET_MODULES
    exclude_modules: Sequence[str] = ()
    init_lora_weights: bool = True
    seed: int = 0
    targets: tuple[str, ...] = field(init=False, repr=False, compare=False)
    groups: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.r!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        for name in ("target_modules", "exclude_modules"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        if not self.target_modules:
            raise ValueError(f"LoraConfig.target_modules is empty; valid targets: {_valid_targets()}")
        names = [n for n in self.target_modules if n not in TARGET_GROUPS]
        object.__setattr__(self, "targets", resolve_targets(names) if names else ())
        object.__setattr__(self, "groups", frozenset(n for n in self.target_modules if n in TARGET_GROUPS))

    def selects(self, target: str, group: str) -> bool:
        """Whether a linear (megatron ``target`` name, :func:`scope_of` ``group``) is a target: its group is named,
        or its name is and it is not in a merge-only group (dense MLP, shared experts)."""
        if group in self.groups:
            return True
        return group not in MERGE_ONLY_GROUPS and target in self.targets

    def rank_for(self, target: str) -> int:
        return 2 * self.r if target == "linear_fc1" else self.r

    def alpha_for(self, target: str) -> float:
        return 2 * self.alpha if target == "linear_fc1" else self.alpha

    def to_dict(self) -> dict:
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout, "target_modules": list(self.target_modules),
                "exclude_modules": list(self.exclude_modules), "init_lora_weights": self.init_lora_weights,
                "seed": self.seed}

    @classmethod
    def from_dict(cls, d: dict) -> "LoraConfig":
        return cls(**{k: d[k] for k in ("r", "alpha", "dropout", "target_modules", "exclude_modules",
                                         "init_lora_weights", "seed") if k in d})


def scope_of(name: str) -> tuple[str, str] | None:
    """(megatron target, group) of a logical module name, or None if it is not a LoRA target."""
    m = _MODULE_RE.match(name)
    if m is None:
        return None
    rest = m["rest"]
    target = rest.rsplit(".", 1)[1]
    if target not in MEGATRON_TARGETS:
        return None
    if ".indexer." in rest:
        group = "indexer"
    elif rest.startswith("self_attention."):
        group = "attention"
    elif ".shared_experts." in rest:
        group = "shared_experts"
    elif ".local_experts." in rest:
        group = "routed_experts"
    else:
        group = "dense_mlp"
    return target, group


def _excluded(name: str, target: str, group: str, patterns: Sequence[str]) -> str | None:
    """The pattern of ``exclude_modules`` that excludes this module, if any."""
    hf = {k for k, v in HF_TO_MEGATRON.items() if v == target}
    for p in patterns:
        if p == target or p in hf or p == group or (p == "mtp" and name.startswith("mtp.")):
            return p
        if p not in SCOPES and p not in HF_TO_MEGATRON and p not in MEGATRON_TARGETS and re.search(p, name):
            return p
    return None


# --------------------------------------------------------------------------------------------------------------------
# add_lora
# --------------------------------------------------------------------------------------------------------------------


LORA_CONFIG_ATTR = "glm5_lora_config"  # the LoraConfig, kept on the model for export / checkpoints


def _chunks(model) -> list[torch.nn.Module]:
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    for m in models:
        if not hasattr(m, "decoder") and hasattr(m, "module"):
            raise TypeError(f"add_lora expects the bare GPTModel; got a {type(m).__name__} wrapper: call add_lora "
                            "before wrapping the model in DistributedDataParallel / Float16Module")
    return models


def logical_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(logical name, module)`` for every module of ``model``: the name a TP=PP=EP=1 model would use (global
    decoder-layer index from ``layer_number``, global expert id), matching the bridge's table."""
    experts: dict[str, int] = {}  # "<...>.mlp.experts" -> global id of local expert 0
    for name, module in model.named_modules():
        if hasattr(module, "local_experts") and hasattr(module, "ep_group"):
            experts[name] = module.ep_group.rank() * module.num_local_experts
    layers = {}
    decoder = getattr(model, "decoder", None)
    if decoder is not None:
        layers = {i: layer.layer_number - 1 for i, layer in enumerate(decoder.layers)}
    for name, module in model.named_modules():
        logical = name
        m = re.match(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)(?=\.|$)", name)
        if m and m[1] in experts:
            logical = f"{m[1]}.local_experts.{experts[m[1]] + int(m[2])}{name[m.end():]}"
        m = re.match(r"^decoder\.layers\.(\d+)(?=\.|$)", logical)
        if m:
            logical = f"decoder.layers.{layers[int(m[1])]}{logical[m.end():]}"
        yield logical, module


def _global_factors(name: str, rank: int, in_features: int, out_features: int, config: LoraConfig,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapter's global ``A [rank, in]`` and ``B [out, rank]``, drawn on CPU from a generator seeded by the
    config seed and the module's logical name (identical on every rank and for every parallel layout)."""
    gen = torch.Generator().manual_seed((config.seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    bound_a = 1.0 / math.sqrt(in_features)  # peft: kaiming_uniform_(a=sqrt(5)) on [rank, in]
    a = (torch.rand(rank, in_features, generator=gen, dtype=torch.float64) * 2 - 1) * bound_a
    if config.init_lora_weights:
        b = torch.zeros(out_features, rank, dtype=torch.float64)
    else:  # peft's init_lora_weights=False: nn.Linear's default on B as well
        b = (torch.rand(out_features, rank, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(rank)
    return a.to(dtype), b.to(dtype)


def tp_rank_size(module) -> tuple[int, int]:
    g = getattr(module, "tp_group", None)
    if g is None:
        return 0, 1
    return g.rank(), g.size()


def local_rows(t: torch.Tensor, rank: int, size: int, swiglu: bool) -> torch.Tensor:
    """This TP rank's rows of a column-parallel global tensor (``[gate_t; up_t]`` for a SwiGLU fc1)."""
    if size == 1:
        return t
    if swiglu:
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    return t.chunk(size, dim=0)[rank]


def _attach(module, mixin: type, name: str, target: str, config: LoraConfig, *, trainable: bool,
            rank_alpha: tuple[int, float] | None = None) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    rank, alpha = rank_alpha if rank_alpha is not None else (config.rank_for(target), config.alpha_for(target))
    weight = module.weight
    tp_rank, tp_size = tp_rank_size(module) if mixin is not LoraDuplicated else (0, 1)
    swiglu = target == "linear_fc1" and bool(module.config.gated_linear_unit)
    if mixin is LoraRow:
        out_f, in_f = weight.shape[0], weight.shape[1] * tp_size
    elif mixin is LoraDuplicated:
        out_f, in_f = weight.shape
    else:
        out_f, in_f = weight.shape[0] * tp_size, weight.shape[1]
    a, b = _global_factors(name, rank, in_f, out_f, config, weight.dtype)
    if mixin is LoraRow:
        a = a.chunk(tp_size, dim=1)[tp_rank] if tp_size > 1 else a
    elif mixin is not LoraDuplicated:
        b = local_rows(b, tp_rank, tp_size, swiglu)
    a = a.contiguous().to(weight.device) if weight.device.type != "meta" else torch.empty_like(a, device="meta")
    b = b.contiguous().to(weight.device) if weight.device.type != "meta" else torch.empty_like(b, device="meta")

    compat.swap_class(module, _lora_class(mixin, type(module)))
    module.lora_A = LoraFactor(a)
    module.lora_B = LoraFactor(b)
    module.lora_dropout = torch.nn.Dropout(config.dropout) if config.dropout else torch.nn.Identity()
    module.lora_rank, module.lora_alpha, module.lora_scaling = rank, alpha, alpha / rank
    module.lora_name, module.lora_swiglu = name, swiglu

    base_allreduce = getattr(weight, "allreduce", True)
    sp = bool(getattr(module.config, "sequence_parallel", False)) and tp_size > 1
    for factor, parallel_dim in ((module.lora_A, 1 if mixin is LoraRow else None),
                                 (module.lora_B, 0 if mixin in (LoraColumn, LoraWeightRead) else None)):
        p = factor.weight
        p.requires_grad_(trainable)
        p.allreduce = base_allreduce  # experts: reduced over expert-DP, like their base weight
        if parallel_dim is not None and tp_size > 1:
            set_tensor_model_parallel_attributes(p, True, parallel_dim, 1)
        else:
            p.tensor_model_parallel = False
    # Replicated factors computed on this rank's SP rows: finalize_model_grads sums them over TP.
    if mixin is LoraDuplicated:
        for p in (module.lora_A.weight, module.lora_B.weight):
            p.sequence_parallel = bool(getattr(weight, "sequence_parallel", False))
    elif not module.explicit_expert_comm and sp:
        if mixin is LoraColumn:
            module.lora_A.weight.sequence_parallel = True
        elif mixin is LoraRow:
            module.lora_B.weight.sequence_parallel = True


def _check_config(config) -> None:
    if getattr(config, "qk_clip", False):
        raise NotImplementedError("LoRA with qk_clip: MuonClip rewrites linear_q_up_proj / linear_kv_up_proj .weight "
                                  "in place and would clip only the frozen base; turn qk_clip off")
    if getattr(config, "cache_mla_latents", False):
        raise NotImplementedError("LoRA with cache_mla_latents: the absorbed kv_b weight would be cached once, "
                                  "without the adapter; turn cache_mla_latents off")
    if config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        raise NotImplementedError("LoRA at tensor_model_parallel_size > 1 needs sequence_parallel=True "
                                  "(megatron-core's AbsorbedMLA requires it as well)")


def _embedding_output_requires_grad(module, args, output):
    """Forward hook (HF's ``enable_input_require_grads``): with a frozen embedding, megatron-core's reentrant
    activation checkpoint of the first layers would otherwise see no input requiring grad and skip their
    adapters in backward."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad \
            and not output.is_inference():
        output.requires_grad_(True)
    return output


def add_lora(model, config: LoraConfig, *, only: Mapping[str, tuple[int, float]] | None = None):
    """Wrap the targeted linears of ``model`` (a built megatron-core ``GPTModel``, or a list of virtual-pipeline
    chunks) with LoRA adapters, freeze every base parameter, and return ``model``.

    Call it after the model is built (and its base weights loaded or about to be loaded: base parameter names do
    not change) and before wrapping it in DDP. ``only`` (internal: PEFT import) restricts the adapters to these
    logical module names, with their own ``(rank, alpha)``."""
    if not isinstance(config, LoraConfig):
        raise TypeError(f"add_lora expects a megatron_glm5.lora.LoraConfig, got {type(config).__name__}")
    chunks = _chunks(model)
    only_set = None if only is None else dict(only)
    indexer = sorted(INDEXER_TARGETS & set(config.targets)) + (["indexer"] if "indexer" in config.groups else [])
    if indexer:
        warnings.warn(
            f"LoRA on the DSA indexer ({', '.join(indexer)}): the indexer runs without gradient (its top-k is "
            "discrete), so the LM loss sends these adapters no gradient; they are added frozen (loadable, used in "
            "forward and exported) and are not trained", stacklevel=2)
    planned: list[tuple[str, torch.nn.Module, str]] = []
    used_excludes: set[str] = set()
    present: set[tuple[str, str]] = set()  # (target, group) of every adaptable linear of this rank's chunks
    for chunk in chunks:
        _check_config(chunk.config)
        for name, module in logical_modules(chunk):
            scope = scope_of(name)
            if scope is None:
                continue
            target, group = scope
            present.add(scope)
            if only_set is not None:
                if name not in only_set:
                    continue
            elif not config.selects(target, group):
                continue
            hit = _excluded(name, target, group, config.exclude_modules)
            if hit is not None:
                used_excludes.add(hit)
                continue
            planned.append((name, module, target))
    if only_set is None:
        _check_targets_match(config, present, chunks)
    if not planned:
        raise ValueError(f"LoRA: no module of the model matches target_modules={list(config.target_modules)} "
                         f"(exclude_modules={list(config.exclude_modules)})")
    unused = [p for p in config.exclude_modules if p not in used_excludes]
    if unused and only is None:
        warnings.warn(f"LoRA exclude_modules {unused} matched no targeted module", stacklevel=2)
    kinds = [(name, module, target, _kind_of(module, target)) for name, module, target in planned]
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
    for name, module, target, mixin in kinds:
        _attach(module, mixin, name, target, config, trainable=target not in INDEXER_TARGETS,
                rank_alpha=None if only_set is None else only_set[name])
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, LanguageModelEmbedding) and not getattr(module, "_glm5_lora_hook", None):
                module._glm5_lora_hook = module.register_forward_hook(_embedding_output_requires_grad)
        setattr(chunk, LORA_CONFIG_ATTR, config)
    return model


def _entry_matches(entry: str, config: LoraConfig, target: str, group: str) -> bool:
    if entry in TARGET_GROUPS:
        return group == entry
    return HF_TO_MEGATRON.get(entry, entry) == target and config.selects(target, group)


def _present_everywhere(present: set[tuple[str, str]], chunks) -> set[tuple[str, str]]:
    """``present`` united over the pipeline stages: a stage holds only its own layers (the dense MLP may live on the
    first stage alone), and whether a target matches is a property of the whole model."""
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state as ps

        pp = ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    except (ImportError, AssertionError, RuntimeError):
        pp = 1
    if pp <= 1 or not dist.is_initialized():
        return present
    group = ps.get_pipeline_model_parallel_group()
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, sorted(present), group=group)
    return {tuple(x) for stage in everyone for x in stage}


def _check_targets_match(config: LoraConfig, present: set[tuple[str, str]], chunks) -> None:
    """Refuse a ``target_modules`` entry that reaches no linear of the model (a misspelled intent, e.g. the dense
    MLP's ``gate_proj`` without ``dense_mlp``, or the indexer of a model without one), naming what the model has."""
    if tuple(config.target_modules) == DEFAULT_TARGET_MODULES:
        return  # not the user's words: a model without routed experts simply gets attention adapters
    everywhere = _present_everywhere(present, chunks)
    unmatched = [e for e in config.target_modules if e != "all-linear"
                 and not any(_entry_matches(e, config, t, g) for t, g in everywhere)]
    if not unmatched:
        return
    targets = [t for t in MEGATRON_TARGETS if any(t == x for x, _ in everywhere)]
    hf = sorted(h for h, m in HF_TO_MEGATRON.items() if m in targets)
    groups = [g for g in TARGET_GROUPS if any(g == y for _, y in everywhere)]
    hint = ""
    if any(HF_TO_MEGATRON.get(e, e) in ("linear_fc1", "linear_fc2") for e in unmatched):
        hint = ("; the MLP names reach the routed experts only: name 'dense_mlp' / 'shared_experts' for the dense MLP "
                "and the shared experts")
    raise ValueError(f"LoRA target_modules {unmatched} match no module of this model; it has HF names {hf}, "
                     f"megatron names {targets} and groups {groups}{hint}")


# --------------------------------------------------------------------------------------------------------------------
# Helpers for code that reads weights, exporters and checkpoints
# --------------------------------------------------------------------------------------------------------------------


def lora_modules(model) -> list[LoraLinear]:
    """Every adapted linear of ``model`` (or of a list of chunks), in module order."""
    return [m for chunk in _chunks(model) for m in chunk.modules() if isinstance(m, LoraLinear)]


def lora_config(model) -> LoraConfig | None:
    chunks = _chunks(model)
    return getattr(chunks[0], LORA_CONFIG_ATTR, None)


def is_lora_parameter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every adapter factor (this rank's shards)."""
    return [(n, p) for chunk in _chunks(model) for n, p in chunk.named_parameters() if is_lora_parameter(n)]


class MergedWeights:
    """Base weight + LoRA delta for tensors that alias (a row range of) an adapted linear's local weight: used by
    exporters that stream a model's sharded state dict box by box (one box's delta at a time)."""

    def __init__(self, model):
        # several weights may share one storage (TorchGroupedMLP co-locates its experts' weights): a list per storage
        self._by_storage: dict[int, list[LoraLinear]] = {}
        for m in lora_modules(model):
            self._by_storage.setdefault(m.weight.untyped_storage().data_ptr(), []).append(m)

    def _owner(self, t: torch.Tensor) -> LoraLinear | None:
        """The adapted linear whose weight's elements include ``t``'s first element."""
        if t.device.type == "meta":
            return None
        off = t.storage_offset()
        for m in self._by_storage.get(t.untyped_storage().data_ptr(), ()):
            if m.weight.storage_offset() <= off < m.weight.storage_offset() + m.weight.numel():
                return m
        return None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        m = self._owner(t)
        if m is None:
            return t
        w = m.weight
        if t.dim() != w.dim() or t.shape[1:] != w.shape[1:] or t.stride() != w.stride():
            raise AssertionError(f"{m.lora_name}: a checkpoint box that is not a row range of the weight")
        start = (t.storage_offset() - w.storage_offset()) // w.stride(0)
        with torch.no_grad():
            delta = m.lora_delta()[start:start + t.shape[0]]
            return (t.float() + delta.float()).to(t.dtype)


__all__ = [
    "DEFAULT_TARGET_MODULES", "HF_TO_MEGATRON", "INDEXER_TARGETS", "LORA_CONFIG_ATTR", "LoraColumn", "LoraConfig",
    "LoraDuplicated", "LoraLinear", "LoraRow", "LoraWeightRead", "MEGATRON_TARGETS", "MergedWeights", "SCOPES",
    "add_lora", "base_only", "is_lora_parameter", "linear_weight", "logical_modules", "lora_config", "lora_modules",
    "lora_parameters", "resolve_targets", "scope_of", "TARGET_GROUPS",
]
