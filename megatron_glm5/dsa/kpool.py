"""Pure-PyTorch KPool indexer of GLM-5.3-Flash (HF ``glm5_next``): the CPU oracle for a KPool kernel and the parity
target against transformers' ``Glm5NextTextIndexer``.

The GLM-5 lightning indexer scores every key token; the KPool indexer scores *pools* of ``P = index_kpool``
consecutive tokens and selects ``index_topk // P`` pools per query, then expands them back to token rows and appends
the query's current incomplete pool (the "tail"). Same flattened-token layout as :mod:`.reference`: all tokens of a
micro-batch in one axis of ``T`` rows, documents given by ``cu_seqlens``, every index a global row.

Semantics (transformers 5.24, ``models/glm5_next/modeling_glm5_next.py``, ``Glm5NextTextIndexer``):

* **Pools** are anchored at each document's first row (transformers anchors at a row's first non-pad token; a
  packed document is the same thing): pool ``p`` of a document starting at row ``s`` covers rows
  ``s + p*P .. s + p*P + P - 1``. Only complete pools exist; the trailing ``len % P`` rows belong to no pool.
* **Pool key**, per channel ``c``: ``K_p[c] = sum_j softmax_j(gate[r_j, c] + ape[j, c]) * k[r_j, c]``, the softmax
  over the ``P`` rows of the pool, independently per channel, in fp32, cast to ``k``'s dtype before the weighted sum
  (as transformers does).
* **Score** of pool ``p`` for query ``t``: ``sum_h w[t, h] * relu(q[t, h] . K_p)`` (lightning-indexer style, fp32).
* **Candidates** of query ``t``: the complete pools of its document whose last row is ``< ends[t]`` (i.e. ``<= t``
  for causal bounds); the others score ``finfo(fp32).min`` and, if picked because a row has fewer candidates than
  it selects, come out as ``-1``.
* **Selection**: ``select_k = min(index_topk // P, pools in the document)`` pools by descending score, each
  expanded to its ``P`` rows (ascending). A query whose own pool is complete but not selected does not see itself.
* **Tail** (``select_tail``): the visible rows after the last complete visible pool, ``n = ends - starts`` visible
  rows, ``n % P`` of them, written in ``P - 1`` slots right after the ``select_k * P`` pool slots, -1 padded.
* **Output**: int32 ``[T, index_topk + P - 1]`` (``[T, index_topk]`` without the tail), -1 padded at the right;
  order = pools by descending score, then the tail (not globally sorted). Rows with an empty range are all -1.

Where this differs from transformers (by design): ties in the pool score go to the lower pool (stable sort;
``torch.topk``'s tie order is unspecified); ``select_k`` counts the pools of the query's own document, which is what
transformers does for one sequence or a batch of equal-length unpadded rows. For a padded batch transformers uses
the batch-wide pool count, which moves the tail to a later slot but selects the same indices.

Memory: queries are walked in chunks of ``chunk`` rows; the largest temporary is ``chunk x (pools in the chunk's
key window)`` fp32 scores (``P`` times smaller than :func:`.reference.indexer_topk`'s), never ``[T, T]``. Pool keys
take ``[T / P, D]``; building them gathers ``[T, D]`` once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import DEFAULT_CHUNK, _acc_dtype, causal_bounds, indexer_scores


@dataclass(frozen=True, kw_only=True, slots=True)
class KPoolKeys:
    """The complete pools of every document of a flattened batch, documents in order, pools in row order."""

    keys: torch.Tensor  # [N, D] pool keys, dtype of the token keys
    first_row: torch.Tensor  # int64 [N] global row of each pool's first token
    doc_pool_start: torch.Tensor  # int64 [n_docs + 1] pool-id offsets per document (pools of doc i: [a_i, a_{i+1}))
    cu_seqlens: torch.Tensor  # int64 [n_docs + 1] the documents, global rows
    pool_size: int  # P

    @property
    def num_pools(self) -> int:
        return self.keys.shape[0]


def pool_keys(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, cu_seqlens: torch.Tensor) -> KPoolKeys:
    """Per-channel softmax-weighted pool keys, pools anchored at each document's start.

    Args:
        k: ``[T, D]`` indexer keys, ``k_norm(wk(x))`` (LayerNorm eps 1e-6, no RoPE).
        gate: ``[T, D]`` pooling logits, ``x @ index_kpool_compress_gate.T`` (``compress_gate`` is ``[D, hidden]``).
        ape: ``[P, D]`` ``index_kpool_compress_ape``, added to the logits of pool position ``j``.
        cu_seqlens: int ``[n_docs + 1]`` document boundaries (bshd batch: ``uniform_cu_seqlens``); rows past
            ``cu_seqlens[-1]`` belong to no document.
    Returns: :class:`KPoolKeys` with ``N = sum_i len_i // P`` pools.
    """
    if k.dim() != 2 or gate.shape != k.shape:
        raise ValueError(f"k and gate must both be [T, D]; got k {tuple(k.shape)}, gate {tuple(gate.shape)}")
    if ape.dim() != 2 or ape.shape[1] != k.shape[1]:
        raise ValueError(f"ape must be [P, D={k.shape[1]}], got {tuple(ape.shape)}")
    pool = ape.shape[0]
    cu = cu_seqlens.to(device=k.device, dtype=torch.int64)
    if int(cu[-1]) > k.shape[0]:
        raise ValueError(f"cu_seqlens ends at row {int(cu[-1])} but there are only {k.shape[0]} rows")
    per_doc = (cu[1:] - cu[:-1]) // pool
    doc_pool_start = torch.cat([per_doc.new_zeros(1), per_doc.cumsum(0)])
    n = int(doc_pool_start[-1])
    doc = torch.repeat_interleave(torch.arange(per_doc.numel(), device=k.device), per_doc, output_size=n)
    first_row = cu[doc] + (torch.arange(n, device=k.device) - doc_pool_start[doc]) * pool
    rows = first_row[:, None] + torch.arange(pool, device=k.device)  # [N, P]
    acc = _acc_dtype(k.dtype)
    logits = gate[rows].to(acc) + ape.to(acc)[None]  # [N, P, D]
    probs = torch.softmax(logits, dim=1).to(k.dtype)  # softmax over the pool's P rows, per channel
    keys = (probs * k[rows]).sum(dim=1)  # [N, D], summed in k's dtype as transformers does
    return KPoolKeys(keys=keys, first_row=first_row, doc_pool_start=doc_pool_start, cu_seqlens=cu, pool_size=pool)


def topk_width(index_topk: int, pool_size: int, select_tail: bool = True) -> int:
    """Width of the KPool top-k output: ``index_topk`` plus ``P - 1`` tail slots when the tail is selected."""
    return index_topk + (pool_size - 1 if select_tail else 0)


@torch.no_grad()
def kpool_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    pools: KPoolKeys,
    starts: torch.Tensor,
    ends: torch.Tensor,
    *,
    index_topk: int,
    select_tail: bool = True,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Pool scores, pool top-k, expansion to token rows and the tail, streamed over query chunks.

    Args:
        q: ``[T, H, D]`` indexer queries, ``wq_b(q_resid)`` (no RoPE).
        weights: ``[T, H]`` head weights with the scales folded in:
            ``weights_proj(x) * H**-0.5 * D**-0.5`` (transformers applies ``D**-0.5`` inside the ReLU; equal by
            positive homogeneity).
        pools: :func:`pool_keys` of the key rows.
        starts, ends: int ``[T]`` causal key range ``[starts, ends)`` of each query; ``starts`` must be the first
            row of the query's document in ``pools.cu_seqlens`` (``causal_bounds`` gives exactly that). Empty ranges
            (padding rows) give all -1.
        index_topk: token budget of the pools, a multiple of ``P``.
        select_tail: append the query's incomplete pool (``index_kpool_always_select_tail``).
    Returns: int32 ``[T, topk_width(index_topk, P, select_tail)]`` global rows, -1 padded (see the module docstring
        for the order).
    """
    pool = pools.pool_size
    if index_topk % pool:
        raise ValueError(f"index_topk ({index_topk}) must be a multiple of index_kpool ({pool})")
    t_total = q.shape[0]
    if q.dim() != 3 or weights.shape != q.shape[:2] or starts.shape != (t_total,) or ends.shape != (t_total,):
        raise ValueError(
            f"expected q [T, H, D], weights [T, H], starts/ends [T]; got q {tuple(q.shape)}, weights "
            f"{tuple(weights.shape)}, starts {tuple(starts.shape)}, ends {tuple(ends.shape)}"
        )
    device = q.device
    max_pools = index_topk // pool
    width = topk_width(index_topk, pool, select_tail)
    out = torch.full((t_total, width), -1, dtype=torch.int32, device=device)

    starts64, ends64 = starts.to(device, torch.int64), ends.to(device, torch.int64)
    cu = pools.cu_seqlens.to(device)
    visible = (ends64 - starts64).clamp_min(0)  # [T] rows each query sees
    live = visible > 0
    doc = torch.searchsorted(cu[1:], starts64, right=True).clamp(max=cu.numel() - 2)
    if bool((live & (cu[doc] != starts64)).any()):
        bad = int(torch.nonzero(live & (cu[doc] != starts64))[0])
        raise ValueError(
            f"starts[{bad}] = {int(starts64[bad])} is not a document start in cu_seqlens: KPool anchors pools at the "
            "first row of each document, so starts must be the causal_bounds of the same cu_seqlens"
        )
    doc_start = pools.doc_pool_start.to(device)
    cand_lo = doc_start[doc]  # [T] first pool of the query's document
    cand_hi = torch.where(live, cand_lo + visible // pool, cand_lo)  # pools whose last row is < ends
    select_k = torch.where(live, (doc_start[doc + 1] - cand_lo).clamp(max=max_pools), 0)  # [T]

    keys, first_row = pools.keys, pools.first_row.to(device)
    offsets = torch.arange(pool, device=device)
    for c0 in range(0, t_total, chunk):
        c1 = min(t_total, c0 + chunk)
        lo, hi = int(cand_lo[c0:c1].min()), int(cand_hi[c0:c1].max())
        if hi <= lo:
            continue
        scores = indexer_scores(q[c0:c1], keys[lo:hi], weights[c0:c1])  # [c, W] fp32 (fp64 for fp64 inputs)
        pool_ids = torch.arange(lo, hi, device=device)
        valid = (pool_ids[None] >= cand_lo[c0:c1, None]) & (pool_ids[None] < cand_hi[c0:c1, None])
        scores = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
        kk = min(max_pools, hi - lo)
        # stable descending sort: equal scores keep ascending pool order (lower pool wins a tie)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :kk]  # [c, kk]
        picked = torch.gather(valid, 1, order)  # ranks >= the row's candidate count are invalid
        rows = first_row[lo + order][..., None] + offsets  # [c, kk, P]
        rows = rows.masked_fill(~picked[..., None], -1)
        out[c0:c1, : kk * pool] = rows.flatten(1).to(torch.int32)

    if select_tail and pool > 1:
        slots = torch.arange(pool - 1, device=device)
        tail_count = visible % pool
        tail_first = starts64 + visible - tail_count
        tail = torch.where(slots[None] < tail_count[:, None], tail_first[:, None] + slots, -1)  # [T, P-1]
        out.scatter_(1, select_k[:, None] * pool + slots, tail.to(torch.int32))
    out[~live] = -1
    return out


def kpool_indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    index_topk: int,
    select_tail: bool = True,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """The whole KPool indexer for causal attention over the documents of ``cu_seqlens`` (bshd: uniform):
    :func:`pool_keys` then :func:`kpool_topk` with :func:`~.reference.causal_bounds`. Shapes as there; returns
    int32 ``[T, topk_width(index_topk, P, select_tail)]``."""
    starts, ends = causal_bounds(cu_seqlens.to(q.device), total=q.shape[0])
    pools = pool_keys(k, gate, ape, cu_seqlens)
    return kpool_topk(q, weights, pools, starts, ends, index_topk=index_topk, select_tail=select_tail, chunk=chunk)
