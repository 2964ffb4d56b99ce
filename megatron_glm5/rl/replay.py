"""Indexer top-k replay and MoE routing replay (R3): the rollout engine's per-layer choices, fed to our model.

**What is replayed where.** A "full" (indexer) layer attends with the rollout's top-k instead of running its indexer;
an IndexShare "shared" layer keeps reusing its source layer's top-k, which is now the replayed one (so the payload's
copies for shared layers are only checked, never used); an MTP layer replays when the payload carries it (sglang's
does not: MTP then runs its own indexer). Every MoE router takes the rollout's expert ids and recomputes their
weights from our own scores (megatron-core's ``RouterReplay`` semantics: ``probs = scores.gather(ids)``).

**Families.** The layers come from :class:`~megatron_glm5.inventory.LayerInventory`, so GLM-5.x and GLM-5.3-Flash
replay alike: a payload row is as wide as the full layers' own top-k (``index_topk``; GLM-5.3-Flash's KPool rows are
``index_topk + index_kpool - 1``: selected pools expanded to tokens, then the tail), payload rows of layers that take
no replay (GLM-5.3-Flash's KDA layers for the indexer, dense layers for routing) are ignored as sglang's
every-layer format defines them, and a payload that no layer of the model can take raises
:class:`ReplayLayerError`; a layer of no registered family raises
:class:`~megatron_glm5.inventory.UnknownLayerError`. Nothing is dropped without a word.

**How it enters the model** (nothing in megatron-core or our layers is patched; :class:`ReplayHooks` installs two
per-instance hooks on a built model, once):

* each full layer's core attention gets an instance-level ``compute_topk`` that returns the replayed rows instead
  of running the indexer (or runs it too, only to measure the overlap, when statistics are requested). The attention
  then uses exactly those indices, bounds-checks them on device, and passes them on like its own: to the IndexShare
  layers (layer ``context``) and to the activation-recompute stash (:mod:`megatron_glm5.core.layer`), so a full-layer
  recompute in backward replays the same indices with no replay data in sight;
* each MoE router's ``router_replay`` slot (megatron-core's hook for exactly this) holds a :class:`GLMRouterReplay`,
  a ``RouterReplay`` that takes the rows of the running micro-batch, falls back to its own choice on tokens without
  data, counts disagreements, and stashes its ids on the activation checkpoint so a recompute routes identically.
  megatron-core's own ``RouterReplay`` API (``set_target_indices`` / actions) keeps working on it.

Per micro-batch the data is made current with :meth:`ReplayHooks.active`, around the model's forward only.

**Memory.** For one micro-batch a rank holds, in host memory (pinned when CUDA exists), only what its layers read:
``full layers on this pipeline stage (+ replayed MTP) x rows x topk_width x 4`` bytes for the indexer and
``MoE layers on the stage x rows x router_topk x 4`` for routing, where ``rows`` is the rank's share of the tokens
(``T / TP`` under sequence parallelism, a further ``/ CP`` under context parallelism). One layer's rows are copied to
the device when it runs, with the next layer's copy already under way (two layers staged at most), then all-gathered
over the TP group (attention needs every row of its sequence; that ``[T, topk_width]`` tensor is what the kernel reads,
as with a top-k the indexer computed). E.g. GLM-5.2 (21 full layers of 78 + MTP), 32K tokens per micro-batch, TP=8:
22 x 4096 x 2048 x 4 B = 0.74 GB host per rank, 2 x 32 MB device staging plus the layer's gathered 256 MB; the miles
fork's buffers (all 78 layers, every token, preallocated) come to 78-128 GB per rank.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.moe.router_replay import RouterReplay

from .. import compat
from ..dsa.layout import TokenLayout
from ..inventory import LayerInventory
from ..core.layer import replayed_topk, stash_topk
from .model_io import forward_kwargs, model_device, unwrap
from .packing import PackedBatch, ParallelSizes, RankPlan
from .payload import (
    LayerSelection,
    ReplayPayloadError,
    decode_sample,
    indexer_row_check,
    routing_row_check,
    split_packed,
)

OVERLAP_WARN_BELOW = 0.8  # miles' indexer-replay check uses the same bar


class ReplayOverlapWarning(RuntimeWarning):
    """Replayed and freshly computed indexer top-k agree less than the warning threshold on some layer."""


class ReplayLayerError(ReplayPayloadError):
    """A replay payload was given for a model none of whose layers can take it (no full DSA layer for an indexer
    top-k, no MoE router for routed experts): it is refused rather than dropped."""


# ------------------------------------------------------------------------------------------------------------------
# The model's replayable layers on this rank
# ------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelLayers:
    """The layers of a built GPTModel (this pipeline stage) that replay touches, from the family-neutral
    :class:`~megatron_glm5.inventory.LayerInventory` (so GLM-5.x and GLM-5.3-Flash alike). Keys: decoder layer ``i``
    (0-based, global) or ``num_layers + k`` for MTP layer ``k``.

    ``topk_width`` is the full layers' own top-k width (their core attention's: ``index_topk`` for GLM-5.x,
    ``index_topk + index_kpool - 1`` for GLM-5.3-Flash's KPool with its tail), None when this stage has none."""

    num_layers: int
    mtp_layers: int
    topk_width: int | None
    full: dict[int, Any]  # key -> core attention of a full layer
    shared_source: dict[int, int]  # local shared layer -> its source full layer
    routers: dict[int, Any]  # key -> TopKRouter
    moe_layers: tuple[int, ...]  # global decoder MoE layers (all stages)
    num_experts: int
    router_topk: int
    pipeline_stages: int
    tp_group: Any  # for the sequence-parallel all-gather of indexer rows (None without SP)
    mlp_chunks: int = 1  # megatron-core's mlp_chunks_for_training: routers then see chunk-sized inputs

    @classmethod
    def of(cls, model) -> "ModelLayers":
        inv = LayerInventory.of(model)
        config = inv.config
        tp_group = None
        if config.sequence_parallel and config.tensor_model_parallel_size > 1:
            from megatron.core import parallel_state as ps

            tp_group = ps.get_tensor_model_parallel_group()
        return cls(num_layers=inv.num_layers, mtp_layers=inv.mtp_layers, topk_width=inv.topk_width(),
                   full={k: e.core_attention for k, e in inv.full.items()}, shared_source=inv.shared_sources,
                   routers=inv.routers, moe_layers=inv.moe_layers(), num_experts=config.num_moe_experts or 0,
                   router_topk=config.moe_router_topk, pipeline_stages=config.pipeline_model_parallel_size,
                   tp_group=tp_group, mlp_chunks=config.mlp_chunks_for_training)

    def layer_name(self, key: int) -> str:
        return f"{key}" if key < self.num_layers else f"MTP {key - self.num_layers} (payload layer {key})"

    def refuse_unless(self, present: bool, what: str, needs: str) -> None:
        """A payload that no layer of a single-stage model can take is an error (under pipeline parallelism a stage
        without such layers simply has nothing to replay: the other stages take it)."""
        if not present and self.pipeline_stages == 1:
            raise ReplayLayerError(f"{what}: the model has no {needs}, so the payload cannot be replayed; pass None "
                                   "for it")


