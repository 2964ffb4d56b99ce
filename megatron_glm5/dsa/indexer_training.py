"""Training the DSA indexer: which loss a layer computes, how it reaches the backward and the log, which parameters
train, and the warm-up stage's recall diagnostic.

* The loss (:mod:`megatron_glm5.dsa.indexer_loss`) is attached to the attention output with megatron-core's
  ``DSAIndexerLossAutoScaler``: the backward of the LM loss carries ``d indexer_loss = main loss scale`` (set by
  megatron-core's schedules), so no training loop changes, also when every other parameter is frozen.
* It is logged through megatron-core's ``DSAIndexerLossLoggingHelper`` tracker, which Megatron-LM's training loop
  reduces and prints as "indexer loss". Each loss-computing layer (the "full" decoder layers, then the MTP layers)
  owns one tracker slot, so the logged value is the mean over exactly those layers (shared IndexShare layers add no
  loss and take no slot).
* Stages: the warm-up (DeepSeek-V3.2's dense stage; :attr:`IndexerLossSettings.warmup`) runs the main attention
  densely, trains the indexer with the dense loss and nothing else (:func:`freeze_all_but_indexers`); the sparse stage
  trains the whole model, the indexer by its loss over the selected keys only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from .indexer_loss import RecallStats


@dataclass(frozen=True, slots=True)
class IndexerLossSettings:
    """What one layer's indexer loss is: ``coeff`` 0 means none (the indexer stays as loaded)."""

    coeff: float = 0.0
    sparse: bool = False  # False: dense over every causal key
    per_token: bool = False  # megatron-core's calculate_per_token_loss: a sum over rows, no mean
    warmup: bool = False  # main attention dense, dense loss, only the indexer trains

    @classmethod
    def from_config(cls, config, warmup: bool = False) -> "IndexerLossSettings":
        """From megatron-core's config fields (``dsa_indexer_loss_coeff``, ``dsa_indexer_use_sparse_loss``,
        ``calculate_per_token_loss``) and the warm-up switch (a spec parameter: megatron-core has no field for it)."""
        coeff = float(getattr(config, "dsa_indexer_loss_coeff", None) or 0.0)
        sparse = bool(getattr(config, "dsa_indexer_use_sparse_loss", False))
        if coeff < 0:
            raise ValueError(f"dsa_indexer_loss_coeff must be >= 0, got {coeff}")
        if warmup:
            if coeff <= 0:
                raise ValueError("the indexer warm-up trains the indexer by its loss only: set dsa_indexer_loss_coeff "
                                 "> 0 (--dsa-indexer-loss-coeff, e.g. 1.0)")
            if sparse:
                raise ValueError("the indexer warm-up uses the dense loss (every causal key): drop "
                                 "dsa_indexer_use_sparse_loss (--dsa-indexer-use-sparse-loss) for the warm-up stage")
        return cls(coeff=coeff, sparse=sparse, per_token=bool(getattr(config, "calculate_per_token_loss", False)),
                   warmup=warmup)

    @property
    def enabled(self) -> bool:
        return self.coeff > 0


@dataclass(frozen=True, slots=True)
class LossSlot:
    """This layer's place among the loss-computing layers of the whole model (0-based), for the tracker."""

    index: int
    count: int


def loss_slots(indexer_types, mtp_num_layers: int = 0) -> tuple[dict[int, LossSlot], list[LossSlot]]:
    """``({decoder layer id: slot} for the full layers, [slot of each MTP layer])``."""
    full = [i for i, t in enumerate(indexer_types) if t == "full"]
    count = len(full) + (mtp_num_layers or 0)
    decoder = {layer: LossSlot(k, count) for k, layer in enumerate(full)}
    return decoder, [LossSlot(len(full) + j, count) for j in range(mtp_num_layers or 0)]


def log_loss(loss: torch.Tensor, slot: LossSlot, *, cp_group=None, per_token: bool = False) -> None:
    """Log ``loss`` in its tracker slot. Under context parallelism each rank's loss covers its own query rows:
    megatron-core's reduction (sum in per-token mode, else the mean over the CP group) is kept."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    cp = cp_group if cp_group is not None and cp_group.size() > 1 else None
    DSAIndexerLossLoggingHelper.save_loss_to_tracker(
        loss=loss, layer_number=slot.index + 1, num_layers=slot.count,
        reduce_group=cp if per_token else None, avg_group=None if per_token else cp,
    )


def attach_loss(output: torch.Tensor, loss: torch.Tensor, slot: LossSlot, *, cp_group=None,
                per_token: bool = False) -> torch.Tensor:
    """Log ``loss`` in its tracker slot and return ``output`` carrying it into the backward (identity forward)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

    log_loss(loss, slot, cp_group=cp_group, per_token=per_token)
    return DSAIndexerLossAutoScaler.apply(output, loss)


