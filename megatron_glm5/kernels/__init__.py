"""TileLang kernels for DSA training: sparse absorbed-MLA forward/backward, the lightning indexer + top-k and the
KPool (GLM-5.3-Flash) pool selection built on it.

All kernels use the flattened-token layout of ``megatron_glm5.dsa.reference`` (every token of a micro-batch in one
axis of ``T`` rows, indices are global rows) and that module is their test oracle. TileLang is imported on first
use, so importing this package works without it; the kernels need a CUDA device (SM90).

Public API:

* ``sparse_mla(q, kv, indices, softmax_scale, d_v=512, *, deterministic=False) -> out``
* ``sparse_mla_with_lse(q, kv, indices, softmax_scale, d_v=512, *, deterministic=False, target_box=None) -> (out,
  lse)``; with an ``AttentionTargetBox`` its backward also leaves the head-summed probabilities (the sparse indexer
  loss's target) in the box
* ``indexer_topk(q, k, weights, starts, ends, topk) -> int32 [T, topk]``
* ``kpool_indexer_topk(q, k, gate, ape, weights, cu_seqlens, *, index_topk, select_tail=True, starts=None,
  ends=None) -> int32 [T, index_topk + P - 1]`` (oracle: :mod:`megatron_glm5.dsa.kpool`)
* sparse indexer KL loss (oracle: :mod:`megatron_glm5.dsa.indexer_loss`; contract in
  :mod:`megatron_glm5.kernels.indexer_loss` and :mod:`megatron_glm5.kernels.sparse_attention_target`):
  ``sparse_index_scores(qi, ki, w, topk) -> fp32 [T, K]``,
  ``sparse_attention_target(query, kv, topk, lse, softmax_scale) -> fp32 [T, K]`` (unnormalised head sum),
  ``fused_sparse_indexer_loss(qi, ki, w, topk, target, rw) -> fp32 scalar`` (autograd to qi, ki, w) and
  ``indexer_loss_supported(qi, query, topk) -> bool`` (else use the torch oracle)

Triton kernels (each module holds its contract and names its torch oracle; CPU tests run them in Triton's
interpreter): :mod:`~megatron_glm5.kernels.rms_norm` and :mod:`~megatron_glm5.kernels.swiglu` (switched in
:mod:`megatron_glm5.fusions`), :mod:`~megatron_glm5.kernels.indexer_kl` (the sparse indexer loss's per-row KL), and GLM-5.3-Flash's mHC:
:mod:`~megatron_glm5.kernels.stream_mix` (``stream_mix(x, a, b=None, y=None)``) and
:mod:`~megatron_glm5.kernels.mhc_coefficients` (``mhc_coefficients(z, base, scale, n, iters, eps)``), chosen by
``MEGATRON_GLM5_MHC_KERNEL`` (:mod:`megatron_glm5.glm5_next.mhc`).

GLM-5's softmax scale is 1/16 (``qk_head_dim ** -0.5`` with 192 + 64): always pass it explicitly. GLM-5.3-Flash
(NoPE) uses the same sparse-MLA kernels with ``d_qk = d_v = 512`` (no RoPE tail), scale 1/16 as well.
"""

from typing import Optional

import torch

from megatron_glm5.kernels.indexer_loss import (
    SparseIndexerLoss,
    fused_sparse_indexer_loss,
    indexer_loss_supported,
    sparse_index_scores,
)
from megatron_glm5.kernels.indexer_topk import indexer_topk_interface
from megatron_glm5.kernels.kpool_topk import kpool_select_topk
from megatron_glm5.kernels.sparse_attention_target import sparse_attention_target
from megatron_glm5.kernels.sparse_mla_bwd import AttentionTargetBox, sparse_mla_autograd

__all__ = [
    "AttentionTargetBox",
    "SparseIndexerLoss",
    "fused_sparse_indexer_loss",
    "indexer_loss_supported",
    "indexer_topk",
    "kpool_indexer_topk",
    "sparse_attention_target",
    "sparse_index_scores",
    "sparse_mla",
    "sparse_mla_with_lse",
]


