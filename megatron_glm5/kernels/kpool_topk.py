"""KPool indexer selection (GLM-5.3-Flash) on the lightning-indexer + top-k kernels of :mod:`.indexer_topk`.

Same contract as the torch reference :func:`megatron_glm5.dsa.kpool.kpool_topk` (its module docstring defines the
semantics: pools of ``P`` rows anchored at each document's first row, complete pools only, a query sees the pools of
its document whose last row is before ``ends[t]``, ``index_topk // P`` pools by descending score with ties to the
lower pool, expansion to ``P`` ascending rows each, the query's incomplete tail pool in ``P - 1`` slots right after
``select_k * P`` pool slots, int32 ``[T_q, index_topk + P - 1]``, -1 padded).

Steps, all on the device and free of host synchronisation (every shape follows from the input shapes):

1. :func:`pool_keys_fixed`: pool keys ``[T_k // P, D]`` in torch, exactly the reference's math (fp32 softmax over
   the pool's ``P`` rows per channel, cast to ``k``'s dtype, weighted sum in ``k``'s dtype). The number of complete
   pools ``N = sum_i len_i // P`` is data dependent but never exceeds ``T_k // P``, so the buffer has that many rows;
   rows ``>= N`` are zero and inside no query's range.
2. :func:`pool_ranges`: each query's candidate pools as a contiguous range ``[pool_lo, pool_hi)`` of the pool axis
   (its document's first pool, plus ``(ends - starts) // P`` complete visible pools) and ``select_k``.
3. The existing streamed kernels score the pool keys as the keys of the lightning indexer
   (``score = sum_h w * relu(q_h . K_p)``, fp32) over those ranges and select the ``index_topk // P`` best pools per
   row, sorted by score, ties to the lower pool, -1 tail (:func:`.indexer_topk.indexer_topk_interface`).
4. :func:`expand_pools`: pools to token rows and the tail, vectorised torch (a gather and a scatter).

Exactness: steps 1, 2 and 4 are bit-exact with the reference (checked on CPU with the reference's own top-k plugged
into step 3, ``tests/test_kpool_kernel_cpu.py``); step 3's fp32 scores differ from the reference's einsum in the last
bits, so the two can only differ where two pool scores are within fp32 rounding of each other at a row's top-k
boundary (the GPU tests exclude exactly those rows; exact ties such as ReLU zeros go to the lower pool in both).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

SelectFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def kernel_supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`kpool_select_topk`'s default (TileLang) selection takes these indexer shapes and dtypes: bf16
    ``q [T, Hi, Di]`` and ``k [T_k, Di]`` with ``Di % 16 == 0`` and ``(128 // Hi) * Hi % 16 == 0`` (the logits
    kernel's GEMM; GLM-5.3-Flash: 32 x 128). Says nothing about the device or TileLang being installed."""
    if q.dim() != 3 or k.dim() != 2 or q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        return False
    heads, dim = q.shape[1], q.shape[2]
    return heads >= 1 and dim % 16 == 0 and (max(1, 128 // heads) * heads) % 16 == 0 and k.shape[1] == dim


def pool_keys_fixed(
    k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keys [T_k // P, D], first_row int32 [T_k // P], doc_pool_start int64 [n_docs + 1])``.

    ``keys[:N]`` / ``first_row[:N]`` equal :func:`megatron_glm5.dsa.kpool.pool_keys`' ``keys`` / ``first_row``
    (``N = doc_pool_start[-1]``); the rows after them are zero keys that start at row 0 and are never selected.
    """
    if k.dim() != 2 or gate.shape != k.shape:
        raise ValueError(f"k and gate must both be [T, D]; got k {tuple(k.shape)}, gate {tuple(gate.shape)}")
    if ape.dim() != 2 or ape.shape[1] != k.shape[1] or ape.shape[0] < 1:
        raise ValueError(f"ape must be [P >= 1, D={k.shape[1]}], got {tuple(ape.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be [n_docs + 1] with n_docs >= 1, got {tuple(cu_seqlens.shape)}")
    pool = ape.shape[0]
    t_k, dim = k.shape
    device = k.device
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    per_doc = (cu[1:] - cu[:-1]).clamp_min(0) // pool
    doc_pool_start = torch.cat([per_doc.new_zeros(1), per_doc.cumsum(0)])
    n_buf = t_k // pool
    ids = torch.arange(n_buf, device=device)
    doc = torch.searchsorted(doc_pool_start[1:], ids, right=True).clamp(max=per_doc.numel() - 1)
    real = ids < doc_pool_start[-1]
    first_row = torch.where(real, cu[doc] + (ids - doc_pool_start[doc]) * pool, 0)
    rows = (first_row[:, None] + torch.arange(pool, device=device)).clamp(max=max(t_k - 1, 0))  # [N_buf, P]
    # The reference's math, op for op (pool_keys): fp32 logits, softmax over the pool's rows per channel, cast to
    # k's dtype, product and sum in k's dtype.
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    logits = gate[rows].to(acc) + ape.to(acc)[None]  # [N_buf, P, D]
    probs = torch.softmax(logits, dim=1).to(k.dtype)
    keys = (probs * k[rows]).sum(dim=1)  # [N_buf, D]
    keys = torch.where(real[:, None], keys, torch.zeros((), dtype=keys.dtype, device=device))
    if n_buf == 0:
        keys = k.new_zeros(0, dim)
    return keys.contiguous(), first_row.to(torch.int32), doc_pool_start


def pool_ranges(
    starts: torch.Tensor,
    ends: torch.Tensor,
    cu_seqlens: torch.Tensor,
    doc_pool_start: torch.Tensor,
    pool: int,
    max_pools: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query: ``(pool_lo int32, pool_hi int32, select_k int64, visible int64)``, all ``[T_q]``.

    ``[pool_lo, pool_hi)`` are the candidate pools (complete pools of the query's document ending before
    ``ends``), ``select_k = min(pools of the document, max_pools)`` (0 for an empty range) and ``visible = ends -
    starts`` (clamped at 0). ``starts`` must be document starts of ``cu_seqlens`` for non-empty ranges (not checked
    here: see :func:`kpool_select_topk`'s ``validate``)."""
    device = doc_pool_start.device
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    starts64, ends64 = starts.to(device, torch.int64), ends.to(device, torch.int64)
    visible = (ends64 - starts64).clamp_min(0)
    live = visible > 0
    doc = torch.searchsorted(cu[1:], starts64, right=True).clamp(max=cu.numel() - 2)
    lo = doc_pool_start[doc]
    hi = torch.where(live, lo + visible // pool, lo)
    select_k = torch.where(live, (doc_pool_start[doc + 1] - lo).clamp(max=max_pools), 0)
    return lo.to(torch.int32), hi.to(torch.int32), select_k, visible


def expand_pools(
    pool_idx: torch.Tensor,
    first_row: torch.Tensor,
    starts: torch.Tensor,
    visible: torch.Tensor,
    select_k: torch.Tensor,
    pool: int,
    width: int,
    select_tail: bool,
) -> torch.Tensor:
    """int32 ``[T_q, max_pools]`` selected pools (-1 padded) -> int32 ``[T_q, width]`` token rows: each pool's ``P``
    rows ascending, then (``select_tail``) the ``visible % P`` tail rows from slot ``select_k * P``, -1 elsewhere."""
    t_q, max_pools = pool_idx.shape
    device = pool_idx.device
    out = torch.full((t_q, width), -1, dtype=torch.int32, device=device)
    if t_q == 0:
        return out
    picked = pool_idx >= 0
    base = first_row.index_select(0, pool_idx.clamp_min(0).reshape(-1).long()).view(t_q, max_pools) \
        if first_row.numel() else torch.zeros_like(pool_idx)
    rows = base[..., None] + torch.arange(pool, dtype=torch.int32, device=device)  # [T_q, max_pools, P]
    rows.masked_fill_(~picked[..., None], -1)
    out[:, : max_pools * pool] = rows.view(t_q, max_pools * pool)
    if select_tail and pool > 1:
        slots = torch.arange(pool - 1, device=device)
        tail_count = visible % pool
        tail_first = starts.to(device, torch.int64) + visible - tail_count
        tail = torch.where(slots[None] < tail_count[:, None], tail_first[:, None] + slots, -1)  # [T_q, P-1]
        out.scatter_(1, select_k[:, None] * pool + slots, tail.to(torch.int32))
    return out


def kpool_select_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    *,
    index_topk: int,
    select_tail: bool = True,
    select_fn: Optional[SelectFn] = None,
    validate: bool = False,
) -> torch.Tensor:
    """Steps 1-4 of the module docstring. ``select_fn(q, keys, weights, pool_lo, pool_hi, max_pools)`` is the
    indexer + top-k over the pool keys (default: the TileLang kernels; tests plug in
    :func:`megatron_glm5.dsa.reference.indexer_topk`). ``validate`` checks that every non-empty range starts at a
    document start (one host synchronisation)."""
    pool = ape.shape[0] if ape.dim() == 2 else 0
    if pool < 1:
        raise ValueError(f"ape must be [P >= 1, D], got {tuple(ape.shape)}")
    if not isinstance(index_topk, int) or index_topk < pool or index_topk % pool:
        raise ValueError(f"index_topk ({index_topk!r}) must be a positive multiple of index_kpool ({pool})")
    t_q = q.shape[0]
    if q.dim() != 3 or weights.shape != q.shape[:2] or starts.shape != (t_q,) or ends.shape != (t_q,):
        raise ValueError(
            f"expected q [T, H, D], weights [T, H], starts/ends [T]; got q {tuple(q.shape)}, weights "
            f"{tuple(weights.shape)}, starts {tuple(starts.shape)}, ends {tuple(ends.shape)}"
        )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must be [T_k, {q.shape[-1]}] like q's last dim, got {tuple(k.shape)}")
    max_pools = index_topk // pool
    width = index_topk + (pool - 1 if select_tail else 0)
    keys, first_row, doc_pool_start = pool_keys_fixed(k, gate, ape, cu_seqlens)
    lo, hi, select_k, visible = pool_ranges(starts, ends, cu_seqlens, doc_pool_start, pool, max_pools)
    if validate:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
        s64 = starts.to(q.device, torch.int64)
        doc = torch.searchsorted(cu[1:], s64, right=True).clamp(max=cu.numel() - 2)
        bad = (visible > 0) & (cu[doc] != s64)
        if bool(bad.any()):
            row = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"starts[{row}] = {int(s64[row])} is not a document start in cu_seqlens: KPool anchors pools at the "
                "first row of each document"
            )
    if select_fn is None:
        from megatron_glm5.kernels.indexer_topk import indexer_topk_interface

        select_fn = indexer_topk_interface
    pool_idx = select_fn(q, keys, weights, lo, hi, max_pools)
    return expand_pools(pool_idx, first_row, starts, visible, select_k, pool, width, select_tail)