# ------------------------------------------------------------------------------------------------------------------
# Host staging: per layer, this rank's rows, streamed to the device one layer ahead
# ------------------------------------------------------------------------------------------------------------------


class StagedRows:
    """Per layer key an int32 host tensor ``[s_l, b, k]`` (pinned when CUDA exists). :meth:`fetch` returns a device
    copy of one layer, issuing the next layer's copy on a side stream (CUDA) so it overlaps that layer's compute."""

    def __init__(self, host: dict[int, torch.Tensor], device: torch.device):
        self.host = dict(sorted(host.items()))
        self.device = device
        self._order = list(self.host)
        self._staged: dict[int, tuple[torch.Tensor, Any]] = {}
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.max_staged = 0  # most layers on the device at once: the one in use + those in flight (the bound is 2)

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def __contains__(self, key: int) -> bool:
        return key in self.host

    def _issue(self, key: int) -> None:
        if key in self._staged or key not in self.host:
            return
        src = self.host[key]
        if self._stream is None:
            self._staged[key] = (src.to(self.device, copy=True), None)
        else:
            with torch.cuda.stream(self._stream):
                dst = src.to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._staged[key] = (dst, event)

    def fetch(self, key: int) -> torch.Tensor:
        self._issue(key)
        dst, event = self._staged.pop(key)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            dst.record_stream(torch.cuda.current_stream(self.device))
        i = self._order.index(key)
        if i + 1 < len(self._order):
            self._issue(self._order[i + 1])
        self.max_staged = max(self.max_staged, len(self._staged) + 1)
        return dst


