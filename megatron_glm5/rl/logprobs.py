"""Per-token log-probabilities of packed RL sequences on a megatron-core GLM-5.x model, launcher-agnostic.

* :func:`compute_logprobs` - one call, any TP / SP / EP / CP layout with PP = 1; with or without gradients.
* :func:`logprobs_forward_step` - the same as a ``forward_step_func`` for megatron-core's
  ``get_forward_backward_func()`` schedules (PP >= 1, virtual pipeline, micro-batches), for launchers that drive the
  schedule themselves (Megatron-LM, slime, miles, NeMo-RL).

Inputs are a packed batch: ``input_ids`` int ``[T]`` (every sequence back to back) and ``cu_seqlens`` int ``[n + 1]``
(``cu_seqlens[i]`` = start of sequence ``i``). Every rank of a TP / CP group passes the same full batch; ranks of
different data-parallel replicas pass different ones. The output position ``t`` holds ``log p(input_ids[t + 1] |
input_ids[:t + 1])`` within ``t``'s sequence; each sequence's last position has no next token: 0 there, and
:meth:`~megatron_glm5.rl.packing.PackedBatch.next_token_mask` / :attr:`LogProbs.mask` is False.

**MTP.** megatron-core's GPTModel runs its MTP block on every forward and, with gradients, attaches the MTP loss (labels
rolled from ``input_ids``, scaled by ``mtp_loss_scaling_factor``) to the output through ``MTPLossAutoScaler``. A
log-prob objective must not silently train MTP, so the forward gets a zero MTP ``loss_mask`` by default: the MTP
loss is exactly 0 and so are its gradients (the MTP block still runs: its cost is one decoder layer plus one
output-layer GEMM). Pass ``mtp_loss_mask`` (``[T]``, indexed like ``input_ids``: 1 to train the MTP prediction of that
token) to train MTP in the same backward.

**Tensor parallelism.** The logits stay vocab-parallel; log-softmax and entropy are reduced over the TP group
(:mod:`megatron_glm5.rl.vocab_parallel`), never gathered per token.

**Context parallelism** (``tilelang`` backend; it takes bshd input only, THD + CP is not supported): the sequences are
right-padded to a common length and zigzag-split (:mod:`megatron_glm5.rl.packing`); each CP rank computes its
positions and the ``[T]`` result is all-gathered over the CP group. Its backward sends each position's gradient to
the rank that computed it only, so a loss computed identically on every CP rank gives per-rank partial gradients
whose *sum* over the CP group is the gradient (megatron-core's DDP averages over DP x CP: scale the loss by the CP
size, as Megatron-LM's ``loss_func`` does).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from .model_io import forward_kwargs, model_device, unwrap
from .packing import PackedBatch, ParallelSizes, RankPlan
from .replay import ReplayHooks, ReplayStats, StagedRows, prepare_indexer_replay, prepare_routing_replay
from .vocab_parallel import vocab_parallel_logprobs


@dataclass
class RolloutMicroBatch:
    """One micro-batch of packed rollouts, as :func:`logprobs_forward_step` reads it from the data iterator.

    ``input_ids`` int ``[T]``; ``cu_seqlens`` int ``[n + 1]``; ``topk_replay`` / ``routing_replay``: per-sample rollout
    payloads or one packed array (:mod:`megatron_glm5.rl.payload`); ``mtp_loss_mask`` ``[T]`` (see module docstring);
    ``extra``: anything the launcher's ``loss_fn`` needs (advantages, rollout log-probs, ...)."""

    input_ids: torch.Tensor
    cu_seqlens: Any
    topk_replay: Any = None
    routing_replay: Any = None
    mtp_loss_mask: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class LogProbs:
    """``logprobs`` fp32 ``[T]`` (0 where ``mask`` is False), ``entropy`` fp32 ``[T]`` or None (same masking),
    ``mask`` bool ``[T]``: positions whose next token is in the same sequence."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    mask: torch.Tensor


@dataclass
class _Prepared:
    batch: PackedBatch
    plan: RankPlan
    model_kwargs: dict
    indexer: StagedRows | None
    routing: StagedRows | None


def _prepare(model, mb: RolloutMicroBatch) -> _Prepared:
    inner = unwrap(model)
    config = inner.config
    batch = PackedBatch.build(mb.input_ids, mb.cu_seqlens)
    sizes = ParallelSizes.of(config)
    plan = RankPlan.build(batch, sizes)
    kwargs = forward_kwargs(plan, model_device(inner), mb.mtp_loss_mask)
    indexer = routing = None
    if mb.topk_replay is not None or mb.routing_replay is not None:
        layers = ReplayHooks.of(inner).layers
        if mb.topk_replay is not None:
            indexer = prepare_indexer_replay(mb.topk_replay, plan, layers)
        if mb.routing_replay is not None:
            routing = prepare_routing_replay(mb.routing_replay, plan, layers)
    return _Prepared(batch=batch, plan=plan, model_kwargs=kwargs, indexer=indexer, routing=routing)


def _run(model, prep: _Prepared, stats: ReplayStats | None):
    if prep.indexer is None and prep.routing is None:
        return model(**prep.model_kwargs)
    hooks = ReplayHooks.of(unwrap(model))
    with hooks.active(prep.indexer, prep.routing, prep.plan, stats):
        return model(**prep.model_kwargs)


class _GatherFromCP(torch.autograd.Function):
    """All-gather ``[N]`` over the CP group -> ``[cp, N]``; backward: this rank's row of the gradient only."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty(dist.get_world_size(group) * x.numel())
        dist.all_gather_into_tensor(out, x.contiguous().reshape(-1), group=group)
        return out.view(-1, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad[dist.get_rank(ctx.group)].contiguous(), None


def _logprobs_from_logits(prep: _Prepared, logits: torch.Tensor, *, temperature: float, return_entropy: bool,
                          vocab_size: int | None, tp_group) -> LogProbs:
    """``logits`` ``[b, s, V / TP]`` (GPTModel's output on the last stage) -> :class:`LogProbs` over the packed
    ``[T]`` positions."""
    plan = prep.plan
    device = logits.device
    target, valid = plan.targets(device)
    lp, ent = vocab_parallel_logprobs(logits.reshape(-1, logits.shape[-1]), target, temperature=temperature,
                                      group=tp_group, vocab_size=vocab_size)
    zero = torch.zeros_like(lp)
    lp = torch.where(valid, lp, zero)
    ent = torch.where(valid, ent, zero) if return_entropy else None
    index = plan.packed_index().to(device)
    t = plan.batch.num_tokens
    if plan.sizes.cp > 1:
        from megatron.core import parallel_state as ps

        group = ps.get_context_parallel_group()
        index = torch.cat([RankPlan.build(plan.batch, _with_cp_rank(plan.sizes, r)).packed_index()
                           for r in range(plan.sizes.cp)]).to(device)
        lp = _GatherFromCP.apply(lp, group).reshape(-1)
        ent = _GatherFromCP.apply(ent, group).reshape(-1) if ent is not None else None
    keep = index >= 0
    out_lp = torch.zeros(t, dtype=lp.dtype, device=device).index_put((index[keep],), lp[keep])
    out_ent = (torch.zeros(t, dtype=lp.dtype, device=device).index_put((index[keep],), ent[keep])
               if ent is not None else None)
    return LogProbs(logprobs=out_lp, entropy=out_ent, mask=plan.batch.next_token_mask().to(device))


def _with_cp_rank(sizes: ParallelSizes, rank: int) -> ParallelSizes:
    return ParallelSizes(tp=sizes.tp, tp_rank=sizes.tp_rank, sp=sizes.sp, cp=sizes.cp, cp_rank=rank)


def _tp_group(config):
    if config.tensor_model_parallel_size == 1:
        return None
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def compute_logprobs(
    model,
    input_ids: torch.Tensor,
    cu_seqlens,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    topk_replay: Any = None,
    routing_replay: Any = None,
    replay_stats: ReplayStats | None = None,
    mtp_loss_mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
):
    """Per-token log-probabilities of the next token for THD-packed sequences (see module docstring).

    Args:
        model: a megatron-core GPTModel built by megatron-glm5 (possibly wrapped in DDP / Float16Module), PP = 1.
            Its train/eval mode and ``torch.no_grad()`` are the caller's: the result is differentiable when
            gradients are enabled.
        input_ids: int ``[T]`` packed tokens, the same on every rank of a TP / CP group (host or device).
        cu_seqlens: int ``[n + 1]`` sequence boundaries (``[0, L_0, L_0 + L_1, ..., T]``).
        temperature: logits are divided by it (the rollout's sampling temperature).
        return_entropy: also return the entropy of each position's distribution.
        topk_replay: the rollout engine's indexer top-k: per-sample sglang base64 payloads / ``[layers, L_i(-1), k]``
            arrays, or one packed ``[layers, T, k]`` array with sequence-relative positions, -1 padded
            (:mod:`megatron_glm5.rl.payload`). Replayed on full layers (+ MTP when present); shared layers follow.
        routing_replay: the rollout's routed experts, same forms with ``k = num_experts_per_tok``.
        replay_stats: a :class:`~megatron_glm5.rl.replay.ReplayStats` to accumulate the replayed-vs-fresh top-k
            overlap (runs the indexer as well) and the routing mismatch into.
        mtp_loss_mask: ``[T]``; None keeps the MTP loss at exactly zero (module docstring).
        vocab_size: the real vocabulary size when the output layer is padded (padding columns are excluded).

    Returns:
        fp32 ``[T]`` log-probs on the model's device (0 at each sequence's last token), or ``(logprobs, entropy)``
        with ``return_entropy``.
    """
    inner = unwrap(model)
    config = inner.config
    if config.pipeline_model_parallel_size > 1:
        raise ValueError(
            "compute_logprobs runs the whole model in one call (PP = 1); under pipeline parallelism use "
            "megatron_glm5.rl.logprobs_forward_step with megatron-core's get_forward_backward_func()"
        )
    mb = RolloutMicroBatch(input_ids=input_ids, cu_seqlens=cu_seqlens, topk_replay=topk_replay,
                           routing_replay=routing_replay, mtp_loss_mask=mtp_loss_mask)
    prep = _prepare(model, mb)
    logits = _run(model, prep, replay_stats)
    result = _logprobs_from_logits(prep, logits, temperature=temperature, return_entropy=return_entropy,
                                   vocab_size=vocab_size, tp_group=_tp_group(config))
    return (result.logprobs, result.entropy) if return_entropy else result.logprobs


LossFn = Callable[[LogProbs, RolloutMicroBatch], tuple]


def logprobs_forward_step(
    data_iterator,
    model,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    loss_fn: LossFn | None = None,
    replay_stats: ReplayStats | None = None,
    vocab_size: int | None = None,
):
    """A ``forward_step_func`` for megatron-core's schedules: bind the keywords with ``functools.partial``.

    Reads one :class:`RolloutMicroBatch` (or a dict with its fields) from ``data_iterator``, makes its replay data
    current for this stage's layers, runs the model and returns ``(output_tensor, loss_func)`` as megatron-core
    expects. On the last pipeline stage ``loss_func(output_tensor)`` computes :class:`LogProbs` and returns
    ``loss_fn(logprobs, micro_batch)`` (``(loss, num_tokens, report)`` or ``(loss, report)``, megatron-core's
    conventions) or, without ``loss_fn``, ``(0, {"logprobs", "entropy", "mask"})``;
    ``loss_func(output_tensor, non_loss_data=True)`` (``collect_non_loss_data=True``, forward-only) returns that dict
    itself. Example::

        step = functools.partial(logprobs_forward_step, temperature=1.0, return_entropy=True)
        out = get_forward_backward_func()(forward_step_func=step, data_iterator=iter(micro_batches), model=[model],
                                          num_microbatches=len(micro_batches), seq_length=..., micro_batch_size=1,
                                          forward_only=True, collect_non_loss_data=True)
        # on the last stage: out == [{"logprobs": [T], "entropy": [T], "mask": [T]}, ...]

    ``seq_length`` / ``micro_batch_size`` describe the tensors sent between stages: ``[s, b, hidden]`` (GLM-5.3-Flash:
    its mHC streams, ``hc_mult * hidden`` wide; the schedule learns that when the model is built) with
    ``s = T`` padded to a multiple of the TP size (THD) and ``b = 1`` (with CP: ``S / CP`` and ``n``; see
    :class:`~megatron_glm5.rl.packing.RankPlan`); use ``variable_seq_lengths=True`` in the model config when
    micro-batches differ in length.
    """
    mb = next(data_iterator)
    if isinstance(mb, dict):
        mb = RolloutMicroBatch(**mb)
    prep = _prepare(model, mb)
    output = _run(model, prep, replay_stats)
    config = unwrap(model).config
    loss_func = functools.partial(_stage_loss, prep, mb, temperature, return_entropy, loss_fn, vocab_size,
                                  _tp_group(config))
    return output, loss_func


def _stage_loss(prep, mb, temperature, return_entropy, loss_fn, vocab_size, tp_group, output_tensor,
                non_loss_data: bool = False):
    result = _logprobs_from_logits(prep, output_tensor, temperature=temperature, return_entropy=return_entropy,
                                   vocab_size=vocab_size, tp_group=tp_group)
    data = {"logprobs": result.logprobs, "entropy": result.entropy, "mask": result.mask}
    if non_loss_data:
        return {k: (v.detach() if v is not None else None) for k, v in data.items()}
    if loss_fn is not None:
        return loss_fn(result, mb)
    return output_tensor.sum() * 0.0, {k: (v.detach() if v is not None else None) for k, v in data.items()}

