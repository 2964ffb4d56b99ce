"""Pure-PyTorch DSA: lightning-indexer scores, causal top-k, sparse (absorbed) MLA. The CPU backend and the test
oracle for every kernel in ``megatron_glm5/kernels``.

Layout (shared with the kernels): all tokens of a micro-batch flattened into one axis of ``T`` rows, as in THD
packing. A bshd batch ``[b, s]`` is the packed case with ``cu_seqlens = [0, s, 2s, ..., b*s]``. Every index is a
*global row* in that flattened axis, so one code path serves both layouts and indices never cross a sequence
boundary because the per-row bounds ``[starts[t], ends[t])`` never do.

Memory: every function walks the queries in chunks of ``chunk`` rows; the largest temporary is
``chunk x (key window)`` fp32 for the indexer and ``chunk x topk x d`` for sparse attention, never ``[T, T]``.

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

# Query rows per chunk: bounds the temporaries to chunk x S fp32 (indexer) and chunk x topk x d (attention); the
# backends' torch fallbacks use it too.
DEFAULT_CHUNK = 1024


def causal_bounds(cu_seqlens: torch.Tensor, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row candidate key range for packed causal attention: row ``t`` of sequence ``i`` may attend to
    ``[cu_seqlens[i], t + 1)``. Returns ``(starts, ends)`` int32 ``[T]``. Rows past ``cu_seqlens[-1]`` (padding)
    get an empty range."""
    cu = cu_seqlens.to(torch.int64)
    t_total = int(cu[-1]) if total is None else total
    rows = torch.arange(t_total, device=cu.device)
    seq = torch.searchsorted(cu[1:], rows, right=True).clamp(max=cu.numel() - 2)
    starts = cu[seq]
    ends = rows + 1
    pad = rows >= cu[-1]
    starts = torch.where(pad, rows, starts)
    ends = torch.where(pad, rows, ends)
    return starts.to(torch.int32), ends.to(torch.int32)


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

    Args:
        q: ``[T, H, D]`` absorbed queries (``D = kv_lora_rank + rope``, 576 for GLM-5).
        kv: ``[T, D]`` latent keys; the first ``d_v`` channels double as values.
        indices: int ``[T, K]`` global rows of ``kv``, -1 = unused slot.
        softmax_scale: multiplies q . k (GLM-5: 1/16).
    Returns: ``out [T, H, d_v]`` (q.dtype) and natural-log ``lse [T, H]`` fp32 (+inf on rows with no index).
    """
    t_total, heads, _ = q.shape
    acc = _acc_dtype(q.dtype)
    outs, lses = [], []
    for c0 in range(0, t_total, chunk):
        c1 = min(t_total, c0 + chunk)
        idx = indices[c0:c1].long()
        valid = idx >= 0
        # -1 slots gather row 0 (cheap), then are zeroed so nothing of it (not even a NaN) reaches the output.
        gathered = kv[idx.clamp_min(0)].to(acc).masked_fill(~valid[..., None], 0.0)  # [c, K, D]
        logits = torch.einsum("chd,ckd->chk", q[c0:c1].to(acc), gathered) * softmax_scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)  # [c, H]; -inf on empty rows
        empty = torch.isneginf(lse)
        probs = torch.exp(logits - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
        out = torch.einsum("chk,ckd->chd", probs, gathered[..., :d_v])
        outs.append(out.to(q.dtype))
        lses.append(torch.where(empty, torch.full_like(lse, float("inf")), lse).to(torch.promote_types(acc, torch.float32)))
    if not outs:
        return q.new_zeros(0, heads, d_v), q.new_zeros(0, heads, dtype=torch.float32)
    return torch.cat(outs), torch.cat(lses)


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
