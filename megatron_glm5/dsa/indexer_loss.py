"""The DSA indexer's KL loss (DeepSeek-V3.2 sec. 2.1, megatron-core 0.19.2's semantics) in bounded memory, and the
attention-mass recall diagnostic. Pure PyTorch on the flattened-row layout of :mod:`megatron_glm5.dsa.reference`;
the oracle of the fused kernels in :mod:`megatron_glm5.kernels.indexer_loss`.

For each valid query row ``t`` (a row with at least one key) and its key set ``S_t``:

* target ``p[t, s] = normalise_s( sum_h softmax_{S_t}(scale * q[t, h] . kv[s]) )``: the main attention's
  probabilities in fp32, summed over every head (all TP ranks: heads are split, the partial sums are all-reduced),
  L1-normalised (megatron-core's ``normalize_indexer_target``, eps 1e-10);
* prediction ``log_softmax_{S_t}(score[t])`` with ``score[t, s] = sum_h w[t, h] * relu(qi[t, h] . ki[s])``;
* ``KL_t = sum_s p (log max(p, 1e-10) - log_pred)``; loss ``= coeff * sum_t KL_t / N`` over the ``N`` valid rows
  (``per_token=True``, megatron-core's ``calculate_per_token_loss``: ``coeff * sum_t KL_t``).

``S_t`` is the row's selected top-k keys (sparse loss; -1 slots excluded) or all its causal keys
``[starts[t], ends[t])`` (dense loss, the warm-up stage). Only ``qi``, ``ki`` and ``w`` receive gradients; the
attention inputs are constants here (``d score = coeff / N * (softmax(score) * sum(p) - p)``, then through the ReLU
and the head weights).

Memory: rows are walked in chunks sized by ``budget_bytes``; nothing of size ``[heads, T, T]`` or ``[T, T]`` is formed.
The sparse loss keeps its ``[T, K]`` fp32 target for the backward (computed once); the dense loss keeps nothing of
size ``T x keys`` and recomputes each chunk's target in the backward (with the same TP all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

TARGET_EPS = 1e-10  # megatron-core's INDEXER_LOSS_EPS
DEFAULT_BUDGET_BYTES = 256 << 20  # per-chunk fp32 temporaries


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_per_chunk(per_row_elems: int, budget_bytes: int) -> int:
    return max(1, budget_bytes // max(1, 4 * per_row_elems))


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def _normalise_(target: torch.Tensor) -> torch.Tensor:
    return target.div_(target.sum(-1, keepdim=True).clamp_min(TARGET_EPS))


def finish_target_(partial: torch.Tensor, tp_group=None) -> torch.Tensor:
    """In place: this rank's head-summed probabilities ``[T, K]`` -> the target, summed over the TP group's heads
    and L1-normalised per row (megatron-core's ``normalize_indexer_target``)."""
    return _normalise_(_all_reduce(partial, tp_group))


def _kl_rows(target: torch.Tensor, log_pred: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``sum_s p (log max(p, eps) - log_pred)`` per row; invalid slots contribute 0 (even with -inf ``log_pred``)."""
    terms = target * (target.clamp_min(TARGET_EPS).log() - log_pred)
    return terms.masked_fill(~valid, 0.0).sum(-1)


def valid_query_rows(starts: torch.Tensor, ends: torch.Tensor, real_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bool ``[T]``: rows that attend to at least one key (padding rows of a THD batch do not), and are real tokens
    when ``real_rows`` is given (megatron-core's ``query_valid_rows``)."""
    valid = ends > starts
    return valid if real_rows is None else valid & real_rows.to(torch.bool)


def row_weights(valid: torch.Tensor, coeff: float, per_token: bool) -> torch.Tensor:
    """fp32 ``[T]``: each row's factor in the loss, ``coeff / N`` on valid rows (``coeff`` in per-token mode), 0
    elsewhere. ``N`` stays a device tensor (no host sync)."""
    w = valid.to(torch.float32) * coeff
    return w if per_token else w / valid.sum().clamp_min(1).to(torch.float32)


# --------------------------------------------------------------------------------------------------------------------
# Targets (no gradient)
# --------------------------------------------------------------------------------------------------------------------


def _row_chunks(topk: torch.Tensor, chunk: int):
    """``(c0, c1, idx int64 [c, K], valid [c, K])`` per chunk of rows of a top-k."""
    for c0 in range(0, topk.shape[0], chunk):
        c1 = min(topk.shape[0], c0 + chunk)
        idx = topk[c0:c1].long()
        yield c0, c1, idx, idx >= 0


def _head_summed_probs(logits: torch.Tensor, lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum_h exp(logits - lse_h)`` over ``logits [c, H, K]`` (-inf where masked): each head's softmax, or with
    ``lse [c, H]`` the attention's own LSE; rows without a key (LSE +-inf) give 0. Consumes ``logits``."""
    row_lse = torch.logsumexp(logits, dim=-1, keepdim=True) if lse is None else lse[..., None].to(logits.dtype)
    row_lse = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))  # empty rows: exp(-inf) = 0
    return logits.sub_(row_lse).exp_().sum(1)


def _gather_rows(src: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``src`` rows of each slot, ``[c, K, D]``, zero on -1 slots."""
    c, k = idx.shape
    out = src.index_select(0, idx.clamp_min(0).reshape(-1)).view(c, k, src.shape[-1])
    return out.masked_fill_(~valid[..., None], 0.0)


@torch.no_grad()
def sparse_target(
    query: torch.Tensor,
    kv: torch.Tensor,
    topk: torch.Tensor,
    softmax_scale: float,
    *,
    lse: Optional[torch.Tensor] = None,
    tp_group=None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> torch.Tensor:
    """Normalised head-summed attention probabilities over each row's selected keys, fp32 ``[T, K]`` (0 on -1 slots
    and on rows without a slot).

    ``query [T, H, D]`` (this rank's heads), ``kv [S, D]``, ``topk`` int ``[T, K]``. With ``lse [T, H]`` (the sparse
    attention's natural-log LSE over the same slots, +inf on empty rows) the probabilities are ``exp(logit - lse)``
    as the attention computed them; without it each head's softmax is formed here.
    """
    t_total, heads, d = query.shape
    k = topk.shape[1]
    acc = _acc(query.dtype)
    out = torch.zeros(t_total, k, dtype=acc, device=query.device)
    chunk = _rows_per_chunk(k * (d + 2 * heads), budget_bytes)
    kv_acc = kv.to(acc)
    for c0, c1, idx, valid in _row_chunks(topk, chunk):
        keys = _gather_rows(kv_acc, idx, valid)
        logits = torch.bmm(query[c0:c1].to(acc), keys.transpose(1, 2)).mul_(softmax_scale)  # [c, H, K]
        logits.masked_fill_(~valid[:, None, :], float("-inf"))
        out[c0:c1] = _head_summed_probs(logits, None if lse is None else lse[c0:c1])
    return finish_target_(out, tp_group)


def _dense_target_chunk(query_c: torch.Tensor, kv_window: torch.Tensor, valid: torch.Tensor, softmax_scale: float,
                        tp_group) -> torch.Tensor:
    """Normalised head-summed probabilities of one chunk over its key window ``[c, W]`` (invalid keys 0)."""
    logits = torch.einsum("chd,wd->chw", query_c.to(kv_window.dtype), kv_window).mul_(softmax_scale)
    logits.masked_fill_(~valid[:, None, :], float("-inf"))
    return finish_target_(_head_summed_probs(logits), tp_group)


@torch.no_grad()
def sparse_index_scores(qi: torch.Tensor, ki: torch.Tensor, w: torch.Tensor, topk: torch.Tensor, *,
                        budget_bytes: int = DEFAULT_BUDGET_BYTES) -> torch.Tensor:
    """Index scores of each row's selected keys, fp32 ``[T, K]``: ``sum_h w[t, h] * relu(qi[t, h] . ki[topk[t, k]])``,
    ``-inf`` on -1 slots (the oracle of the fused kernel)."""
    t_total, hi, di = qi.shape
    k = topk.shape[1]
    acc = _acc(qi.dtype)
    out = torch.empty(t_total, k, dtype=acc, device=qi.device)
    chunk = _rows_per_chunk(k * (di + 2 * hi), budget_bytes)
    ki_acc = ki.to(acc)
    for c0, c1, idx, valid in _row_chunks(topk, chunk):
        _, score = _scores(qi[c0:c1].to(acc), _gather_rows(ki_acc, idx, valid), w[c0:c1].to(acc), shared_keys=False)
        out[c0:c1] = score.masked_fill_(~valid, float("-inf"))
    return out


# --------------------------------------------------------------------------------------------------------------------
# Index scores and their gradient, per chunk
# --------------------------------------------------------------------------------------------------------------------


def _scores(qi_c: torch.Tensor, keys: torch.Tensor, w_c: torch.Tensor, shared_keys: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z [c, Hi, K], score [c, K])``: per-head dots and ``sum_h w relu(z)``. ``keys`` is ``[c, K, Di]`` (per-row
    gathered) or ``[K, Di]`` (one window shared by the chunk)."""
    z = torch.einsum("chd,wd->chw", qi_c, keys) if shared_keys else torch.einsum("chd,ckd->chk", qi_c, keys)
    return z, torch.einsum("chk,ch->ck", z.clamp_min(0.0), w_c)


def _score_grads(dscore: torch.Tensor, z: torch.Tensor, qi_c: torch.Tensor, keys: torch.Tensor, w_c: torch.Tensor,
                 shared_keys: bool):
    """Gradients of ``score = sum_h w relu(z)`` given ``d score [c, K]``: ``(dqi [c, Hi, Di], dkeys, dw [c, Hi])``
    with ``dkeys`` shaped like ``keys``."""
    dw = torch.einsum("ck,chk->ch", dscore, z.clamp_min(0.0))
    dz = dscore[:, None, :] * w_c[:, :, None] * (z > 0)
    if shared_keys:
        return torch.einsum("chw,wd->chd", dz, keys), torch.einsum("chw,chd->wd", dz, qi_c), dw
    return torch.einsum("chk,ckd->chd", dz, keys), torch.einsum("chk,chd->ckd", dz, qi_c), dw


def _dscore(score: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
            rw: torch.Tensor) -> torch.Tensor:
    """``d loss / d score`` for one chunk: ``rw * (softmax(score) * sum(p) - p)``, 0 on invalid slots."""
    pred = (score - lse[:, None]).exp().masked_fill(~valid, 0.0)
    return (pred * target.sum(-1, keepdim=True) - target).mul_(rw[:, None])


def _log_softmax_masked(score: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    masked = score.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(masked, dim=-1)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return masked - lse[:, None], lse


class _SparseIndexerKL(torch.autograd.Function):
    """Loss over the selected keys, given the normalised target ``[T, K]`` (saved: the target, the index LSE
    ``[T]`` and the inputs; the backward regathers each chunk's keys)."""

    @staticmethod
    def forward(ctx, qi, ki, w, topk, target, rw, budget_bytes):
        t_total, hi, di = qi.shape
        k = topk.shape[1]
        acc = _acc(qi.dtype)
        chunk = _rows_per_chunk(k * (di + 3 * hi), budget_bytes)
        ki_acc = ki.to(acc)
        lse = torch.zeros(t_total, dtype=acc, device=qi.device)
        total = torch.zeros((), dtype=acc, device=qi.device)
        for c0, c1, idx, valid in _row_chunks(topk, chunk):
            keys = _gather_rows(ki_acc, idx, valid)
            _, score = _scores(qi[c0:c1].to(acc), keys, w[c0:c1].to(acc), shared_keys=False)
            log_pred, lse[c0:c1] = _log_softmax_masked(score, valid)
            total += (_kl_rows(target[c0:c1], log_pred, valid) * rw[c0:c1]).sum()
        ctx.save_for_backward(qi, ki, w, topk, target, rw, lse)
        ctx.chunk = chunk
        return total.to(torch.float32)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        qi, ki, w, topk, target, rw, lse = ctx.saved_tensors
        acc = _acc(qi.dtype)
        ki_acc = ki.to(acc)
        dqi = torch.zeros_like(qi, dtype=acc)
        dki = torch.zeros(ki.shape[0] + 1, ki.shape[1], dtype=acc, device=ki.device)  # + a scratch row for -1 slots
        dw = torch.zeros_like(w, dtype=acc)
        scale = rw * grad.to(acc)
        for c0, c1, idx, valid in _row_chunks(topk, ctx.chunk):
            keys = _gather_rows(ki_acc, idx, valid)
            qi_c, w_c = qi[c0:c1].to(acc), w[c0:c1].to(acc)
            z, score = _scores(qi_c, keys, w_c, shared_keys=False)
            ds = _dscore(score, lse[c0:c1], target[c0:c1], valid, scale[c0:c1])
            dq_c, dkeys, dw_c = _score_grads(ds, z, qi_c, keys, w_c, shared_keys=False)
            dqi[c0:c1], dw[c0:c1] = dq_c, dw_c
            slot = torch.where(valid, idx, ki.shape[0]).reshape(-1)
            dki.index_add_(0, slot, dkeys.reshape(-1, ki.shape[1]))
        return dqi.to(qi.dtype), dki[:-1].to(ki.dtype), dw.to(w.dtype), None, None, None, None


def _windows(starts: torch.Tensor, ends: torch.Tensor, chunk: int):
    """``(c0, c1, lo, hi)`` per chunk of rows: the key window covering the chunk's ranges (one small host read per
    chunk: the dense loss is the warm-up path, not the hot one)."""
    t_total = starts.shape[0]
    bounds = torch.stack([starts, ends]).to(torch.int64).cpu()
    for c0 in range(0, t_total, chunk):
        c1 = min(t_total, c0 + chunk)
        lo, hi = int(bounds[0, c0:c1].min()), int(bounds[1, c0:c1].max())
        yield c0, c1, lo, max(hi, lo)


class _DenseIndexerKL(torch.autograd.Function):
    """Loss over every causal key; the target is rebuilt chunk by chunk in forward and backward (saved: the inputs
    and the index LSE ``[T]``). With ``recall_topk`` the forward also measures that top-k's recall on the targets it
    builds anyway (second output, ``[2, T]``: captured and best per row; no gradient)."""

    @staticmethod
    def forward(ctx, qi, ki, w, query, kv, starts, ends, rw, softmax_scale, tp_group, chunk, recall_topk):
        acc = _acc(qi.dtype)
        lse = torch.zeros(qi.shape[0], dtype=acc, device=qi.device)
        total = torch.zeros((), dtype=acc, device=qi.device)
        recall = torch.zeros(2, qi.shape[0], dtype=acc, device=qi.device)
        ki_acc, kv_acc = ki.to(acc), kv.to(acc)
        for c0, c1, lo, hi in _windows(starts, ends, chunk):
            if hi == lo:
                continue
            valid = _window_valid(starts[c0:c1], ends[c0:c1], lo, hi)
            target = _dense_target_chunk(query[c0:c1], kv_acc[lo:hi], valid, softmax_scale, tp_group)
            if recall_topk is not None:
                recall[:, c0:c1] = _recall_rows(target, recall_topk[c0:c1], lo, hi)
            _, score = _scores(qi[c0:c1].to(acc), ki_acc[lo:hi], w[c0:c1].to(acc), shared_keys=True)
            log_pred, lse[c0:c1] = _log_softmax_masked(score, valid)
            total += (_kl_rows(target, log_pred, valid) * rw[c0:c1]).sum()
        ctx.save_for_backward(qi, ki, w, query, kv, starts, ends, rw, lse)
        ctx.softmax_scale, ctx.tp_group, ctx.chunk = softmax_scale, tp_group, chunk
        ctx.mark_non_differentiable(recall)
        return total.to(torch.float32), recall

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, _grad_recall):
        qi, ki, w, query, kv, starts, ends, rw, lse = ctx.saved_tensors
        acc = _acc(qi.dtype)
        ki_acc, kv_acc = ki.to(acc), kv.to(acc)
        dqi = torch.zeros_like(qi, dtype=acc)
        dki = torch.zeros_like(ki, dtype=acc)
        dw = torch.zeros_like(w, dtype=acc)
        scale = rw * grad.to(acc)
        for c0, c1, lo, hi in _windows(starts, ends, ctx.chunk):
            if hi == lo:
                continue
            valid = _window_valid(starts[c0:c1], ends[c0:c1], lo, hi)
            target = _dense_target_chunk(query[c0:c1], kv_acc[lo:hi], valid, ctx.softmax_scale, ctx.tp_group)
            qi_c, w_c = qi[c0:c1].to(acc), w[c0:c1].to(acc)
            z, score = _scores(qi_c, ki_acc[lo:hi], w_c, shared_keys=True)
            ds = _dscore(score, lse[c0:c1], target, valid, scale[c0:c1])
            dq_c, dk_win, dw_c = _score_grads(ds, z, qi_c, ki_acc[lo:hi], w_c, shared_keys=True)
            dqi[c0:c1], dw[c0:c1] = dq_c, dw_c
            dki[lo:hi] += dk_win
        return (dqi.to(qi.dtype), dki.to(ki.dtype), dw.to(w.dtype)) + (None,) * 9


def _window_valid(starts_c: torch.Tensor, ends_c: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    keys = torch.arange(lo, hi, device=starts_c.device)
    return (keys[None, :] >= starts_c[:, None]) & (keys[None, :] < ends_c[:, None])


# --------------------------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------------------------


def sparse_indexer_loss(
    qi: torch.Tensor,
    ki: torch.Tensor,
    w: torch.Tensor,
    topk: torch.Tensor,
    target: torch.Tensor,
    rw: torch.Tensor,
    *,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> torch.Tensor:
    """Sparse loss from a precomputed normalised ``target [T, K]`` (:func:`sparse_target`, or a fused kernel's) and
    row weights ``rw [T]`` (:func:`row_weights`). Differentiable in ``qi [T, Hi, Di]``, ``ki [S, Di]``,
    ``w [T, Hi]``."""
    return _SparseIndexerKL.apply(qi, ki, w, topk, target.detach(), rw.detach(), budget_bytes)


def indexer_loss(
    qi: torch.Tensor,
    ki: torch.Tensor,
    w: torch.Tensor,
    query: torch.Tensor,
    kv: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    softmax_scale: float,
    *,
    coeff: float,
    topk: Optional[torch.Tensor] = None,
    per_token: bool = False,
    tp_group=None,
    real_rows: Optional[torch.Tensor] = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> torch.Tensor:
    """The indexer KL loss (module docstring): sparse over ``topk [T, K]`` when given, dense over ``[starts, ends)``
    otherwise. ``query [T, H, D]`` / ``kv [S, D]`` are the main attention's absorbed inputs (used as constants),
    ``qi [T, Hi, Di]`` / ``ki [S, Di]`` / ``w [T, Hi]`` the indexer's (RoPE applied, head scales folded into ``w``).
    Returns an fp32 scalar (``coeff`` included)."""
    rw = row_weights(valid_query_rows(starts, ends, real_rows), coeff, per_token)
    query, kv = query.detach(), kv.detach()
    if topk is not None:
        target = sparse_target(query, kv, topk, softmax_scale, tp_group=tp_group, budget_bytes=budget_bytes)
        return sparse_indexer_loss(qi, ki, w, topk, target, rw, budget_bytes=budget_bytes)
    return dense_indexer_loss(qi, ki, w, query, kv, starts, ends, softmax_scale, rw, tp_group=tp_group,
                              budget_bytes=budget_bytes)[0]


def dense_indexer_loss(
    qi: torch.Tensor,
    ki: torch.Tensor,
    w: torch.Tensor,
    query: torch.Tensor,
    kv: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    softmax_scale: float,
    rw: torch.Tensor,
    *,
    recall_topk: Optional[torch.Tensor] = None,
    tp_group=None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> tuple[torch.Tensor, Optional["RecallStats"]]:
    """The dense loss (:func:`indexer_loss` without ``topk``) with row weights ``rw`` (:func:`row_weights`), and,
    given ``recall_topk [T, K]``, that top-k's :class:`RecallStats` measured on the same dense targets (the
    warm-up's diagnostic at no extra pass over the keys)."""
    chunk = _rows_per_chunk(max(1, kv.shape[0]) * (query.shape[1] + 2 * qi.shape[1] + 4), budget_bytes)
    loss, recall = _DenseIndexerKL.apply(qi, ki, w, query.detach(), kv.detach(), starts, ends, rw.detach(),
                                         softmax_scale, tp_group, chunk, recall_topk)
    if recall_topk is None:
        return loss, None
    return loss, _recall_means(recall, valid_query_rows(starts, ends))


@dataclass(frozen=True, slots=True)
class RecallStats:
    """Mean over valid rows of the dense attention mass the indexer's top-k keys capture (``captured``) and of the
    most any set of as many keys could capture (``best``); both in [0, 1], device tensors."""

    captured: torch.Tensor
    best: torch.Tensor


@torch.no_grad()
def attention_recall(
    query: torch.Tensor,
    kv: torch.Tensor,
    topk: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    softmax_scale: float,
    *,
    tp_group=None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> RecallStats:
    """How well ``topk [T, K]`` covers the dense attention: per row, the target mass (head-summed, normalised dense
    attention probabilities) on its selected keys, and the largest mass any ``n_t`` keys could hold (``n_t`` = the
    row's valid slots). A row shorter than ``K`` selects every key: both are 1 there."""
    acc = _acc(query.dtype)
    recall = torch.zeros(2, query.shape[0], dtype=acc, device=query.device)
    kv_acc = kv.to(acc)
    chunk = _rows_per_chunk(max(1, kv.shape[0]) * (query.shape[1] + 2), budget_bytes)
    for c0, c1, lo, hi in _windows(starts, ends, chunk):
        if hi == lo:
            continue
        valid = _window_valid(starts[c0:c1], ends[c0:c1], lo, hi)
        target = _dense_target_chunk(query[c0:c1].detach(), kv_acc[lo:hi], valid, softmax_scale, tp_group)
        recall[:, c0:c1] = _recall_rows(target, topk[c0:c1], lo, hi)
    return _recall_means(recall, valid_query_rows(starts, ends))


def _recall_rows(target: torch.Tensor, topk_c: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``[2, c]``: per row of a dense target chunk ``[c, hi - lo]``, the mass on its top-k keys and the most any as
    many keys hold."""
    idx = topk_c.long()
    sel = idx >= 0
    captured = torch.gather(target, 1, (idx - lo).clamp(0, hi - lo - 1)).masked_fill_(~sel, 0.0).sum(-1)
    top = torch.sort(target, dim=-1, descending=True).values
    ranks = torch.arange(top.shape[1], device=top.device)
    best = top.masked_fill_(ranks[None, :] >= sel.sum(-1, keepdim=True), 0.0).sum(-1)
    return torch.stack([captured, best])


def _recall_means(recall: torch.Tensor, valid_rows: torch.Tensor) -> RecallStats:
    n = valid_rows.sum().clamp_min(1).to(recall.dtype)
    means = (recall * valid_rows).sum(-1) / n
    return RecallStats(captured=means[0], best=means[1])