def sparse_mla_with_lse(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int = 512,
    *,
    deterministic: bool = False,
    target_box: Optional[AttentionTargetBox] = None,
    grouped: bool = False,
    key_blocks: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse absorbed-MLA attention, differentiable in ``q`` and ``kv`` (and through ``lse``).

    Args:
        q: ``[T, H, D]`` bf16 (GLM-5: D = 576 = 512 latent + 64 rope), H per rank in [1, 128].
        kv: ``[T_kv, D]`` bf16 latent keys; the first ``d_v`` channels are the values.
        indices: int32 ``[T, K]`` global rows of ``kv``; -1 marks an unused slot (never read).
        softmax_scale: multiplies ``q . k`` (GLM-5: 1/16).
        deterministic: bitwise reproducible backward (no float atomics), at a documented cost.
        target_box: the backward also stores the unnormalised head-summed probabilities ``[T, K]`` fp32 there.
        grouped: at 16 heads, neighbouring queries share one kernel program over the union of their index sets
            (``kernels.index_groups``); faster where their sets overlap.
        key_blocks: the backward forms dKV by key blocks where that pays (``kernels.sparse_mla_dkv``: no float
            atomics); each row's valid indices must be distinct (the indexer's top-k).
    Returns: ``out [T, H, d_v]`` bf16 and natural-log ``lse [T, H]`` fp32 (+inf, out 0 on rows without an index).
    """
    return sparse_mla_autograd(q, kv, indices, softmax_scale, d_v, deterministic=deterministic, target_box=target_box,
                               grouped=grouped, key_blocks=key_blocks)


def sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int = 512,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """``sparse_mla_with_lse(...)[0]``."""
    return sparse_mla_autograd(q, kv, indices, softmax_scale, d_v, deterministic=deterministic)[0]


def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """Lightning indexer + exact top-k: int32 ``[T, topk]``, sorted by score desc, ties to the lower index, -1 tail.

    ``score[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])`` (fp32) over ``starts[t] <= s < ends[t]``.
    Shapes: q ``[T, Hi, Di]`` bf16, k ``[T_kv, Di]`` bf16, weights ``[T, Hi]`` (fp32; other float dtypes are
    converted), starts/ends ``[T]`` (int32; other integer dtypes are converted).
    """
    weights = weights.to(torch.float32).contiguous()
    starts = starts.to(torch.int32).contiguous()
    ends = ends.to(torch.int32).contiguous()
    return indexer_topk_interface(q, k, weights, starts, ends, topk)


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
    starts: Optional[torch.Tensor] = None,
    ends: Optional[torch.Tensor] = None,
    validate: bool = False,
) -> torch.Tensor:
    """KPool indexer selection (GLM-5.3-Flash): pool keys, pool scores, pool top-k, expansion and the tail pool.

    Same contract and output as :func:`megatron_glm5.dsa.kpool.kpool_topk` of
    :func:`~megatron_glm5.dsa.kpool.pool_keys` (int32 ``[T_q, index_topk + P - 1]``, ``[T_q, index_topk]`` without
    the tail; pools by descending score, ties to the lower pool, then the tail; -1 padded), computed on the device
    without host synchronisation (:mod:`megatron_glm5.kernels.kpool_topk`).

    Args:
        q: ``[T_q, Hi, Di]`` bf16 indexer queries; ``weights`` ``[T_q, Hi]`` head weights with the scales folded in
            (fp32; other float dtypes are converted).
        k, gate: ``[T_k, Di]`` bf16 indexer keys and pooling logits; ``ape`` ``[P, Di]`` (``P = index_kpool``).
        cu_seqlens: int ``[n_docs + 1]`` document boundaries of the key rows (on q's device, or it is copied there).
        index_topk: token budget of the pools, a multiple of ``P``.
        starts, ends: int ``[T_q]`` key range ``[starts, ends)`` of each query; ``starts`` must be the first row of
            the query's document (empty ranges give all -1). Default: causal bounds of ``cu_seqlens`` (``T_q = T_k``).
        validate: check that the non-empty ranges start at document starts (one host synchronisation).
    """
    if starts is None or ends is None:
        from megatron_glm5.kernels.bounds import causal_bounds

        starts, ends = causal_bounds(cu_seqlens.to(q.device), total=q.shape[0])
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    return kpool_select_topk(
        q.contiguous(),
        k.contiguous(),
        gate,
        ape,
        weights.to(torch.float32).contiguous(),
        cu,
        starts.to(device=q.device, dtype=torch.int32).contiguous(),
        ends.to(device=q.device, dtype=torch.int32).contiguous(),
        index_topk=index_topk,
        select_tail=select_tail,
        validate=validate,
    )