def _host_buffer(shape, fill: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.int32, pin_memory=torch.cuda.is_available())
    return t.fill_(fill)


def _per_sample(payloads, plan: RankPlan, what: str) -> list:
    n = len(plan.batch.lengths)
    if isinstance(payloads, (list, tuple)):
        if len(payloads) != n:
            raise ReplayPayloadError(f"{what}: got {len(payloads)} per-sample payloads for {n} sequences")
        return list(payloads)
    return split_packed(payloads, plan.batch.cu_seqlens)


def _sample_slots(plan: RankPlan, rows: slice) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sample, ``(positions, flat destination rows)`` within this rank's ``[s_l, b]`` grid (``flat = j * b +
    column``, the order ``[s_l, b, k].view(-1, k)`` has)."""
    sample = plan.sample[rows].numpy()
    position = plan.position[rows].numpy()
    flat = np.arange(sample.size).reshape(sample.shape)
    out = []
    for i in range(len(plan.batch.lengths)):
        m = sample == i
        out.append((position[m], flat[m]))
    return out


def _decode_all(payloads, plan: RankPlan, *, k: int, layer_options, select, check_for, what: str,
                keys: Sequence[int]) -> dict[int, torch.Tensor]:
    rows = plan.local_rows
    s_l = rows.stop - rows.start
    host = {key: _host_buffer((s_l, plan.width, k), -1) for key in keys}
    flat = {key: t.view(-1, k).numpy() for key, t in host.items()}
    for i, (payload, (positions, dest_rows), length) in enumerate(
            zip(_per_sample(payloads, plan, what), _sample_slots(plan, rows), plan.batch.lengths)):
        slot_of = np.full(length, -1, dtype=np.int64)
        slot_of[positions] = dest_rows
        decode_sample(payload, length=length, k=k, layer_options=layer_options, select=select, sample=i,
                      what=what, check=check_for(i), dest=flat, slot_of=slot_of)
    return host


def prepare_indexer_replay(payloads, plan: RankPlan, layers: ModelLayers) -> StagedRows | None:
    """This rank's indexer rows for one micro-batch: decoded, checked, rebased from sequence positions to key rows
    (``-1`` kept), staged per full layer (+ MTP when the payload has it). ``payloads``: per-sample payloads or one
    packed ``[layers, T, k]`` array (:mod:`megatron_glm5.rl.payload`)."""
    what = "indexer top-k replay"
    layers.refuse_unless(bool(layers.full), what, "full DSA (indexer) layer")
    if not layers.full:
        return None
    n, mtp = layers.num_layers, layers.mtp_layers
    options = (n, n + mtp) if mtp else (n,)
    carried: dict[str, tuple[int, ...]] = {}

    def select(num: int) -> LayerSelection:
        keep = {key: key for key in layers.full if key < num}
        shares = {s: src for s, src in layers.shared_source.items() if src >= 0 and s < num}
        carried["keys"] = tuple(keep)
        return LayerSelection(keep=keep, shares=shares)

    keys = list(layers.full)
    host = _decode_all(payloads, plan, k=layers.topk_width, layer_options=options, select=select,
                       check_for=lambda i: indexer_row_check(i, layers.layer_name), what=what, keys=keys)
    kept = set(carried.get("keys", ()))
    host = {key: t for key, t in host.items() if key in kept}  # MTP without payload data: its own indexer
    if not host:
        return None
    # sequence-relative key positions -> key rows of the flattened key axis
    rows = plan.local_rows
    base = torch.where(plan.sample[rows] >= 0, plan.key_base[plan.sample[rows].clamp_min(0)], 0).to(torch.int32)
    for t in host.values():
        t.add_(base[..., None] * (t >= 0))
    return StagedRows(host, _device_of(layers))


def prepare_routing_replay(payloads, plan: RankPlan, layers: ModelLayers) -> StagedRows | None:
    """This rank's routed-expert rows for one micro-batch, per MoE layer on this stage (+ MTP when carried).
    Payload layers are every decoder layer (sglang), optionally + MTP, or the MoE layers only (optionally + MTP)."""
    what = "routing replay"
    layers.refuse_unless(bool(layers.routers), what, "MoE router")
    if layers.routers and layers.mlp_chunks > 1:
        raise ReplayLayerError(f"{what}: the model runs its MLP in mlp_chunks_for_training={layers.mlp_chunks} "
                               "sequence chunks, so each router sees a chunk of the micro-batch at a time; build the "
                               "model for RL with mlp_chunks_for_training=1")
    if not layers.routers:
        return None
    n, mtp, moe = layers.num_layers, layers.mtp_layers, layers.moe_layers
    options = tuple(dict.fromkeys((n, n + mtp, len(moe), len(moe) + mtp)))
    carried: dict[str, tuple[int, ...]] = {}

    def select(num: int) -> LayerSelection:
        if num in (n, n + mtp):  # every decoder layer (sglang), preferred when both readings fit
            keep = {key: key for key in layers.routers if key < num}
        else:  # MoE layers only (+ MTP): payload layer j is the j-th MoE layer
            index = {layer: j for j, layer in enumerate(moe)}
            index.update({n + k: len(moe) + k for k in range(mtp)})
            keep = {index[key]: key for key in layers.routers if key in index and index[key] < num}
        carried["keys"] = tuple(keep.values())
        return LayerSelection(keep=keep, shares={})

    host = _decode_all(payloads, plan, k=layers.router_topk, layer_options=options, select=select,
                       check_for=lambda i: routing_row_check(i, layers.layer_name, layers.num_experts), what=what,
                       keys=list(layers.routers))
    kept = set(carried.get("keys", ()))
    host = {key: t for key, t in host.items() if key in kept}
    return StagedRows(host, _device_of(layers)) if host else None


def _device_of(layers: ModelLayers) -> torch.device:
    for core in layers.full.values():
        for p in core.parameters():
            return p.device
    for r in layers.routers.values():
        for p in r.parameters():
            return p.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ------------------------------------------------------------------------------------------------------------------
# Statistics
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class ReplayStats:
    """Accumulates, over the forwards it is passed to, per layer: the overlap between replayed and freshly computed
    indexer top-k (needs the indexer to run as well: pass this only when you want the numbers) and the fraction of
    token-expert choices our router would have made differently from the replayed ones. Device counters; read them
    with :meth:`summary` (one sync)."""

    warn_below: float = OVERLAP_WARN_BELOW
    _overlap: dict[int, list] = field(default_factory=dict)  # key -> [sum of row overlaps, rows, min]
    _routing: dict[int, list] = field(default_factory=dict)  # key -> [differing choices, choices]

    def add_overlap(self, key: int, fresh: torch.Tensor, replayed: torch.Tensor, rows: torch.Tensor) -> None:
        frac = topk_overlap(fresh, replayed)[rows]
        acc = self._overlap.setdefault(key, [0, 0, None])
        acc[0] = acc[0] + frac.sum()
        acc[1] = acc[1] + frac.numel()
        low = frac.min() if frac.numel() else torch.ones((), device=frac.device)
        acc[2] = low if acc[2] is None else torch.minimum(acc[2], low)

    def add_routing(self, key: int, own: torch.Tensor, replayed: torch.Tensor, rows: torch.Tensor) -> None:
        own, replayed = own[rows], replayed[rows]
        same = (own[:, :, None] == replayed[:, None, :]).any(-1).sum()
        acc = self._routing.setdefault(key, [0, 0])
        acc[0] = acc[0] + (replayed.numel() - same)
        acc[1] = acc[1] + replayed.numel()

    def summary(self, group=None) -> dict:
        """``{"indexer_overlap": {layer: {"mean", "min", "rows"}}, "routing_mismatch": {layer: {"fraction",
        "choices"}}, "low_overlap_layers": [...]}``, reduced over ``group`` (e.g. the data-parallel group) when given.
        Warns (:class:`ReplayOverlapWarning`) for layers whose mean overlap is below ``warn_below``."""
        out = {"indexer_overlap": {}, "routing_mismatch": {}}
        for key, (total, rows, low) in sorted(self._overlap.items()):
            vals = torch.stack([torch.as_tensor(total, dtype=torch.float64).cpu(),
                                torch.as_tensor(rows, dtype=torch.float64).cpu()])
            low = torch.as_tensor(low if low is not None else 1.0, dtype=torch.float64).cpu().reshape(1)
            if group is not None:
                dist.all_reduce(vals, group=group)
                dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
            out["indexer_overlap"][key] = {"mean": float(vals[0] / max(vals[1], 1)), "min": float(low[0]),
                                           "rows": int(vals[1])}
        for key, (diff, total) in sorted(self._routing.items()):
            vals = torch.stack([torch.as_tensor(diff, dtype=torch.float64).cpu(),
                                torch.as_tensor(total, dtype=torch.float64).cpu()])
            if group is not None:
                dist.all_reduce(vals, group=group)
            out["routing_mismatch"][key] = {"fraction": float(vals[0] / max(vals[1], 1)), "choices": int(vals[1])}
        low_layers = [k for k, v in out["indexer_overlap"].items() if v["rows"] and v["mean"] < self.warn_below]
        out["low_overlap_layers"] = low_layers
        if low_layers:
            detail = ", ".join(f"layer {k}: mean {out['indexer_overlap'][k]['mean']:.3f}" for k in low_layers)
            warnings.warn(f"indexer top-k replay: replayed and freshly computed top-k overlap below "
                          f"{self.warn_below} ({detail}): the rollout engine's indexer numerics differ from ours "
                          "(RoPE convention, FP8 indexer, k_norm eps, tie-breaking)", ReplayOverlapWarning,
                          stacklevel=2)
        return out


def topk_overlap(a: torch.Tensor, b: torch.Tensor, *, chunk: int = 4096) -> torch.Tensor:
    """fp32 ``[R]``: per row, ``|a ∩ b| / max(|a|, |b|)`` over the entries that are not -1 (1.0 when both are empty).
    Sets: order and duplicates within a row do not matter."""
    out = torch.empty(a.shape[0], dtype=torch.float32, device=a.device)
    for c0 in range(0, a.shape[0], chunk):
        x = a[c0:c0 + chunk].long().sort(-1).values
        y = b[c0:c0 + chunk].long()
        pos = torch.searchsorted(x, y).clamp_(max=x.shape[-1] - 1)
        hit = (y >= 0) & (x.gather(1, pos) == y)
        inter = hit.sum(-1).float()
        size = torch.maximum((x >= 0).sum(-1), (y >= 0).sum(-1)).float()
        out[c0:c0 + chunk] = torch.where(size > 0, inter / size.clamp_min(1), torch.ones_like(inter))
    return out


# ------------------------------------------------------------------------------------------------------------------
# Hooks on a built model
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class _Active:
    indexer: StagedRows | None
    routing: StagedRows | None
    self_rows: torch.Tensor | None  # int32 [s, b]: each row's own key row (fill for rows without data)
    stats: ReplayStats | None


class GLMRouterReplay(RouterReplay):
    """megatron-core's ``RouterReplay`` for one router, fed from :class:`ReplayHooks` (module docstring). Tokens
    without replay data (all -1) keep our router's choice. While an action of megatron-core's API is set
    (``set_router_replay_action``), megatron-core's behaviour applies unchanged."""

    def __init__(self, hooks: "ReplayHooks", key: int, replaced: RouterReplay | None):
        # RouterReplay.__init__ appends to megatron-core's process-wide instance list; take the replaced
        # instance's slot there instead (so RouterReplay.set_replay_data etc. still reach this router).
        self.target_topk_idx = None
        self.recorded_topk_idx = None
        self.router_replay_action = None
        self.replay_backward_list = []
        self.static_buffer = None
        self.layer_number = getattr(replaced, "layer_number", None)
        self._hooks = weakref.ref(hooks)
        self.key = key
        self.replaced = replaced
        compat.replace_router_replay(replaced, self)

    def restore(self) -> RouterReplay | None:
        compat.replace_router_replay(self, self.replaced)
        return self.replaced

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action is not None:
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        if is_checkpointing() and torch.is_grad_enabled():  # recompute: the ids of this checkpoint's first pass
            ids = replayed_topk(self, scores, self.key + 1)
            if ids is not None:
                return scores.gather(1, ids), ids
        hooks = self._hooks()
        active = hooks._active if hooks is not None else None
        if active is None or active.routing is None or self.key not in active.routing:
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = active.routing.fetch(self.key).view(-1, topk).to(torch.int64)
        if target.shape[0] != scores.shape[0]:
            raise RuntimeError(f"routing replay: layer {self.key} routes {scores.shape[0]} tokens on this rank but "
                               f"the replay has {target.shape[0]} rows")
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        rows = target[:, 0] >= 0
        ids = torch.where(rows[:, None], target, own)
        if active.stats is not None:
            active.stats.add_routing(self.key, own, target, rows)
        if is_checkpointing() and not torch.is_grad_enabled():  # first pass of a checkpoint: keep for the recompute
            stash_topk(self, ids, scores)
        return scores.gather(1, ids), ids