def main_loss_backward_scale(device: torch.device) -> torch.Tensor:
    """The gradient megatron-core's ``DSAIndexerLossAutoScaler`` gives an indexer loss: the main loss's backward
    scale that the pipeline schedules set (1 when none was set), for a loss computed in the backward."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

    scale = DSAIndexerLossAutoScaler.main_loss_backward_scale
    return torch.ones((), device=device) if scale is None else scale.to(device)


def _core_attentions(model) -> Iterator[torch.nn.Module]:
    """The DSA core attentions of ``model`` (a module or a list of chunks): the modules carrying
    :class:`IndexerLossSettings` (``DSACoreAttention``, which imports this module)."""
    modules = model if isinstance(model, (list, tuple)) else [model]
    for m in modules:
        for sub in m.modules():
            if isinstance(getattr(sub, "loss", None), IndexerLossSettings):
                yield sub


def indexer_parameters(model) -> Iterator[torch.nn.Parameter]:
    """Exactly the indexer parameters of this rank's model chunk(s) (``wq_b``, ``wk``, ``k_norm``, ``weights_proj``
    of every full layer and MTP layer), for an optimizer of the indexer alone."""
    seen: set[int] = set()
    for core in _core_attentions(model):
        if core.indexer is None:
            continue
        for p in core.indexer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p


def freeze_all_but_indexers(model) -> int:
    """The warm-up's parameter set: ``requires_grad`` off for every parameter but the indexers' (on for those), and
    MoE routers' expert bias frozen (Megatron-LM's ``frozen_expert_bias``). Returns the number of trainable tensors."""
    modules = model if isinstance(model, (list, tuple)) else [model]
    keep = {id(p) for p in indexer_parameters(modules)}
    for m in modules:
        for p in m.parameters():
            p.requires_grad_(id(p) in keep)
        for sub in m.modules():
            if hasattr(sub, "frozen_expert_bias"):
                sub.frozen_expert_bias = True
    return len(keep)


class RecallTracker:
    """Per loss slot sums of :class:`RecallStats` since the last :meth:`take` (device tensors, no sync until read).
    Filled by the warm-up's dense loss; read by the training entry point's log line and by ``verify``."""

    def __init__(self) -> None:
        self._sums: dict[int, torch.Tensor] = {}  # slot -> [captured, best, count]
        self.recording = False  # also measure outside the warm-up (``record()``: verify, diagnostics)

    @contextlib.contextmanager
    def record(self):
        """Within the block, every full layer's forward adds its recall (any stage, training or not)."""
        previous, self.recording = self.recording, True
        try:
            yield self
        finally:
            self.recording = previous

    def add(self, slot: LossSlot, stats: RecallStats) -> None:
        row = torch.stack([stats.captured.float(), stats.best.float(), stats.captured.new_ones((), dtype=torch.float32)])
        if slot.index in self._sums:
            self._sums[slot.index] += row.to(self._sums[slot.index].device)
        else:
            self._sums[slot.index] = row

    def take(self) -> dict[int, tuple[float, float]]:
        """``{slot: (mean captured, mean best)}`` since the last call, then reset (one host read)."""
        sums, self._sums = self._sums, {}
        if not sums:
            return {}
        keys = sorted(sums)
        table = torch.stack([sums[k] for k in keys]).cpu()
        return {k: (float(r[0] / r[2]), float(r[1] / r[2])) for k, r in zip(keys, table)}


RECALL = RecallTracker()


def mean_recall(per_slot: dict[int, tuple[float, float]]) -> Optional[tuple[float, float]]:
    if not per_slot:
        return None
    n = len(per_slot)
    return sum(c for c, _ in per_slot.values()) / n, sum(b for _, b in per_slot.values()) / n


class WarmupFreeze:
    """The warm-up's freeze for a model built by someone else (Megatron-LM's ``pretrain_gpt.py --spec``), who calls
    our spec function, builds the model and wraps it for DDP and the optimizer before its first forward, with no
    hook in between. :meth:`arm` (called by the warm-up spec functions) registers a torch module
    parameter-registration hook: every parameter registered from then on is created frozen; the warm-up core
    attentions re-enable their indexers' parameters right after building them; the first warm-up forward
    :meth:`disarm`\\ s it and freezes the MoE routers' expert-bias updates it saw (Megatron-LM's
    ``frozen_expert_bias``). Our own builders freeze explicitly instead (:func:`freeze_all_but_indexers`)."""

    def __init__(self) -> None:
        self._handle = None
        self._modules: list = []

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm(self) -> None:
        if self._handle is None:
            from ..compat import register_parameter_hook

            self._handle = register_parameter_hook(self._freeze)

    def _freeze(self, module, name, param):
        if param is not None:
            param.requires_grad_(False)
            self._modules.append(module)
        return None

    def disarm(self) -> None:
        if self._handle is None:
            return
        self._handle.remove()
        self._handle = None
        params = {id(p): p for m in self._modules for p in m.parameters(recurse=False)}
        for m in self._modules:
            if hasattr(m, "frozen_expert_bias"):
                m.frozen_expert_bias = True
        self._modules = []
        trainable = sum(p.requires_grad for p in params.values())
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"megatron-glm5: indexer warm-up: {trainable} of {len(params)} parameter tensors train (the "
                  "indexers); the rest is frozen", flush=True)


warmup_freeze = WarmupFreeze()
