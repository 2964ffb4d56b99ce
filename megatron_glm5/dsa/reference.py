"""Pure-PyTorch DSA: lightning-indexer scores, causal top-k, sparse (absorbed) MLA. The CPU backend and the test
oracle for every kernel in ``megatron_glm5/kernels``.

Layout (shared with the kernels): all tokens of a micro-batch flattened into one axis of ``T`` rows, as in THD
packing. A bshd batch ``[b, s]`` is the packed case with ``cu_seqlens = [0, s, 2s, ..., b*s]``. Every index is a
*global row* in that flattened axis, so one code path serves both layouts and indices never cross a sequence
boundary because the per-row bounds ``[starts[t], ends[t])`` never do.

Memory: every function walks the queries in chunks of ``chunk`` rows, never forming ``[T, T]``.

* The indexer (no gradient): the largest temporary is ``chunk x (key window)`` fp32 scores.
* Sparse MLA, forward and backward alike: one chunk's gathered keys ``chunk x topk x d`` fp32 (in the backward, the
  keys and then their gradient, never both) plus a few ``chunk x heads x topk`` score/probability tensors. For the
  backward autograd keeps only the inputs (``q``, ``kv``, ``indices``: references the caller holds anyway) and the
  ``[T, heads]`` LSE; the backward recomputes each chunk's keys and probabilities from them, so the extra memory held
  between forward and backward is O(T x heads), independent of ``topk`` and ``d``. Besides, each pass holds buffers
  the size of its inputs: the output or the gradients, an fp32 copy of ``kv`` when it is not fp32 already, and
  ``dkv`` accumulated in fp32 (one scratch row more than ``kv``).

Conventions (the kernel contracts):

* ``topk`` indices are ``int32 [T, topk]``, sorted by descending index score, ties broken towards the **lower**
  index (deterministic), padded at the tail with ``-1`` when a row has fewer than ``topk`` candidates
  (``min(topk, ends - starts)`` valid entries). ``-1`` entries are never read.
* Index scores: ``score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])`` in fp32, with ``w`` already holding
  ``n_heads**-0.5 * head_dim**-0.5`` (megatron-core's convention).
* Sparse MLA returns the natural-log LSE per (row, head); a row with no valid index returns output 0 and
  ``lse = +inf`` (so ``exp(s - lse) = 0`` in any backward).
"""

from __future__ import annotations

import torch

from ..kernels.bounds import causal_bounds  # noqa: F401  (re-exported: the kernels own it, callers read it here)

# Query rows per chunk: bounds the temporaries to chunk x S fp32 (indexer) and chunk x topk x d (attention, forward
# and backward); the backends' torch fallbacks use it too.
DEFAULT_CHUNK = 1024