_HOOKS: "weakref.WeakKeyDictionary[torch.nn.Module, ReplayHooks]" = weakref.WeakKeyDictionary()


class ReplayHooks:
    """Replay hooks of one built model (see module docstring); :meth:`of` installs them once and returns them."""

    def __init__(self, model: torch.nn.Module):
        self.layers = ModelLayers.of(model)
        self._active: _Active | None = None
        self._cores = []
        for key, core in self.layers.full.items():
            original = core.compute_topk
            compat.override_method(core, "compute_topk", _ReplayingTopk(self, key, core, original))
            self._cores.append(core)
        self._routers = []
        for key, router in self.layers.routers.items():
            router.router_replay = GLMRouterReplay(self, key, router.router_replay)
            self._routers.append(router)

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ReplayHooks":
        hooks = _HOOKS.get(model)
        if hooks is None:
            hooks = _HOOKS[model] = cls(model)
        return hooks

    def remove(self) -> None:
        """Uninstall (the model runs as before; later recomputes of graphs built under replay lose their ids)."""
        for core in self._cores:
            compat.restore_method(core, "compute_topk")
        for router in self._routers:
            router.router_replay = router.router_replay.restore()
        for model, hooks in list(_HOOKS.items()):
            if hooks is self:
                del _HOOKS[model]

    @contextlib.contextmanager
    def active(self, indexer: StagedRows | None, routing: StagedRows | None, plan: RankPlan | None,
               stats: ReplayStats | None = None) -> Iterator[None]:
        """Make a micro-batch's replay data current for the forward run inside the block."""
        if self._active is not None:
            raise RuntimeError("a replayed forward is already running on this model (nested forward?)")
        self_rows = None
        if indexer is not None:
            self_rows = plan.key_rows().to(device=indexer.device, dtype=torch.int32)
        self._active = _Active(indexer=indexer, routing=routing, self_rows=self_rows, stats=stats)
        try:
            yield
        finally:
            self._active = None

    def indexer_rows(self, key: int, layout: TokenLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk [R, K] int32 in layout order, rows_with_data bool [R])`` for a full layer of the running batch."""
        active = self._active
        rows = active.indexer.fetch(key)  # [s_l, b, K]
        group = self.layers.tp_group
        if group is not None:
            full = rows.new_empty((rows.shape[0] * dist.get_world_size(group), *rows.shape[1:]))
            dist.all_gather_into_tensor(full, rows.contiguous(), group=group)
            rows = full
        have = (rows >= 0).any(-1)  # [s, b]
        fill = torch.full_like(rows, -1)
        fill[..., 0] = active.self_rows
        rows = torch.where(have[..., None], rows, fill)
        return layout.flatten(rows), layout.flatten(have)


class _ReplayingTopk:
    """Instance-level ``compute_topk`` of a full layer's core attention (module docstring)."""

    def __init__(self, hooks: ReplayHooks, key: int, core, original):
        self.hooks = weakref.ref(hooks)
        self.key, self.core, self.original = key, weakref.ref(core), original

    def __call__(self, *args, **kwargs):
        hooks = self.hooks()
        active = hooks._active if hooks is not None else None
        if active is None or active.indexer is None or self.key not in active.indexer:
            return self.original(*args, **kwargs)
        layout = next((a for a in (*args, *kwargs.values()) if isinstance(a, TokenLayout)), None)
        if layout is None:
            raise RuntimeError("indexer replay: compute_topk received no TokenLayout")
        topk, have = hooks.indexer_rows(self.key, layout)
        core = self.core()
        core.check_topk(topk, layout, bounds=True)
        if active.stats is not None:
            active.stats.add_overlap(self.key, self.original(*args, **kwargs), topk, have)
        return topk


# ------------------------------------------------------------------------------------------------------------------
# Recording our own choices (a rollout stand-in; tests and self-checks)
# ------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def capture_choices(model, input_ids: torch.Tensor, cu_seqlens, *,
                    include_mtp: bool = False) -> dict[str, torch.Tensor]:
    """Run ``model`` once on a packed batch (TP = CP = PP = 1) and return its own choices in the payload format of
    :mod:`megatron_glm5.rl.payload`: ``{"indexer_topk": int32 [N (+ mtp), T, topk_width], "routed_experts":
    int32 [N (+ mtp), T, router_topk]}``, layer-major, sequence-relative positions, shared layers repeating their
    source (as sglang reports them), the rows of layers without an indexer top-k (GLM-5.3-Flash's KDA layers) and
    of dense layers' routing -1. ``topk_width`` is the full layers' (:class:`ModelLayers`). Replaying them
    reproduces this forward."""
    inner = unwrap(model)
    inv = LayerInventory.of(inner)
    config = inv.config
    if config.tensor_model_parallel_size * config.context_parallel_size * config.pipeline_model_parallel_size != 1:
        raise ValueError("capture_choices runs on a single-rank model (TP = CP = PP = 1)")
    plan = RankPlan.build(PackedBatch.build(input_ids, cu_seqlens), ParallelSizes.of(config))
    t = plan.batch.num_tokens
    n = config.num_layers
    layers = n + ((config.mtp_num_layers or 0) if include_mtp else 0)
    width = inv.topk_width() or config.dsa_indexer_topk
    topk: dict[int, torch.Tensor] = {}
    routed: dict[int, torch.Tensor] = {}
    hooks = []
    for entry in inv:
        key = entry.key
        if key >= layers:
            continue
        if entry.is_dsa:
            hooks.append(entry.layer.self_attention.register_forward_hook(
                lambda mod_, args, out, key=key: topk.__setitem__(key, out[2][:t].clone())))
        if entry.router is not None:
            k = config.moe_router_topk
            hooks.append(entry.router.register_forward_hook(
                lambda mod_, args, out, key=key, k=k: routed.__setitem__(
                    key, out[1].float().topk(k, dim=-1).indices.sort(-1).values[:t].to(torch.int32))))
    try:
        model(**forward_kwargs(plan, model_device(inner)))
    finally:
        for h in hooks:
            h.remove()
    base = torch.repeat_interleave(torch.tensor(plan.batch.cu_seqlens[:-1]), torch.tensor(plan.batch.lengths))
    idx = torch.full((layers, t, width), -1, dtype=torch.int32)
    for key, rows in topk.items():
        rows = rows.cpu().long()
        idx[key] = torch.where(rows >= 0, rows - base[:, None], -1).to(torch.int32)
    experts = torch.full((layers, t, config.moe_router_topk), -1, dtype=torch.int32)
    for key, rows in routed.items():
        experts[key] = rows.cpu()
    return {"indexer_topk": idx, "routed_experts": experts}