def uniform_cu_seqlens(batch: int, seqlen: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``cu_seqlens`` of a bshd batch flattened batch-major (row ``b * seqlen + s``)."""
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``q [c, H, D]``, ``k [S, D]``, ``weights [c, H]`` -> fp32 ``[c, S]`` = sum_h w * relu(q . k)."""
    acc = _acc_dtype(q.dtype)
    logits = torch.einsum("chd,sd->chs", q.to(acc), k.to(acc)).clamp_min_(0.0)
    return torch.einsum("chs,ch->cs", logits, weights.to(acc))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation, or fp64 when the inputs already are (tests use fp64 to pin exact math)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.no_grad()
def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    topk: int,
    *,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Lightning indexer + top-k, streamed over query chunks.

    Args:
        q: ``[T, H, D]`` indexer queries (RoPE applied). k: ``[T, D]`` indexer keys (normed, RoPE applied).
        weights: ``[T, H]`` per-head gates (scales folded in). starts/ends: ``[T]`` int, candidate key range.
        topk: output width; rows with fewer candidates are padded with -1.
    Returns: int32 ``[T, topk]`` global row indices, sorted by score desc, ties -> lower index.
    """
    t_total = q.shape[0]
    out = torch.full((t_total, topk), -1, dtype=torch.int32, device=q.device)
    starts64, ends64 = starts.to(torch.int64), ends.to(torch.int64)
    for c0 in range(0, t_total, chunk):
        c1 = min(t_total, c0 + chunk)
        lo = int(starts64[c0:c1].min())
        hi = int(ends64[c0:c1].max())
        if hi <= lo:
            continue
        scores = indexer_scores(q[c0:c1], k[lo:hi], weights[c0:c1])  # [c, window]
        keys = torch.arange(lo, hi, device=q.device)
        valid = (keys[None, :] >= starts64[c0:c1, None]) & (keys[None, :] < ends64[c0:c1, None])
        scores = scores.masked_fill(~valid, float("-inf"))
        width = min(topk, hi - lo)
        # A stable descending sort keeps equal scores in ascending key order: the lower index wins a tie.
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :width]
        picked_valid = torch.gather(valid, 1, order)
        idx = torch.where(picked_valid, order + lo, torch.full_like(order, -1))
        out[c0:c1, :width] = idx.to(torch.int32)
    return out


def sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    *,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse absorbed-MLA attention (differentiable; fp32 math, output in ``q.dtype``).

    ``out[t, h] = sum_k softmax_k(scale * q[t, h] . kv[i_k]) * kv[i_k, :d_v]`` over the slots ``i_k = indices[t, k]``
    that are not -1. Every slot is a softmax term of its own: an index repeated in a row counts once per repeat.
    Forward and backward walk the query rows in chunks; only ``lse`` is kept for the backward, which recomputes each
    chunk's keys and probabilities (:class:`_SparseMLA`).

    Args:
        q: ``[T, H, D]`` absorbed queries (``D = kv_lora_rank + rope``, 576 for GLM-5).
        kv: ``[S, D]`` latent keys; the first ``d_v`` channels double as values.
        indices: int ``[T, K]`` global rows of ``kv``, -1 = unused slot.
        softmax_scale: multiplies q . k (GLM-5: 1/16).
    Returns: ``out [T, H, d_v]`` (q.dtype) and natural-log ``lse [T, H]`` fp32 (fp64 for fp64 ``q``; +inf on rows
    with no index). Gradients reach ``q`` and ``kv`` through both outputs.
    """
    return _SparseMLA.apply(q, kv, indices, softmax_scale, d_v, chunk)


def _chunk_keys(kv_acc: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``kv_acc`` rows of one chunk's slots, ``[c, K, D]``; -1 slots gather row 0 (cheap) and are then zeroed in place
    so nothing of row 0 (not even a NaN) reaches the output or the gradients."""
    c, k = idx.shape
    keys = kv_acc.index_select(0, idx.clamp_min(0).reshape(-1)).view(c, k, kv_acc.shape[-1])
    return keys.masked_fill_(~valid[..., None], 0.0)


def _chunk_logits(q_c: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * q . k`` for one chunk, ``[c, H, K]``, -inf on -1 slots."""
    logits = torch.bmm(q_c, keys.transpose(1, 2)).mul_(scale)
    return logits.masked_fill_(~valid[:, None, :], float("-inf"))


class _SparseMLA(torch.autograd.Function):
    """:func:`sparse_mla` with a recomputing backward.

    Saved for the backward: the inputs ``q``, ``kv``, ``indices`` (references the caller holds anyway) and the
    ``[T, H]`` LSE; no output, no per-chunk tensor. Per query chunk the backward gathers the keys ``G`` again,
    recomputes ``P = exp(s - lse)`` and, with ``dP = dO . V^T`` and ``delta = sum_k P dP`` (equal to ``dO . O``, so the
    output need not be kept), forms ``dS = P * (dP - delta + dlse)``; then ``dq = scale * dS . G`` and
    ``dG = scale * dS^T . q + [P^T . dO | 0]``, scattered into ``dkv`` with ``index_add_`` (repeated indices add up;
    -1 slots land on a scratch row that is dropped).
    """

    @staticmethod
    def forward(ctx, q, kv, indices, softmax_scale, d_v, chunk):
        t_total, heads, _ = q.shape
        acc = _acc_dtype(q.dtype)
        ctx.set_materialize_grads(False)
        ctx.softmax_scale, ctx.d_v, ctx.chunk = softmax_scale, d_v, chunk
        if t_total == 0:
            lse = q.new_zeros(0, heads, dtype=torch.float32)
            ctx.save_for_backward(q, kv, indices, lse)
            return q.new_zeros(0, heads, d_v), lse
        out = q.new_empty(t_total, heads, d_v)
        lse = torch.empty(t_total, heads, dtype=acc, device=q.device)
        with torch.autocast(q.device.type, enabled=False):
            kv_acc = kv.to(acc)
            for c0 in range(0, t_total, chunk):
                c1 = min(t_total, c0 + chunk)
                idx = indices[c0:c1].long()
                valid = idx >= 0
                keys = _chunk_keys(kv_acc, idx, valid)  # [c, K, D]
                probs = _chunk_logits(q[c0:c1].to(acc), keys, valid, softmax_scale)  # [c, H, K]
                lse_c = torch.logsumexp(probs, dim=-1)  # -inf on rows with no valid slot
                empty = torch.isneginf(lse_c)
                probs.sub_(lse_c.masked_fill(empty, 0.0)[..., None]).exp_()  # exp(-inf) = 0 on -1 slots and empty rows
                out[c0:c1] = torch.bmm(probs, keys[..., :d_v])
                lse[c0:c1] = lse_c.masked_fill_(empty, float("inf"))
                del keys, probs  # freed before the next chunk's are allocated: one chunk alive at a time
        ctx.save_for_backward(q, kv, indices, lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, kv, indices, lse = ctx.saved_tensors
        scale, d_v, chunk = ctx.softmax_scale, ctx.d_v, ctx.chunk
        need_dq, need_dkv = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        t_total, heads, d = q.shape
        dq = torch.zeros_like(q) if need_dq else None
        dkv = torch.zeros_like(kv) if need_dkv else None
        if t_total == 0 or (grad_out is None and grad_lse is None) or not (need_dq or need_dkv):
            return dq, dkv, None, None, None, None
        acc = _acc_dtype(q.dtype)
        s_rows = kv.shape[0]
        with torch.autocast(q.device.type, enabled=False):
            kv_acc = kv.to(acc)
            # One extra scratch row receives the -1 slots' (zero, or NaN from a poisoned row 0) contributions.
            dkv_acc = torch.zeros(s_rows + 1, d, dtype=acc, device=kv.device) if need_dkv else None
            for c0 in range(0, t_total, chunk):
                c1 = min(t_total, c0 + chunk)
                idx = indices[c0:c1].long()
                valid = idx >= 0
                q_c = q[c0:c1].to(acc)
                keys = _chunk_keys(kv_acc, idx, valid)  # [c, K, D]
                probs = _chunk_logits(q_c, keys, valid, scale)
                # lse is +inf on empty rows, so every probability there is exp(-inf) = 0.
                probs.sub_(lse[c0:c1, :, None].to(acc)).exp_()  # P [c, H, K]
                if grad_out is not None:
                    do_c = grad_out[c0:c1].to(acc)  # [c, H, d_v]
                    ds = torch.bmm(do_c, keys[..., :d_v].transpose(1, 2)).mul_(probs)  # P * dP
                    row = ds.sum(-1).neg_()  # -delta
                else:
                    do_c = None
                    ds = torch.zeros_like(probs)
                    row = torch.zeros(c1 - c0, heads, dtype=acc, device=q.device)
                if grad_lse is not None:
                    row.add_(grad_lse[c0:c1].to(acc))
                ds.addcmul_(probs, row[..., None]).mul_(scale)  # dS = P * (dP - delta + dlse), times scale
                if need_dq:
                    dq[c0:c1] = torch.bmm(ds, keys)
                del keys  # at most one [c, K, D] temporary alive: the keys, then their gradient
                if need_dkv:
                    # dG = [scale dS | P]^T . [q | dO, 0-padded to D]: one [c, K, D] product
                    lhs = ds if do_c is None else torch.cat([ds, probs], dim=1)
                    rhs = q_c if do_c is None else torch.cat([q_c, torch.nn.functional.pad(do_c, (0, d - d_v))], dim=1)
                    del ds, probs
                    dkeys = torch.bmm(lhs.transpose(1, 2), rhs)  # [c, K, D]
                    slot = torch.where(valid, idx, s_rows).reshape(-1)
                    dkv_acc.index_add_(0, slot, dkeys.view(-1, d))
                    del dkeys, lhs, rhs
                else:
                    del ds, probs
            if need_dkv:
                dkv.copy_(dkv_acc[:s_rows])
        return dq, dkv, None, None, None, None


def pad_topk(indices: torch.Tensor, width: int) -> torch.Tensor:
    """Pad (with -1) or check a top-k tensor to a fixed width, so shapes stay static when a sequence is shorter
    than ``index_topk`` and fused kernels that need ``topk % 64 == 0`` keep working."""
    k = indices.shape[-1]
    if k == width:
        return indices
    if k > width:
        raise ValueError(f"top-k width {k} exceeds the fixed width {width}")
    pad = indices.new_full((*indices.shape[:-1], width - k), -1)
    return torch.cat([indices, pad], dim=-1)


@torch.no_grad()
def dense_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    *,
    budget_bytes: int = 256 << 20,
) -> torch.Tensor:
    """Dense causal absorbed MLA (every key of ``[starts[t], ends[t])``), no gradient: the indexer warm-up's main
    attention, whose parameters are frozen. ``q [T, H, D]``, ``kv [S, D]`` -> ``[T, H, d_v]`` in ``q.dtype``; rows
    without keys give 0. Query chunks keep the fp32 ``[chunk, H, window]`` scores near ``budget_bytes``."""
    t_total, heads, _ = q.shape
    out = q.new_zeros(t_total, heads, d_v)
    if t_total == 0:
        return out
    acc = _acc_dtype(q.dtype)
    chunk = max(1, budget_bytes // max(1, 4 * heads * max(1, kv.shape[0])))
    bounds = torch.stack([starts, ends]).to(torch.int64).cpu()
    kv_acc = kv.to(acc)
    for c0 in range(0, t_total, chunk):
        c1 = min(t_total, c0 + chunk)
        lo, hi = int(bounds[0, c0:c1].min()), int(bounds[1, c0:c1].max())
        if hi <= lo:
            continue
        keys = torch.arange(lo, hi, device=q.device)
        valid = (keys[None, :] >= starts[c0:c1, None].to(torch.int64)) & (keys[None, :] < ends[c0:c1, None].to(torch.int64))
        logits = torch.einsum("chd,wd->chw", q[c0:c1].to(acc), kv_acc[lo:hi]).mul_(softmax_scale)
        logits.masked_fill_(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # empty rows: all -inf -> 0
        out[c0:c1] = torch.einsum("chw,wd->chd", probs, kv_acc[lo:hi, :d_v]).to(q.dtype)
    return out
